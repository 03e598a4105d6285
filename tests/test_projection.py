"""hiersync.costmodel.projection: rows, files and the plot."""

from __future__ import annotations

import pytest

from hiersync.costmodel.projection import COLUMNS, project, to_csv, to_markdown
from hiersync.tools import cli


def _md_rows(text: str) -> list[list[str]]:
    """The cells (stripped) of every row of the markdown tables in ``text``, headers included, separators not."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")
    ]
    return [r for r in rows if not all(set(c) <= set(":-") for c in r)]


def test_rows_and_shapes():
    rows = project(["h100-8rail", "a100-1nic"], grad_bytes=14e9, backward_s=0.3)
    assert len(rows) == 16 and all(set(r) == set(COLUMNS) for r in rows)
    one_node = rows[0]
    # one node: the two-level all-reduce is the node's own, what NCCL picks (NVLS), not slower than its ring
    assert one_node["gpus"] == 8 and one_node["ar_two_level_ms"] <= one_node["ar_ring_ms"]
    big = rows[7]
    assert big["gpus"] == 1024 and big["ar_tree_ms"] < big["ar_ring_ms"]  # latency of 2046 ring hops
    a100 = rows[15]
    assert a100["step_k8_ms"] < a100["step_k4_ms"] < a100["step_k2_ms"] < a100["step_k1_ms"]
    text = to_markdown(rows)
    assert text.count("\n") == len(rows) + 2 and _md_rows(text)[0] == list(COLUMNS)
    assert _md_rows(text)[1][:3] == ["h100-8rail", "8", "1"] and len(_md_rows(text)) == len(rows) + 1
    assert to_csv(rows).splitlines()[0] == ",".join(COLUMNS)


def test_rejects_uneven_gpu_counts():
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        project(["emulated"], grad_bytes=1e6, backward_s=0.1, gpus=(12,))


def test_cli_writes_table_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["project", "--presets", "emulated", "--params", "25e6", "--max-gpus", "32", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert ["emulated", "32", "4"] in [r[:3] for r in _md_rows(capsys.readouterr().out)]
    assert (tmp_path / "projection.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "projection.csv").read_text().count("\n") == 4
    assert ["emulated", "8", "1"] in [r[:3] for r in _md_rows((tmp_path / "projection.md").read_text())]


def test_streaming_columns():
    rows = project(["a100-1nic"], grad_bytes=14e9, backward_s=0.3, gpus=(8, 16, 128))
    one, two, many = rows
    assert one["step_k4_F4_tau1_ms"] == pytest.approx(one["step_k4_ms"], rel=1e-3)  # one node: nothing to stream
    assert one["peak_ddp_MB"] == one["peak_k4_MB"] == one["peak_k4_F4_MB"] == 0.0
    for row in (two, many):
        assert row["step_k4_F4_tau1_ms"] < row["step_k4_ms"]  # a quarter of the sync per step, hidden 300 ms of it
        assert row["peak_k4_F4_MB"] == pytest.approx(row["peak_k4_MB"] / 4)
        assert row["mean_k4_MB"] == pytest.approx(row["peak_k4_F4_MB"])
    # DDP's flat all-reduce: a node's NICs carry 2(p-1)/p n, 1/8 of it per rank
    assert many["peak_ddp_MB"] == pytest.approx(2 * 127 / 128 * 14e9 / 8 / 2**20)
    assert many["peak_k4_MB"] == pytest.approx(2 * 15 / 16 * 14e9 / 8 / 2**20)


def test_cli_prints_streaming_columns(capsys):
    argv = ["project", "--presets", "a100-1nic", "--max-gpus", "16", "--copy-gbps", "1500"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "step_k4_F4_tau1_ms" in out and "peak_k4_F4_MB" in out
    assert ["a100-1nic", "16", "2"] in [r[:3] for r in _md_rows(out)]

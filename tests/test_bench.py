"""The benchmark suite end to end (tiny), its bookkeeping, and atomic outputs.

The end-to-end runs take a few seconds each: a 20k-parameter MLP for two steps per
schedule on loopback, and the collective microbenchmark at two small sizes (on the
emulated cluster where namespaces are available, exercising torchrun and rendezvous).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from hiersync import cli
from hiersync.tools import bench, collbench, report, testbed
from hiersync.vocab import parse_count


def test_schedule_names():
    s = bench.parse_schedule("hiersync_p4_overlap_bf16")
    assert (s.kind, s.period, s.overlap, s.compress) == ("hiersync", 4, True, "bf16")
    assert bench.parse_schedule("postlocal_k8").period == 8
    assert bench.parse_schedule("hiersync_p1").period == 1
    for bad in ("hiersync_p1_overlap", "hiersync_pk", "fastest", "postlocal_k0"):
        with pytest.raises(ValueError, match=repr(bad)):
            bench.parse_schedule(bad)
    assert bench.timed_steps(bench.parse_schedule("hiersync_p4"), 3) == 4
    assert bench.timed_steps(bench.parse_schedule("ddp"), 3) == 3
    full = bench.full_schedules()
    assert {"ddp", "postlocal_k2", "postlocal_k8", "bf16_hook", "hiersync_p1", "hiersync_p8_overlap_bf16"} <= set(full)


def test_bad_sizes_name_the_value():
    with pytest.raises(ValueError, match="'lots'"):
        parse_count("lots")
    with pytest.raises(ValueError, match="'3'"):
        collbench.parse_sizes("3")
    assert collbench.parse_sizes("4K:1M") == [4096, 16384, 65536, 262144, 1048576]


def _fake_rank(rank: int, step_s: float, schedules=("ddp", "postlocal_k4", "hiersync_p4_overlap", "hiersync_p1")):
    runs = []
    for i, name in enumerate(schedules):
        spec = bench.parse_schedule(name)
        attributed = [
            {
                "data": 0.01,
                "forward": 0.1,
                "backward_interval": 0.5 + 0.1 * rank,
                "backward_compute": 0.2 + 0.1 * rank,
                "backward_return": 0.5,
                "optimizer_interval": 0.2,
                "optimizer_compute": 0.05,
                "after_update": 0.1,
                "total": 0.81 + 0.1 * rank,
            }
        ] * 4
        runs.append(
            {
                "model": "mlp",
                "schedule": name,
                "spec": asdict(spec),
                "bucket_mb": 25.0,
                "num_params": 1000,
                "warmup": 1,
                "steps": 4,
                "attributed": attributed,
                "unsync_elapsed": 4 * step_s * (i + 1) / (1 + rank * 0.01),
                "unsync_step_ends": [1, 2, 3, 4],
                "bytes_sent_per_step": None,
            }
        )
    return {"rank": rank, "runs": runs}


def test_summary_phases_add_up_and_ratios():
    rows = report.summarize([_fake_rank(0, 1.0), _fake_rank(1, 1.0)])
    by = {r["schedule"]: r for r in rows}
    for r in rows:
        # compute parts come from the slowest rank; the rest of each interval is comm wait
        assert r["backward_s"] == pytest.approx(0.3)
        assert sum(r[f"{p}_s"] for p in report.PHASES) == pytest.approx(0.01 + 0.1 + 0.55 + 0.2)
    assert by["ddp"]["vs_ddp"] == pytest.approx(1.0)
    assert by["postlocal_k4"]["vs_ddp"] == pytest.approx(2.0)
    assert by["hiersync_p4_overlap"]["vs_postlocal"] == pytest.approx(1.5)
    assert by["hiersync_p1"]["vs_postlocal"] is None
    targets = report.check_targets(rows)
    assert [(t["schedule"], t["reference"]) for t in targets] == [
        ("hiersync_p4_overlap", "ddp"),
        ("hiersync_p4_overlap", "postlocal_k4"),
        ("hiersync_p1", "ddp"),
    ]


def test_outputs_are_written_atomically(tmp_path, monkeypatch):
    rows = report.summarize([_fake_rank(0, 1.0)])
    raw = {"command": "python -m hiersync bench", "testbed": {"describe": "fake", "mode": "loopback"}}
    paths = report.write_outputs(tmp_path, raw, rows, plots=False)
    assert {p.name for p in paths} == {"bench.json", "bench.csv", "bench.md"}
    before = (tmp_path / "bench.json").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    import os

    monkeypatch.setattr(os, "fsync", broken)  # fails after the temporary file is written, before the rename
    with pytest.raises(OSError, match="simulated"):
        report.write_outputs(tmp_path, raw, rows[:1], plots=False)
    monkeypatch.undo()
    assert (tmp_path / "bench.json").read_bytes() == before  # old file intact, never truncated
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_bench_end_to_end_tiny(tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(
        [
            "bench",
            "--loopback",
            "--mlp-params",
            "20k",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--buckets",
            "0.02",
            "--schedules",
            "ddp,postlocal_k2,bf16_hook,hiersync_p1,hiersync_p2_overlap_bf16",
            "--results",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "vs DDP" in text and "hiersync_p2_overlap_bf16" in text and "NOT shaped" in text
    names = {p.name for p in out.iterdir()}
    assert {"bench.json", "bench.csv", "bench.md", "step_time_vs_bucket.png", "step_breakdown.png"} <= names
    raw = json.loads((out / "bench.json").read_text())
    rows = {r["schedule"]: r for r in raw["rows"]}
    assert set(rows) == {"ddp", "postlocal_k2", "bf16_hook", "hiersync_p1", "hiersync_p2_overlap_bf16"}
    assert all(r["step_s"] > 0 for r in rows.values())
    assert rows["hiersync_p2_overlap_bf16"]["inter_mb_sent_per_step"] > 0
    assert (out / "step_breakdown.png").read_bytes()[:4] == b"\x89PNG"
    assert raw["command"].startswith("python -m hiersync bench --schedules")


def test_collbench_end_to_end_tiny(tmp_path, capsys):
    """2 nodes x 1 rank on the emulated cluster where possible: torchrun, c10d rendezvous, TCP ceiling."""
    out = tmp_path / "coll"
    code = cli.main(
        [
            "collbench",
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--sizes",
            "4K,64K",
            "--tcp-mb",
            "2",
            "--max-iters",
            "2",
            "--results",
            str(out),
            "--timeout",
            "120",
        ]
    )
    assert code == 0
    raw = json.loads((out / "collbench.json").read_text())
    ops = {(r["op"], r["bytes"]) for r in raw["rows"]}
    assert {("rail", 4096), ("rail", 65536), ("two_level", 4096), ("flat", 65536)} <= ops
    assert raw["testbed"]["mode"] == ("netns" if testbed.emulation_available()[0] else "loopback")
    assert raw["tcp_ceiling_MBps"] > 0
    for r in raw["rows"]:
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (r["ranks"] - 1) / r["ranks"])
    assert "busbw" in capsys.readouterr().out
    assert (out / "busbw_vs_size.png").exists() and (out / "collbench.md").exists()

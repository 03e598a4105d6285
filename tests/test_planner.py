"""hiersync.costmodel.planner: the recommendation and the verdict, checked on the presets."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from hiersync import costmodel as cm
from hiersync.costmodel.memory import sync_memory
from hiersync.costmodel.planner import break_even_gbps, format_plan, make_plan
from hiersync.costmodel.planner_cli import add_arguments, profile_from_args
from hiersync.tools import cli


@pytest.fixture(scope="module")
def h100_plan():
    return make_plan(
        cm.PRESETS["h100-8rail"], params=7e9, dtype="bf16", nodes=128, gpus_per_node=8, backward_s=0.3, forward_s=0.15
    )


def test_h100_8rail_cannot_help_much(h100_plan):
    plan = h100_plan
    assert not plan.helps
    assert "cannot help much" in plan.verdict
    # the bandwidth view of docs/costmodel.md: intra all-reduce ~60% of flat, gain capped near 1.6x
    assert 0.55 < plan.intra_allreduce_s / plan.flat_allreduce_s < 0.7
    assert 1.4 < plan.comm_cap < 1.8
    assert f"{plan.comm_cap:.2f}x" in plan.verdict
    assert plan.period == 1 and not plan.use_hiersync  # stay with DDP
    assert plan.bucket_cap_mb in (1, 5, 25, 100)


@pytest.mark.parametrize("preset, nodes", [("a100-1nic", 16), ("pcie-25gbe", 8)])
def test_few_slow_nics_recommend_period_above_one(preset, nodes):
    plan = make_plan(cm.PRESETS[preset], params=7e9, nodes=nodes, gpus_per_node=8, backward_s=0.3, forward_s=0.15)
    assert plan.helps and plan.period > 1 and plan.use_hiersync
    assert "helps" in plan.verdict
    assert plan.recommended.speedup > 2
    assert plan.recommended in plan.rows


def test_recommendation_is_the_smallest_near_best_period():
    plan = make_plan(
        cm.PRESETS["emulated"], params=25e6, dtype="fp32", backward_s=0.2, forward_s=0.1, periods=(1, 2, 4, 8, 16)
    )
    best = min(r.step_s for r in plan.rows if r.period is not None)
    assert plan.recommended.step_s <= best * 1.05
    smaller = [r for r in plan.rows if r.period is not None and r.period < plan.period]
    assert all(r.step_s > best * 1.05 for r in smaller)


def test_table_covers_every_schedule_and_bucket():
    plan = make_plan(
        cm.PRESETS["emulated"], params=25e6, backward_s=0.2, forward_s=0.1, periods=[4, 2], bucket_mb=[5, 25]
    )
    names = [(r.schedule, r.bucket_mb) for r in plan.rows]
    for mb in (5, 25):
        for s in ("ddp", "hiersync k=2", "hiersync k=4", "intra-only"):
            assert (s, mb) in names
    text = format_plan(plan)
    assert "<- recommended" in text and "verdict:" in text and "bucket_cap_mb=" in text


def test_one_node_has_nothing_to_save():
    plan = make_plan(cm.PRESETS["a100-1nic"], params=1e9, nodes=1, backward_s=0.1, forward_s=0.05)
    assert not plan.helps and "one node" in plan.verdict


def test_compression_halves_fp32_sync_only():
    fp32 = make_plan(cm.PRESETS["a100-1nic"], params=1e9, dtype="fp32", backward_s=0.1, forward_s=0.05, compress="bf16")
    assert fp32.compress_ratio == 0.5
    bf16 = make_plan(cm.PRESETS["a100-1nic"], params=1e9, dtype="bf16", backward_s=0.1, forward_s=0.05, compress="bf16")
    assert bf16.compress_ratio == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"periods": [0]}, "periods"),
        ({"bucket_mb": [0]}, "bucket"),
        ({"compress": "zip"}, "compress"),
        ({"params": 0}, "params"),
        ({"nodes": 0}, "nodes"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(cm.PRESETS["emulated"], **{"params": 1e6, "backward_s": 0.1, "forward_s": 0.05, **kwargs})


def test_cli_plan_preset_and_profile(tmp_path, capsys):
    assert (
        cli.main(
            [
                "plan",
                "--preset",
                "a100-1nic",
                "--params",
                "1e9",
                "--nodes",
                "4",
                "--backward-ms",
                "100",
                "--forward-ms",
                "50",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommend: bucket_cap_mb=" in out and "hiersync period=" in out
    path = cm.PRESETS["emulated"].save(tmp_path / "p.json")
    argv = [
        "plan",
        "--profile",
        str(path),
        "--params",
        "25e6",
        "--dtype",
        "fp32",
        "--backward-ms",
        "200",
        "--periods",
        "1,4",
        "--bucket-mb",
        "25",
        "--placement",
        "overlap",
        "--forward-ms",
        "70",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "hiersync k=4 overlap" in out and "compute 270.0 ms" in out


# --- streaming ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a100_plan():
    return make_plan(
        cm.PRESETS["a100-1nic"], params=7e9, dtype="bf16", nodes=16, gpus_per_node=8, backward_s=0.3, forward_s=0.15,
        bucket_mb=[25],
    )  # fmt: skip


def test_plan_recommends_fragments_and_overlap(a100_plan):
    plan = a100_plan
    # one slow NIC: k=8 in 8 fragments, each hidden behind a step: the step is intra-only's
    assert (plan.period, plan.fragments, plan.overlap) == (8, 8, 1)
    assert plan.recommended.schedule == "hiersync k=8 F=8 tau=1"
    intra = next(r for r in plan.rows if r.period is None)
    copies = cm.launch_copy_bytes(14e9 / 8, 8, 1) / 1000e9  # one fragment's launch copies at the preset's 1000 GB/s
    assert plan.recommended.step_s == pytest.approx(intra.step_s + copies, rel=1e-3)
    whole = next(r for r in plan.rows if r.schedule == "hiersync k=8")
    assert plan.recommended.inter_bytes_peak == pytest.approx(whole.inter_bytes_peak / 8)
    text = format_plan(plan)
    assert "hiersync period=8, fragments=8, overlap=1 (after optimizer.step())" in text
    assert "state = hiersync.register(ddp, optimizer, period=8, warmup_steps=100, fragments=8, overlap=1)" in text
    assert "DDP(model, device_ids=[local_rank], bucket_cap_mb=25)" in text
    assert "peak_inter_MB" in text


def test_streaming_grid_respects_its_bounds(a100_plan):
    streams = [r for r in a100_plan.rows if " F=" in r.schedule]
    assert sorted(r.period for r in streams) == [2, 4, 8]  # one preferred row per k > 1 and bucket
    for r in streams:
        assert r.period is not None and r.fragments <= 2 * r.period and r.overlap <= min(r.period - 1, 2)
        assert r.schedule == f"hiersync k={r.period} F={r.fragments} tau={r.overlap}"


def test_streaming_prefers_the_smallest_overlap_within_5_percent():
    # k=4 on a100 x 16: tau=1 hides 0.3 s of a fragment's transfer, tau=2 0.6 s; tau=0 hides none
    plan = make_plan(
        cm.PRESETS["a100-1nic"], params=7e9, dtype="bf16", nodes=16, gpus_per_node=8, backward_s=0.3,
        forward_s=0.15, periods=[4], bucket_mb=[25],
    )  # fmt: skip
    row = next(r for r in plan.rows if " F=" in r.schedule)
    grid = {
        (f, t): cm.step_time(
            "hiersync", profile=plan.profile, grad_bytes=14e9, bucket_bytes=25 * 2**20, backward_s=0.3,
            compute_s=0.45, copy_s_per_byte=1 / 1000e9, period=4, fragments=f, overlap=t,
        ).step_s
        for f in (1, 2, 4, 8)
        for t in (0, 1, 2)
    }  # fmt: skip
    best = min(grid.values())
    assert row.step_s <= best * 1.05
    assert all(grid[(f, t)] > best * 1.05 for (f, t) in grid if t < row.overlap)


def test_no_streaming_rows_when_asked(a100_plan):
    plain = make_plan(
        cm.PRESETS["a100-1nic"], params=7e9, dtype="bf16", nodes=16, gpus_per_node=8, backward_s=0.3,
        forward_s=0.15, bucket_mb=[25], fragments=(),
    )  # fmt: skip
    assert not [r for r in plain.rows if " F=" in r.schedule]
    assert (plain.period, plain.fragments, plain.overlap) == (8, 1, 0)
    assert [r for r in a100_plan.rows if " F=" not in r.schedule] == list(plain.rows)


@pytest.mark.parametrize(
    "kwargs, match", [({"fragments": [0]}, "fragments must be ints >= 1"), ({"overlaps": [-1]}, "overlaps")]
)
def test_bad_streaming_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(cm.PRESETS["emulated"], params=1e6, backward_s=0.1, forward_s=0.05, **kwargs)


def test_cli_plan_shows_streaming(capsys):
    argv = ["plan", "--preset", "a100-1nic", "--params", "7e9", "--dtype", "bf16", "--nodes", "16"]
    argv += ["--backward-ms", "300", "--forward-ms", "150"]
    assert cli.main([*argv, "--bucket-mb", "25"]) == 0
    out = capsys.readouterr().out
    assert "hiersync k=8 F=8 tau=1" in out and "fragments=8, overlap=1" in out and "peak_inter_MB" in out
    assert cli.main([*argv, "--bucket-mb", "25", "--fragments", "0"]) == 0
    out = capsys.readouterr().out
    assert " F=" not in out and "fragments=1, overlap=0 (in the hook)" in out
    argv += ["--bucket-mb", "25", "--fragments", "4", "--overlap", "0", "--copy-gbps", "1500"]
    assert cli.main(argv) == 0
    assert "hiersync k=4 F=4 tau=0" in capsys.readouterr().out


# --- an honest planner: compute required, fp32 gradients, copies and overlap priced ------------------

A100 = dict(params=7e9, nodes=16, gpus_per_node=8, backward_s=0.3, forward_s=0.15)


def test_compute_time_is_required_and_named():
    with pytest.raises(ValueError, match="--backward-ms"):
        make_plan(cm.PRESETS["a100-1nic"], params=1e9, forward_s=0.1)
    with pytest.raises(ValueError, match="--forward-ms"):
        make_plan(cm.PRESETS["a100-1nic"], params=1e9, backward_s=0.1)
    with pytest.raises(ValueError, match="--forward-ms 0"):
        make_plan(cm.PRESETS["a100-1nic"], params=1e9, backward_s=0.1, forward_s=0.0)
    # a profile that records the compute time needs no flags
    prof = replace(cm.PRESETS["a100-1nic"], backward_s=0.2, forward_s=0.1)
    plan = make_plan(prof, params=1e9, break_even=False)
    assert (plan.backward_s, plan.compute_s) == (0.2, pytest.approx(0.3))
    assert make_plan(prof, params=1e9, compute_s=0.5, break_even=False).compute_s == 0.5


def test_cli_without_compute_names_the_flag(capsys):
    with pytest.raises(SystemExit, match="--forward-ms"):
        cli.main(["plan", "--preset", "a100-1nic", "--params", "1e9", "--backward-ms", "100"])
    with pytest.raises(SystemExit, match="--backward-ms"):
        cli.main(["plan", "--preset", "a100-1nic", "--params", "1e9", "--forward-ms", "100"])


def test_gradient_dtype_defaults_to_fp32():
    plan = make_plan(cm.PRESETS["a100-1nic"], params=1e9, backward_s=0.1, forward_s=0.05, break_even=False)
    assert plan.dtype == "fp32" and plan.grad_bytes == 4e9
    assert "fp32" in format_plan(plan)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--preset", "emulated", "--params", "1"]).dtype == "fp32"
    assert "autocast" in parser.format_help()


def test_launch_copies_priced_in_every_after_step_row():
    kw = dict(A100, bucket_mb=[25], periods=[4], break_even=False)
    costly = make_plan(cm.PRESETS["a100-1nic"], placement="overlap", copy_s_per_byte=1e-10, **kw)
    free = make_plan(cm.PRESETS["a100-1nic"], placement="overlap", copy_s_per_byte=0.0, **kw)
    whole = [(a, b) for a, b in zip(costly.rows, free.rows) if a.schedule == "hiersync k=4 overlap"]
    assert whole and all(a.step_s > b.step_s for a, b in whole)  # the whole-model overlap row pays them too
    # the launch step exposes 3 passes (snapshot, payload, its division) over this rank's 1/8 shard of the
    # model (F=1) and the apply step 1.5 copies of the whole model (the correction's add), over k=4 steps
    a, b = whole[0]
    passes = 3 * 28e9 / 8 + cm.APPLY_PASSES * 28e9
    assert a.exposed_s - b.exposed_s == pytest.approx(passes * 1e-10 / 4, rel=0.05)
    assert "given (copies free)" in free.copy_source and "given (10 GB/s)" in costly.copy_source


def test_copy_speed_from_preset_or_assumed():
    plan = make_plan(cm.PRESETS["h100-8rail"], **A100, bucket_mb=[25], break_even=False)
    assert plan.copy_gbps == 1500 and "profile's" in plan.copy_source
    bare = replace(cm.PRESETS["h100-8rail"], copy_gbps=None)
    plan = make_plan(bare, **A100, bucket_mb=[25], break_even=False)
    assert plan.copy_gbps == pytest.approx(1000) and "assumed" in plan.copy_source and "--copy-gbps" in plan.copy_source
    gloo = make_plan(replace(cm.PRESETS["emulated"], copy_gbps=None), params=1e6, backward_s=0.1, forward_s=0.05)
    assert gloo.copy_gbps == pytest.approx(5) and "CPU" in gloo.copy_source
    assert "launch copies: assumed 1,000 GB/s" in format_plan(plan)


def test_overlap_hides_only_tau_local_steps():
    # k=4 whole-model overlap on a100 x 16: the 28 GB sync takes ~2.3 s, one 0.45 s step (and its few ms of
    # exposed intra-node all-reduce) hides part of it
    plan = make_plan(cm.PRESETS["a100-1nic"], placement="overlap", **A100, periods=[4], bucket_mb=[25])
    row = next(r for r in plan.rows if r.schedule == "hiersync k=4 overlap")
    intra = next(r for r in plan.rows if r.schedule == "intra-only")
    transfer = cm.param_sync_time(28e9, 16, 8, *(plan.profile.intra, plan.profile.inter, 1), "auto")
    assert row.exposed_s - intra.exposed_s == pytest.approx((transfer - 0.45) / 4, rel=0.05)


def test_grid_edge_warnings():
    plan = make_plan(cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], break_even=False)
    assert (plan.period, plan.fragments) == (8, 8)
    assert any("largest tried (k=8)" in w and "--periods 1,2,4,8,16,32" in w for w in plan.warnings)
    assert any("best F is the largest tried" in w and "--fragments" in w for w in plan.warnings)
    assert "warning: the best k is the largest tried" in format_plan(plan)
    wide = make_plan(
        cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], periods=[1, 2, 4, 8, 16, 32, 64],
        fragments=[1, 2, 4, 8, 16, 32, 64, 128], break_even=False,
    )  # fmt: skip
    assert wide.period < 64 and not wide.warnings
    narrow = make_plan(cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], periods=[8], overlaps=[0, 1], break_even=False)
    assert any("smallest tried (k=8)" in w for w in narrow.warnings)
    assert any("best tau is the largest tried" in w and "--overlap 0,1,2" in w for w in narrow.warnings)
    small = make_plan(
        cm.PRESETS["a100-1nic"], **A100, bucket_mb=[0.25, 1], periods=[1, 2], fragments=(), break_even=False
    )
    assert any("bucket size is the largest tried (1 MB)" in w and "--bucket-mb 0.25,1,4" in w for w in small.warnings)


def test_calibrated_on_fewer_nodes_is_said():
    measured = replace(cm.PRESETS["a100-1nic"], nodes=2, metadata={"fits": {}})
    assert measured.calibrated_nodes == 2 and cm.PRESETS["a100-1nic"].calibrated_nodes is None
    plan = make_plan(measured, **A100, bucket_mb=[25], break_even=False)
    assert any("calibrated on 2 nodes, extrapolated to 16" in w for w in plan.warnings)
    same = make_plan(measured, **{**A100, "nodes": 2}, bucket_mb=[25], break_even=False)
    assert not any("calibrated" in w for w in same.warnings)
    stated = replace(cm.PRESETS["a100-1nic"], metadata={"calibrated_nodes": 4})
    assert stated.calibrated_nodes == 4


def test_network_from_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--params", "7e9", "--nodes", "16", "--gpus-per-node", "8", "--inter-gbps", "11.5", "--intra-gbps", "235"]
    prof = profile_from_args(parser.parse_args([*argv, "--nics-per-node", "1"]))
    a100 = cm.PRESETS["a100-1nic"]
    assert (prof.intra, prof.inter, prof.rails, prof.backend) == (a100.intra, a100.inter, 1, "nccl")
    assert (prof.nodes, prof.ranks_per_node) == (16, 8)
    with pytest.raises(ValueError, match="--inter-gbps"):
        profile_from_args(parser.parse_args(["--params", "1", "--intra-gbps", "200", "--nodes", "2"]))
    # flags override a preset's fields
    over = profile_from_args(parser.parse_args(["--preset", "h100-8rail", "--params", "1", "--inter-gbps", "25"]))
    assert over.inter.bandwidth == pytest.approx(25e9) and over.inter.alpha == cm.PRESETS["h100-8rail"].inter.alpha
    gloo = profile_from_args(parser.parse_args([*argv, "--backend", "gloo", "--inter-latency-us", "100"]))
    assert gloo.inter.alpha == pytest.approx(100e-6) and gloo.intra.alpha == pytest.approx(30e-6)


def test_cli_plan_from_flags(capsys):
    argv = ["plan", "--params", "7e9", "--nodes", "16", "--gpus-per-node", "8", "--inter-gbps", "11.5"]
    argv += ["--nics-per-node", "1", "--intra-gbps", "235", "--backward-ms", "300", "--forward-ms", "150"]
    assert cli.main([*argv, "--bucket-mb", "25"]) == 0
    out = capsys.readouterr().out
    assert "profile flags [nccl]" in out and "hiersync.register(ddp, optimizer, period=" in out
    with pytest.raises(SystemExit, match="--intra-gbps"):
        cli.main(["plan", "--params", "1e9", "--inter-gbps", "10", "--backward-ms", "1", "--forward-ms", "1"])


MLP_PARAMS = 8 * (1024 * 1024 + 1024)  # benchmarks/memory.py's MLP: 8 layers of 1024 x 1024 (8.4M)


def test_memory_model_by_hand():
    """The extra memory per rank, from the bytes memory.py says it counts, on L = 2 ranks per node.

    P fp32 bytes of parameters; with an attached optimizer every state is a 1/L shard: the anchor
    (compress or outer), the outer momentum (outer), tau fragments in flight of 2/L of a
    fragment's bytes each (snapshot and payload; blocking: one payload shard, 1/L), the node
    gather's 1 MiB per rank; int8/int4's bf16 residuals: half a state shard and 1/N of it.
    """
    n, L, F, MiB = 8.4e6, 2, 4, 2**20
    P = n * 4
    shard = P / L
    gather = 1 * MiB * L
    cases = [
        ({}, dict(anchor=0, momentum=0, in_flight=shard)),
        ({"compress": True}, dict(anchor=shard, momentum=0, in_flight=shard)),
        # compressed, in flight: the node's fp32 buffer of the fragment and the rank's bf16 payload of its shard
        ({"overlap": 1, "compress": True, "outer": True}, dict(anchor=shard, momentum=shard, in_flight=P + n / L * 2)),
        ({"overlap": 3, "compress": True}, dict(anchor=shard, momentum=0, in_flight=3 * (P + n / L * 2))),
        (
            {"fragments": F, "overlap": 1, "compress": True, "outer": True},
            dict(anchor=shard, momentum=shard, in_flight=P / F + n / F / L * 2),
        ),
        # int4: its codes are made from an fp32 delta of the shard, 4 + 0.5 bytes an element
        (
            {"fragments": F, "overlap": 1, "compress": True, "payload_bytes": 4.5},
            dict(anchor=shard, momentum=0, in_flight=P / F + n / F / L * 4.5),
        ),
        # uncompressed: the payload is made in the node's buffer
        ({"fragments": F, "overlap": 1}, dict(anchor=0, momentum=0, in_flight=P / F)),
        # a bf16 model: the buffer, the anchor and the momentum stay fp32; a blocking sync's shard is 16-bit
        (
            {"fragments": F, "overlap": 1, "outer": True, "param_bytes": 2},
            dict(anchor=shard, momentum=shard, in_flight=P / F),
        ),
        ({"compress": True, "param_bytes": 2}, dict(anchor=shard, momentum=0, in_flight=n * 2 / L)),
    ]
    for kw, want in cases:
        m = sync_memory(params=n, ranks_per_node=L, period=4, **kw)
        for field, value in want.items():
            assert getattr(m, field) == pytest.approx(value, rel=1e-9, abs=0), (kw, field)
        assert m.gather == gather and m.residual == 0 and m.sharded, kw
        assert m.total == pytest.approx(sum(want.values()) + gather, rel=1e-9), kw
    # int8/int4 with error feedback on N = 4 nodes: bf16 residuals of the shard and of its 1/N
    ef = sync_memory(params=n, ranks_per_node=L, period=4, compress=True, error_feedback=True, nodes=4)
    assert ef.residual == pytest.approx(n / L * 2 * (1 + 1 / 4), rel=1e-9)
    assert ef.total == pytest.approx(shard + shard + gather + n / L * 2 * 1.25, rel=1e-9)
    assert sync_memory(params=1e6, ranks_per_node=8, period=1).total == 0  # exact: no state
    # in the hook: the anchor and momentum whole, nothing in flight, no gather
    hook = sync_memory(params=1e6, ranks_per_node=8, period=4, compress=True, outer=True, attached=False)
    assert (hook.anchor, hook.momentum, hook.in_flight, hook.gather, hook.sharded) == (4e6, 4e6, 0, 0, False)


def _doc_text(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / name).read_text()


def _doc_table(text: str, header: str) -> list[list[str]]:
    """The body rows (cells stripped) of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table headed {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


# docs/local-sgd.md's measured modes (benchmarks/memory.py) as sync_memory's arguments
MEASURED_MODES = {
    "k=4": {},
    "k=4, bf16": {"compress": True},
    "k=4, overlap, bf16, outer Nesterov": {"overlap": 1, "compress": True, "outer": True},
    "k=4 streaming F=4 tau=1, bf16": {"fragments": 4, "overlap": 1, "compress": True},
    "k=4 streaming F=4 tau=1, bf16, outer Nesterov": {"fragments": 4, "overlap": 1, "compress": True, "outer": True},
    "k=4 streaming, int8 + error feedback": {
        "fragments": 4, "overlap": 1, "compress": True, "error_feedback": True, "payload_bytes": 5,
    },
    "k=4 streaming, int4 + error feedback": {
        "fragments": 4, "overlap": 1, "compress": True, "error_feedback": True, "payload_bytes": 4.5,
    },
    "k=4 streaming, int4 + error feedback, outer Nesterov": {
        "fragments": 4, "overlap": 1, "compress": True, "error_feedback": True, "outer": True, "payload_bytes": 4.5,
    },
    "k=4 streaming, int4, no error feedback": {"fragments": 4, "overlap": 1, "compress": True, "payload_bytes": 4.5},
    "AdamW: k=4 streaming": {"fragments": 4, "overlap": 1},
    "AdamW: k=4 streaming, `average_optimizer_state=(\"exp_avg\",)`": None,  # optimizer state: not modelled
}  # fmt: skip


def test_the_docs_measured_memory_is_the_models_within_its_noise():
    """docs/local-sgd.md's table of measured extra memory (read from the doc) against the model,
    within the noise the doc states for that measurement (~0.1 P)."""
    text = _doc_text("local-sgd.md")
    assert "differences below ~0.1 P are noise" in text
    table = {mode: cell for mode, cell in _doc_table(text, "| mode | extra peak memory per rank")}
    assert set(table) == set(MEASURED_MODES)  # a new row needs its arguments here
    P = MLP_PARAMS * 4
    off = {}
    for mode, kw in MEASURED_MODES.items():
        if kw is None:
            continue
        measured = float(table[mode].split()[0])
        model = sync_memory(params=MLP_PARAMS, ranks_per_node=2, period=4, nodes=2, **kw).total / P
        if abs(model - measured) > 0.1:
            off[mode] = f"model {model:.2f} P, measured {measured:.2f} P"
    assert not off, off


def test_the_docs_memory_arithmetic_is_the_models():
    """The figures docs/local-sgd.md derives for L = N = 2 (read from the doc) are the model's."""
    text = " ".join(_doc_text("local-sgd.md").split())
    P = MLP_PARAMS * 4
    int4 = sync_memory(params=MLP_PARAMS, ranks_per_node=2, period=4, compress=True, error_feedback=True, nodes=2)
    outer = sync_memory(
        params=MLP_PARAMS, ranks_per_node=2, period=4, fragments=4, overlap=1, compress=True, outer=True,
        error_feedback=True, nodes=2,
    )  # fmt: skip
    residual = re.search(r"for the piece it re-encodes, ([\d.]+) P here", text)
    state = re.search(r"the state alone is then ([\d.]+)/L \(([\d.]+) P here\)", text)
    floor = re.search(r"The floor with bf16 and the outer optimizer is (\d+)/L", text)
    in_flight = re.search(r"one fragment in flight at F = 4 \(its node buffer, ([\d.]+) P\)", text)
    assert residual and state and floor and in_flight, "docs/local-sgd.md's Memory arithmetic moved"
    assert float(residual[1]) == pytest.approx(int4.residual / P, rel=1e-9)
    assert float(state[1]) / 2 == float(state[2]) == pytest.approx((outer.anchor + outer.momentum + outer.residual) / P)
    assert int(floor[1]) / 2 == pytest.approx((outer.anchor + outer.momentum) / P, rel=1e-9)
    buffer = outer.in_flight - MLP_PARAMS / 4 / 2 * 2  # less the rank's bf16 payload of its shard
    assert float(in_flight[1]) == pytest.approx(buffer / P, rel=1e-9)
    assert outer.anchor + outer.momentum + outer.residual + buffer > 1.5 * P  # "puts it over 3/L"


def test_plan_reports_memory_and_collectives(a100_plan):
    m = a100_plan.memory
    assert m is not None and m.anchor == 0  # no compress: no anchor
    assert m.in_flight == pytest.approx(7e9 / 8 * 4, rel=1e-9)  # tau=1 fragment of 1/8: the node's fp32 buffer of it
    text = format_plan(a100_plan)
    assert "extra GPU memory per rank" in text and "outer optimizer" in text
    assert "collectives assumed: NCCL's tuning model" in text and "all-reduce of each 25 MB bucket" in text


def test_break_even_bisects_the_inter_bandwidth():
    kw = dict(A100, dtype="bf16", bucket_mb=[25], fragments=(), periods=[1, 2, 4, 8])
    plan = make_plan(cm.PRESETS["a100-1nic"], **kw)
    be = plan.break_even_gbps
    assert be is not None and 11.5 < be < 1e4
    assert f"below {be:,.3g} GB/s" in format_plan(plan)

    def best_gain(node_gbps):
        prof = replace(plan.profile, inter=cm.Link.from_bandwidth(plan.profile.inter.alpha, node_gbps * 1e9))
        p = make_plan(prof, **kw, break_even=False)
        return max(r.speedup for r in p.rows if r.period)

    assert best_gain(be * 0.97) >= 1.05 > best_gain(be * 1.03)
    assert make_plan(cm.PRESETS["a100-1nic"], **{**kw, "nodes": 1}).break_even_gbps is None
    assert break_even_gbps(plan) == be


# --- plan --fsdp: FSDP2 inside the node ----------------------------------------------------------


def test_fsdp_plan_command_fits_a_7b_model_and_says_what_to_paste(capsys):
    """The pinned example: 7B on 16 x 8 A100s with one NIC, forward 100 ms, backward 300 ms."""
    argv = ["plan", "--fsdp", "--preset", "a100-1nic", "--params", "7e9", "--nodes", "16", "--gpus-per-node", "8"]
    assert cli.main([*argv, "--forward-ms", "100", "--backward-ms", "300"]) == 0
    out = capsys.readouterr().out
    assert "fits in a GPU of 80 GB" in out and "DDP would need 112.00 GB" in out
    memory = next(line for line in out.splitlines() if line.startswith("memory per GPU:"))
    assert float(memory.split()[3]) < 80
    assert "mesh = hiersync.node_mesh()" in out and "fully_shard(block, mesh=mesh)" in out
    assert "fully_shard(model, mesh=mesh)" in out
    assert "state = hiersync.register(model, opt, period=" in out and "<- recommended" in out
    assert "fsdp2 hsdp" in out and "intra-only" in out


def test_fsdp_memory_by_hand():
    from hiersync.costmodel.fsdp import fsdp_memory

    m = fsdp_memory(params=8e9, ranks_per_node=8, units=16, period=4, fragments=4, overlap=1)
    # fp32 parameters and gradients, AdamW's two fp32 states: 16 bytes per parameter, sharded 1/8
    assert (m.params, m.grads, m.optimizer) == (4e9, 4e9, 8e9) and m.sharded == 16e9
    # two units' parameters gathered (computing and prefetched) and one unit's unsharded gradient
    assert m.unsharded == 2 * 32e9 / 16 + 32e9 / 16
    # hiersync: the snapshot and payload of the rank's shard of the one fragment in flight; no anchor
    assert (m.anchor, m.momentum, m.in_flight) == (0.0, 0.0, 2 * 32e9 / 4 / 8)
    full = fsdp_memory(params=8e9, ranks_per_node=8, units=16, reshard_after_forward=False)
    assert full.unsharded == 32e9 + 32e9 / 16 and full.hiersync == 0  # period 1 (HSDP) keeps no state
    outer = fsdp_memory(params=8e9, ranks_per_node=8, units=16, period=4, anchor=True, outer=True)
    assert outer.anchor == outer.momentum == 32e9 / 8 and outer.in_flight == 32e9 / 8  # blocking: one payload


def test_fsdp_unit_pipeline_by_hand():
    from hiersync.costmodel.fsdp import _pass

    # two units: all-gathers of 1 s prefetched back to back, 2 s of compute each: the first all-gather is exposed
    assert _pass(2, 4.0, 1.0, ()) == (2.0, 1.0)
    # and a 3 s reduce-scatter after each unit's compute, on the same intra-node channel: 5 s past the compute
    assert _pass(2, 4.0, 1.0, (("intra", 3.0),)) == (8.0, 5.0)
    # a rail leg runs on its own channel, after its unit's reduce-scatter
    assert _pass(1, 1.0, 0.0, (("intra", 1.0), ("rail", 2.0))) == (3.0, 3.0)


def test_fsdp_schedules_against_each_other():
    from hiersync.costmodel.fsdp import fsdp_step_time

    prof = cm.PRESETS["a100-1nic"].with_shape(nodes=16)
    kw = dict(profile=prof, params=7e9, units=32, forward_s=0.1, backward_s=0.3)
    hsdp = fsdp_step_time("hsdp", **kw)
    assert fsdp_step_time("hiersync", period=1, **kw).step_s == hsdp.step_s  # hiersync period 1 is HSDP
    local = fsdp_step_time("intra_only", **kw)
    assert local.inter_bytes_peak == 0 and hsdp.inter_bytes_peak == pytest.approx(2 * 15 / 16 * 28e9 / 8)
    for period, frags, tau in ((2, 1, 0), (4, 4, 1), (8, 8, 1)):
        st = fsdp_step_time("hiersync", period=period, fragments=frags, overlap=tau, **kw)
        assert local.step_s <= st.step_s < hsdp.step_s
        assert st.inter_bytes_mean == pytest.approx(2 * 15 / 16 * 28e9 / 8 / period)
    # without resharding after the forward the backward all-gathers are gone
    kept = fsdp_step_time("intra_only", reshard_after_forward=False, **kw)
    assert kept.comm_s < local.comm_s and kept.step_s <= local.step_s
    with pytest.raises(ValueError, match="valid: hsdp, hiersync, intra_only"):
        fsdp_step_time("ddp", **kw)


def test_fsdp_plan_rejects_and_warns():
    from hiersync.costmodel.fsdp_plan import format_fsdp_plan, make_fsdp_plan

    with pytest.raises(ValueError, match="--fsdp-units"):
        make_fsdp_plan(cm.PRESETS["a100-1nic"], params=7e9, backward_s=0.3, forward_s=0.1, units=0)
    with pytest.raises(ValueError, match="backward"):
        make_fsdp_plan(cm.PRESETS["a100-1nic"], params=7e9, forward_s=0.1)
    big = make_fsdp_plan(cm.PRESETS["a100-1nic"], params=70e9, gpus_per_node=2, backward_s=3.0, forward_s=1.0)
    assert not big.fits and "does NOT fit" in format_fsdp_plan(big)
    # 1B on two 8-rail H100 nodes: HSDP's rail leg hides behind the backward, so period 1 (= HSDP) it is
    hsdp = make_fsdp_plan(cm.PRESETS["h100-8rail"], params=1e9, nodes=2, backward_s=0.3, forward_s=0.1)
    assert hsdp.period == 1 and hsdp.recommended is hsdp.hsdp
    text = format_fsdp_plan(hsdp)
    assert "state = hiersync.register(model, opt, period=1)" in text and "cannot help much" in text


# --- failure-aware planning ----------------------------------------------------------------------


def test_the_default_mtbf_is_llama_3s():
    from hiersync.costmodel.failures import LLAMA3_NODE_MTBF_HOURS, failure_plan

    assert round(LLAMA3_NODE_MTBF_HOURS) == 6335
    # on Llama 3's 2,048 nodes it gives back its 419 interruptions in 54 days
    assert failure_plan(nodes=2048).interruptions_per_day * 54 == pytest.approx(419)


def test_interruptions_and_the_chance_of_one_a_day():
    import math

    from hiersync.costmodel.failures import failure_plan

    fp = failure_plan(nodes=128, node_mtbf_hours=1000.0)
    assert fp.interruptions_per_day == pytest.approx(24 * 128 / 1000)
    assert fp.job_mtbf_s == pytest.approx(3600 * 1000 / 128)
    p = 1 - math.exp(-24 / 1000)  # one node's chance in a day
    assert fp.p_interrupted_day == pytest.approx(1 - (1 - p) ** 128) == pytest.approx(1 - math.exp(-24 * 128 / 1000))


def test_daly_interval_and_restart_goodput():
    import math

    from hiersync.costmodel.failures import daly_interval, restart_goodput

    d, m = 60.0, 6 * 3600.0
    tau = daly_interval(d, m)
    assert tau == pytest.approx(math.sqrt(2 * d * m) - d, rel=0.02)  # Young's sqrt(2 d M), to first order
    best = restart_goodput(tau, d, 600.0, m)
    assert best > restart_goodput(0.7 * tau, d, 600.0, m) and best > restart_goodput(1.4 * tau, d, 600.0, m)
    # by hand: tau / (M e^(R/M) (e^((tau + d)/M) - 1))
    assert restart_goodput(3600, 60, 600, m) == pytest.approx(3600 / (m * math.exp(600 / m) * math.expm1(3660 / m)))
    assert daly_interval(3 * m, m) == m  # a checkpoint longer than 2 M: checkpoint every M


def test_surviving_in_place_costs_the_same_whatever_the_size():
    from hiersync.costmodel.failures import failure_plan

    kw = dict(node_mtbf_hours=6000.0, checkpoint_s=60, restart_s=600, detect_s=30, window_s=8, recovery_s=20)
    small, big = failure_plan(nodes=16, **kw), failure_plan(nodes=1024, **kw)
    for fp in (small, big):
        n = fp.nodes
        assert fp.goodput_in_place == pytest.approx(1 - (n * 30 + 8 + 600 + 20) / (6000 * 3600))
    assert big.goodput_restart < small.goodput_restart - 0.05  # restarting everyone gets worse with N
    assert big.goodput_in_place > big.goodput_restart


def test_a_death_is_priced_at_the_contact_bound_the_runtime_uses():
    from hiersync.costmodel.failures import DEFAULT_DETECT_S
    from hiersync.transport import HEARTBEAT_TIMEOUT_S

    assert DEFAULT_DETECT_S == HEARTBEAT_TIMEOUT_S


def test_plan_prints_the_failure_lines(capsys):
    argv = ["plan", "--preset", "a100-1nic", "--params", "7e9", "--nodes", "1024", "--backward-ms", "300"]
    assert cli.main([*argv, "--forward-ms", "150", "--fragments", "0", "--bucket-mb", "25"]) == 0
    out = capsys.readouterr().out
    assert "node MTBF 6,335 h (Llama 3's 419 interruptions in 54 days on 2,048 nodes)" in out
    assert "1024 nodes: 3.88 interruptions per day" in out and "Young/Daly interval" in out
    assert "survive in place (hiersync on torchft)" in out and "(5.0 s heartbeat timeout for all," in out
    assert cli.main([*argv, "--forward-ms", "150", "--fragments", "0", "--node-mtbf-hours", "1000"]) == 0
    assert "node MTBF 1,000 h (--node-mtbf-hours)" in capsys.readouterr().out
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "Llama 3" in parser.format_help() and "--checkpoint-s" in parser.format_help()


# --- which compress pays ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "pays"),
    [
        (["--preset", "h100-8rail"], "None"),  # 8 x 400 Gb/s: nothing waits for inter-node bytes
        (["--preset", "a100-1nic"], '"bf16"'),  # one 100 Gb/s NIC: 16 bits pay, fewer gain < 2% more
        (["--inter-gbps", "3.1", "--nics-per-node", "1", "--intra-gbps", "235"], '"int4"'),  # 25 Gbit/s per node
    ],
)
def test_the_plan_says_which_compress_pays(capsys, flags, pays):
    argv = ["plan", *flags, "--params", "7e9", "--nodes", "16", "--gpus-per-node", "8", "--backward-ms", "300"]
    assert cli.main([*argv, "--forward-ms", "150", "--bucket-mb", "25"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("compress:"))
    assert f"use compress={pays}" in line and "int8" in line and "int4" in line and "re-planned" in line
    assert "topk2" in line and "costs loss" not in line  # priced, but no faster than the option named here


def test_the_plan_prices_sparse_deltas_but_never_recommends_them(capsys):
    argv = ["plan", "--inter-gbps", "0.1", "--nics-per-node", "1", "--intra-gbps", "235", "--gpus-per-node", "8"]
    assert cli.main([*argv, "--params", "7e9", "--nodes", "16", "--backward-ms", "300", "--forward-ms", "150"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("compress:"))
    cells = re.findall(r"(\w+) ([\d,.]+) (m?s)(?:,|$)", line.split(": use")[0])
    steps = {c: float(v.replace(",", "")) / (1000 if unit == "ms" else 1) for c, v, unit in cells}
    assert steps["topk2"] < steps["int4"] / 1.02  # far faster on a 0.1 GB/s link ...
    assert 'use compress="int4"' in line and "topk2 " in line and "costs loss" in line  # ... and named as lossy


def test_quantized_compression_keeps_a_residual():
    plan = make_plan(cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], compress="int8", break_even=False)
    m = plan.memory
    nodes = A100["nodes"]
    assert m is not None and m.anchor == 7e9 * 4 / 8  # the fp32 shard of the anchor
    assert m.residual == pytest.approx(m.anchor / 2 * (1 + 1 / nodes))  # bf16: own shard + the re-encoded 1/N
    assert 'compress="int8"' in format_plan(plan) and "error-feedback residual" in format_plan(plan)
    with pytest.raises(ValueError, match="int4"):
        make_plan(cm.PRESETS["a100-1nic"], **A100, compress="int2")


def test_fsdp_prices_compression_too():
    from hiersync.costmodel.fsdp import fsdp_memory, fsdp_step_time
    from hiersync.costmodel.fsdp_plan import format_fsdp_plan, make_fsdp_plan

    prof = cm.PRESETS["a100-1nic"].with_shape(nodes=16)
    kw = dict(profile=prof, params=7e9, units=32, forward_s=0.1, backward_s=0.3, period=2, fragments=2, overlap=1)
    steps = [fsdp_step_time("hiersync", compress=c, **kw).step_s for c in (None, "bf16", "int8", "int4")]
    assert steps == sorted(steps, reverse=True)
    peaks = [fsdp_step_time("hiersync", compress=c, **kw).inter_bytes_peak for c in (None, "int4")]
    assert peaks[1] == pytest.approx(peaks[0] * 4.25 / 32)
    m = fsdp_memory(params=8e9, ranks_per_node=8, units=16, period=4, anchor=True, error_feedback=True, nodes=16)
    assert m.anchor == 4e9 and m.residual == pytest.approx(2e9 * (1 + 1 / 16))  # bf16: own shard + the re-encoded 1/N
    plan = make_fsdp_plan(cm.PRESETS["a100-1nic"], params=7e9, nodes=16, backward_s=0.3, forward_s=0.1, compress="int4")
    text = format_fsdp_plan(plan)
    assert 'compress="int4"' in text and "compress: at hiersync" in text and plan.memory.residual > 0


# --- ranking by time to a loss: the steps penalty ----------------------------------------------------

H100_2NIC = dict(
    params=70e9, nodes=16, gpus_per_node=8, backward_s=0.3, forward_s=0.1, periods=(1, 2, 4, 8, 16), bucket_mb=[100],
    break_even=False,
)  # fmt: skip


def test_steps_penalty_parses_the_flag():
    from hiersync.costmodel.planner_sweeps import parse_steps_penalty

    sp = parse_steps_penalty("k=4:1.08, k=16:1.25,k=1:1")
    assert [(p.period, p.value, p.how) for p in sp.blocking] == [(4, 1.08, "given"), (16, 1.25, "given")]
    assert sp.streaming == sp.blocking and not sp.apart and sp.periods == (4, 16)
    assert sp.at(1).value == 1 and sp.at(1).how == "exact"  # period 1 is DDP's own steps


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("k=4:0.9", r"k=4:0.9.*below 1 means period 4 reaches DDP's loss in fewer steps.*time_to_loss.py"),
        ("k4:1.08", r"'k4:1.08' is not k=PERIOD:PENALTY.*k=4:1.08,k=16:1.25"),
        ("k=4", "is not k=PERIOD:PENALTY"),
        ("k=4:fast", r"'k=4:fast'.*finite number >= 1"),
        ("k=4:inf", "leave it out of --periods"),
        ("k=0:1.1", "k=0:1.1.*int >= 1"),
        ("k=1:1.2", "period 1 is exact sync"),
        ("k=4:1.1,k=4:1.2", "k=4 is given twice"),
        ("k=1:1", "no period above 1"),
        ("k=", "is not k=PERIOD:PENALTY"),
    ],
)
def test_steps_penalty_rejects_bad_values_and_says_the_fix(text, match):
    from hiersync.costmodel.planner_sweeps import read_steps_penalty

    with pytest.raises(ValueError, match=match):
        read_steps_penalty(text)


def test_penalty_is_log_linear_in_k_between_known_values_and_never_falls_past_them():
    from hiersync.costmodel.planner_sweeps import parse_steps_penalty

    sp = parse_steps_penalty("k=4:1.08,k=16:1.25")
    k2, k8, k32 = sp.at(2), sp.at(8), sp.at(32)
    assert (k2.value, k2.how) == (pytest.approx(1.04), "interpolated")  # halfway from k=1 (1) to k=4 in log k
    assert (k8.value, k8.how) == (pytest.approx(1.165), "interpolated") and k8.trusted and k8.cell == "1.165~"
    assert k32.how == "extrapolated" and not k32.trusted and k32.cell.endswith("?")
    assert k32.value == pytest.approx(1.25 + 0.17 / 2)  # the slope of 4 -> 16 per factor 4, half of it to 32
    falling = parse_steps_penalty("k=4:1.3,k=16:1.1")  # measured noise: kept between, never falling past 16
    assert falling.at(8).value == pytest.approx(1.2) and falling.at(64).value == pytest.approx(1.1)
    one = parse_steps_penalty("k=2:1.05")  # one value: extrapolated from k=1's 1 and it
    assert one.at(4).value == pytest.approx(1.1) and one.at(4).how == "extrapolated"


def test_without_a_penalty_the_plan_says_it_ranks_by_step_time():
    from hiersync.costmodel.planner_report import BY_STEP_TIME

    plan = make_plan(replace(cm.PRESETS["h100-8rail"], rails=2), **H100_2NIC)
    assert plan.steps_penalty is None and plan.by_step is plan.recommended
    text = format_plan(plan)
    assert BY_STEP_TIME in text and "to_loss_ms" not in text
    assert "local SGD usually needs more steps than DDP" in BY_STEP_TIME and "--steps-penalty" in BY_STEP_TIME


def test_a_steps_penalty_changes_the_recommendation():
    """70B on 16 nodes of 8 H100s with 2 NICs each: k=8 has the fastest step, but at a penalty of 1.3 at
    k=4 and 2 at k=16 (1.65 at k=8, interpolated) k=4 reaches DDP's loss sooner (applied tau=2 steps later,
    where its fragments' copies and transfer hide best)."""
    prof = replace(cm.PRESETS["h100-8rail"], rails=2)
    by_step = make_plan(prof, **H100_2NIC)
    assert by_step.recommended.schedule == "hiersync k=8 F=8 tau=1"
    plan = make_plan(prof, **H100_2NIC, steps_penalty="k=4:1.3,k=16:2")
    rec = plan.recommended
    assert rec.schedule == "hiersync k=4 F=4 tau=2" and plan.period == 4
    assert plan.by_step is not None and plan.by_step.schedule == "hiersync k=8 F=8 tau=1"
    assert rec.to_loss_s == pytest.approx(rec.step_s * 1.3) and plan.by_step.to_loss_s > rec.to_loss_s * 1.05
    assert plan.by_step.step_s < rec.step_s  # a slower step, sooner to the loss
    text = format_plan(plan)
    assert "penalty  to_loss_ms" in text and "k=8 1.65 (interpolated)" in text and "k=4 1.3 (given)" in text
    assert "period=4, warmup_steps=100, fragments=4, overlap=2" in text  # the paste follows the ranking
    assert "by step time alone: hiersync k=8 F=8 tau=1" in text and "to DDP's loss: step" in text
    assert "ranking: by predicted wall-clock to DDP's loss" in text
    # 7B with 4 NICs: k=2 steps fastest, but at 1.15 (interpolated) exact sync is within 5% of it: k=1
    h100_4nic, small = replace(cm.PRESETS["h100-8rail"], rails=4), {**H100_2NIC, "params": 7e9, "bucket_mb": [25, 100]}
    assert make_plan(h100_4nic, **small).period == 2
    exact = make_plan(h100_4nic, **small, steps_penalty="k=4:1.3,k=16:2")
    assert exact.period == 1 and exact.recommended.penalty is not None and exact.recommended.penalty.how == "exact"


def test_an_extrapolated_penalty_is_not_recommended_on():
    plan = make_plan(cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], break_even=False, steps_penalty="k=2:1.05")
    assert plan.period == 2  # k=4 and k=8 step faster, but nothing bounds their penalty past k=2
    assert plan.held_back is not None and plan.held_back.period == 8
    text = format_plan(plan)
    assert "k=8 1.15 (extrapolated)" in text and "not recommended on" in text
    assert "warning: hiersync k=8 F=8 tau=1 at 25 MB might reach DDP's loss sooner" in text
    assert "measure period 8 with benchmarks/time_to_loss.py" in text


def _ttl_file(tmp_path, *, combined=False):
    """A time_to_loss.json as benchmarks/time_to_loss.py writes it: its report's rows over 3 seeds."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import _ttl_stats as stats
    finally:
        sys.path.pop(0)

    def run(reach: float | None, steps: int) -> dict:  # loss 2.0 at step `reach` (never below 2.05 if None)
        loss = (lambda s: 2.3 - 0.01 * s) if reach is None else (lambda s: 2.0 + 0.1 * (reach - s))
        evals = [dict(step=s, wall_s=s * 0.1, val_loss=loss(s)) for s in range(steps + 1)]
        return dict(evals=evals, final_val_loss=loss(steps), wall_s=steps * 0.1, steps=steps)

    reach = {
        "ddp": 20, "hiersync_k2_stream": 21, "hiersync_k4": 22, "hiersync_k4_stream": 24,
        "hiersync_k4_stream_expavg": 26, "hiersync_k8_stream": None, "torchft_diloco_k4": 20.5,
        "hiersync_k4_stream_w10": 20.2,
    }  # fmt: skip
    runs = {name: [run(r, 20 if name == "ddp" else 25) for _ in range(3)] for name, r in reach.items()}
    _, rows = stats.summarize(runs, 20)
    data = dict(command="python benchmarks/time_to_loss.py --inter-rate none", seeds=[0, 1, 2], budget=None, table=rows)
    data["combined"] = stats.combine_steps(rows, rows) if combined else None
    path = tmp_path / "time_to_loss.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def test_steps_penalty_from_a_time_to_loss_file(tmp_path):
    from hiersync.costmodel.planner_sweeps import read_steps_penalty

    sp = read_steps_penalty(str(_ttl_file(tmp_path)))
    assert sp.apart and str(tmp_path) in sp.source and "3 seeds" in sp.source
    # streaming: the best streaming schedule per k; k=8 never reached DDP's loss in its 25 steps
    k2, k4, k8 = (sp.at(k, streaming=True) for k in (2, 4, 8))
    assert (k2.value, k2.schedule, k2.how) == (pytest.approx(1.05), "hiersync_k2_stream", "measured")
    # not expavg's 1.3, nor the warm-up row's 1.01 (its first 10 steps were exact, not k=4)
    assert (k4.value, k4.schedule) == (pytest.approx(1.2), "hiersync_k4_stream")
    assert k4.interval == pytest.approx((1.2, 1.2))  # three identical seeds: a point
    assert not k8.reached and k8.value == pytest.approx(25 / 20) and k8.cell == ">1.25" and not k8.trusted
    assert "not reached by hiersync_k8_stream" in k8.describe()
    # blocking: its own k=4; at k=2 and k=8 it shares streaming's; torchft's row is not hiersync's
    assert sp.at(4).schedule == "hiersync_k4" and sp.at(4).value == pytest.approx(1.1)
    assert sp.at(2).schedule == "hiersync_k2_stream"
    assert not sp.at(16).reached and sp.at(6).how == "interpolated" and not sp.at(6).trusted
    # a --steps-from run: its combined rows
    both = read_steps_penalty(str(_ttl_file(tmp_path, combined=True)))
    assert both.at(4, streaming=True).value == pytest.approx(1.2) and "--steps-from" in both.source


def test_plan_reads_a_time_to_loss_file(tmp_path, capsys):
    path = _ttl_file(tmp_path)
    argv = ["plan", "--preset", "a100-1nic", "--params", "7e9", "--nodes", "16", "--gpus-per-node", "8"]
    assert cli.main([*argv, "--forward-ms", "100", "--backward-ms", "300", "--steps-penalty", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"penalties from {path}" in out and "steps penalty: blocking k=1 1 (exact)" in out
    assert "k=4 1.2 (measured hiersync_k4_stream, 90% interval 1.2-1.2)" in out
    assert "period=4" in out  # k=8 never reached DDP's loss in the measured run: never recommended
    assert "might reach DDP's loss sooner" in out and "did not reach DDP's loss in the measured run" in out
    assert cli.main([*argv, "--fsdp", "--forward-ms", "100", "--backward-ms", "300", "--steps-penalty", str(path)]) == 0
    out = capsys.readouterr().out
    assert "period=4" in out and "to DDP's loss: step" in out and "sooner than HSDP" in out


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no such file"),  # a .json path that is not there
        ("{not json", "not readable JSON"),
        ('{"rows": []}', "not a time_to_loss.json"),
        ('{"table": [{"schedule": "ddp"}, {"schedule": "torchft_diloco_k4"}]}', "no hiersync schedule"),
        ('{"table": [{"schedule": "hiersync_k4", "steps_x_ddp": "fast"}]}', "a row it cannot read"),
    ],
)
def test_bad_time_to_loss_files_say_what_to_pass(tmp_path, content, match):
    from hiersync.costmodel.planner_sweeps import read_steps_penalty

    path = tmp_path / "ttl.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_steps_penalty(str(path))
    argv = ["plan", "--preset", "a100-1nic", "--params", "1e9", "--backward-ms", "100", "--forward-ms", "50"]
    with pytest.raises(SystemExit, match="python -m hiersync plan: error: --steps-penalty"):
        cli.main([*argv, "--steps-penalty", str(path)])


def test_the_paste_carries_the_outer_step_its_penalty_was_measured_with(tmp_path, capsys):
    import json

    rows = [
        dict(schedule="ddp", steps_x_ddp=1.0, steps_to_target=300),
        dict(schedule="hiersync_k4_stream_o0.7m0.5", steps_x_ddp=1.05, interval_90={"steps": [1.0, 1.1]}),
    ]
    path = tmp_path / "time_to_loss.json"
    path.write_text(json.dumps(dict(seeds=[0, 1, 2], table=rows)))
    text = format_plan(make_plan(cm.PRESETS["a100-1nic"], **A100, bucket_mb=[25], steps_penalty=str(path)))
    assert "period=4, warmup_steps=100, fragments=4, overlap=1, outer_lr=0.7, outer_momentum=0.5)" in text
    fsdp = cli.main(["plan", "--fsdp", "--preset", "a100-1nic", "--params", "7e9", "--nodes", "16",
                     "--gpus-per-node", "8", "--forward-ms", "400", "--backward-ms", "800",
                     "--steps-penalty", str(path)])  # fmt: skip
    assert fsdp == 0
    assert (
        "state = hiersync.register(model, opt, period=4, warmup_steps=100, fragments=4, overlap=1, outer_lr=0.7, "
        "outer_momentum=0.5)" in capsys.readouterr().out
    )

"""Calibration: fitting a profile (pure), the calibrate command on 2x2 emulated nodes, and
``HierState(algorithm="auto")`` following a calibrated profile file bucket by bucket."""

from __future__ import annotations

import json

import pytest
from harness import TOPOLOGIES, launch

from hiersync import costmodel as cm
from hiersync.tools.calibrate import FULL_SIZES, QUICK_SIZES, SweepConfig, fit_profile, format_fits

SIZES = (4096, 65536, 2**20, 16 * 2**20)


def _points(link: cm.Link, ranks: int) -> list[tuple[int, float]]:
    return [(n, cm.allreduce_time("ring", ranks, n, link)) for n in SIZES]


def test_fit_profile_recovers_links_and_shared_nics():
    intra, nic = cm.Link(40e-6, 1 / 3e9), cm.Link(80e-6, 1 / 95e6)
    rail = cm.rail_link(nic, 4, 1)  # 4 rails measured at once through one NIC per node
    points = {"intra": _points(intra, 4), "inter": _points(rail, 3)}
    profile, fits = fit_profile(points, nodes=3, ranks_per_node=4, rails=1, backend="gloo", metadata={"x": 1})
    assert (profile.nodes, profile.ranks_per_node, profile.rails, profile.backend) == (3, 4, 1, "gloo")
    for got, want in ((profile.intra, intra), (profile.inter, nic)):
        assert got.alpha == pytest.approx(want.alpha, rel=1e-6)
        assert got.beta == pytest.approx(want.beta, rel=1e-6)
    assert cm.rail_link(profile.inter, 4, 1).beta == pytest.approx(rail.beta, rel=1e-6)
    assert all(f.r2 > 0.999999 for f in fits.values())
    meta = profile.metadata
    assert meta["x"] == 1 and meta["fits"]["inter"]["ranks"] == 3 and len(meta["points"]["intra"]) == len(SIZES)
    # The profile survives its JSON round trip, fit details included.
    again = cm.Profile.from_json(json.dumps(profile.to_json()))
    assert again.inter == profile.inter and again.metadata["fits"] == json.loads(json.dumps(meta["fits"]))
    text = format_fits(profile, fits)
    assert "R^2" in text and "intra" in text and "inter" in text


def test_fit_profile_under_nccl_fits_nccls_own_model():
    """Measurements made by NCCL's own model come back as its inputs: ring and NVLS bandwidth,
    NIC rate and the fabric latency, whatever protocol each size ran."""
    from dataclasses import replace

    truth = replace(cm.PRESETS["h100-8rail"], nodes=4, net_latency_us=40.0, inter=cm.Link(14e-6, 1 / 30e9))
    node, rail = cm.node_profile(truth), cm.rail_profile(truth)
    sizes = FULL_SIZES
    points = {
        "intra": [(n, cm.predict_allreduce(n, node)) for n in sizes],
        "intra_reduce_scatter": [(n, cm.predict_reduce_scatter(n, node)) for n in sizes],
        "inter": [(n, cm.predict_allreduce(n, rail)) for n in sizes],
    }
    profile, fits = fit_profile(points, nodes=4, ranks_per_node=8, rails=8, backend="nccl", metadata={})
    assert profile.intra.bandwidth == pytest.approx(370e9, rel=1e-3)
    assert profile.nvls_gbps == pytest.approx(480, rel=1e-3)
    assert profile.inter.bandwidth == pytest.approx(30e9, rel=0.01)
    assert profile.net_latency_us == pytest.approx(40.0, abs=0.5)
    assert profile.gpu == "hopper"
    # no NVLS where the all-reduce runs no faster than the ring
    ampere = replace(cm.PRESETS["a100-1nic"], nodes=2)
    one = cm.node_profile(ampere)
    flat = {
        "intra": [(n, cm.predict_allreduce(n, one)) for n in sizes],
        "intra_reduce_scatter": [(n, cm.predict_reduce_scatter(n, one)) for n in sizes],
    }
    fitted, _ = fit_profile(flat, nodes=1, ranks_per_node=8, backend="nccl", metadata={"cuda_capability": [8, 0]})
    assert fitted.nvls_gbps is None and fitted.gpu == "ampere"
    assert "fabric latency" in format_fits(profile, fits)


def test_fit_profile_one_level_copies_the_other(caplog):
    link = cm.Link(30e-6, 1e-9)
    profile, fits = fit_profile({"intra": _points(link, 2)}, nodes=1, ranks_per_node=2)
    assert set(fits) == {"intra"} and profile.inter == profile.intra
    assert "no inter measurements" in caplog.text


def test_measured_intra_collectives_drive_the_two_level_model():
    intra, inter = cm.Link(40e-6, 1 / 3e9), cm.Link(80e-6, 1 / 95e6)
    rs, ag = cm.Link(90e-6, 2.5 / 3e9), cm.Link(50e-6, 1.5 / 3e9)  # gloo-like: slower than the ring's
    points = {
        "intra": _points(intra, 2),
        "inter": _points(inter, 2),
        "intra_reduce_scatter": [(n, cm.reduce_scatter_time("ring", 2, n, rs)) for n in SIZES],
        "intra_all_gather": [(n, cm.all_gather_time("ring", 2, n, ag)) for n in SIZES],
    }
    profile, _ = fit_profile(points, nodes=2, ranks_per_node=2, backend="gloo")
    assert profile.intra_reduce_scatter.beta == pytest.approx(rs.beta, rel=1e-6)
    assert profile.intra_all_gather.alpha == pytest.approx(ag.alpha, rel=1e-6)
    assert cm.Profile.from_json(profile.to_json()).intra_all_gather == profile.intra_all_gather
    n = 8e6
    want = (
        cm.reduce_scatter_time("ring", 2, n, rs)
        + cm.allreduce_time("ring", 2, n / 2, inter)
        + cm.all_gather_time("ring", 2, n, ag)
    )
    got = cm.hierarchical_allreduce_time(n, 2, 2, profile.intra, profile.inter, reduce_scatter=rs, all_gather=ag)
    assert got == pytest.approx(want, rel=1e-6)
    assert got > cm.hierarchical_allreduce_time(n, 2, 2, profile.intra, profile.inter)
    # One node: hiersync runs a single intra all-reduce, whatever the reduce-scatter costs.
    assert cm.hierarchical_allreduce_time(n, 1, 2, intra, inter, reduce_scatter=rs, all_gather=ag) == pytest.approx(
        cm.allreduce_time("ring", 2, n, intra)
    )
    # The schedule model and "auto" read the measured links from the profile.
    # (intra_algorithm="rs_ag": the variant that runs a reduce-scatter and an all-gather; a
    # gloo profile's default is "allreduce_bcast", tested in test_costmodel.py)
    kw = dict(grad_bytes=n, bucket_bytes=n, backward_s=0.0, intra_algorithm="rs_ag")
    plain = cm.Profile(intra=profile.intra, inter=profile.inter, nodes=2, ranks_per_node=2, backend="gloo")
    assert cm.step_time("hiersync", profile=profile, **kw).comm_s == pytest.approx(got, rel=1e-6)
    assert cm.step_time("hiersync", profile=profile, **kw).comm_s > cm.step_time("hiersync", profile=plain, **kw).comm_s
    sync = cm.param_sync_time(n, 2, 2, intra, inter, all_gather=ag)
    assert sync == pytest.approx(cm.allreduce_time("ring", 2, n / 2, inter) + cm.all_gather_time("ring", 2, n, ag))


def test_measured_shard_broadcasts_drive_the_allreduce_bcast_model():
    intra, inter = cm.Link(40e-6, 1 / 3e9), cm.Link(80e-6, 1 / 95e6)
    bc = cm.Link(20e-6, 1 / 6e9)
    # a point is n bytes moved as 2 broadcasts of n/2 (one per local rank), in a row
    points = {
        "intra": _points(intra, 2),
        "inter": _points(inter, 2),
        "intra_broadcast": [(n, 2 * cm.broadcast_time("binomial", 2, n / 2, bc)) for n in SIZES],
    }
    profile, fits = fit_profile(points, nodes=2, ranks_per_node=2, backend="gloo")
    assert profile.intra_broadcast.alpha == pytest.approx(bc.alpha, rel=1e-6)
    assert profile.intra_broadcast.beta == pytest.approx(bc.beta, rel=1e-6)
    assert fits["intra_broadcast"].r2 == pytest.approx(1.0)
    assert cm.Profile.from_json(profile.to_json()).intra_broadcast == profile.intra_broadcast
    n = 8e6
    want = (
        cm.allreduce_time("ring", 2, n, intra)
        + cm.allreduce_time("ring", 2, n / 2, inter)
        + 2 * (bc.alpha + n / 2 * bc.beta)
    )
    kw = dict(grad_bytes=n, bucket_bytes=n, backward_s=0.0)
    assert cm.step_time("hiersync", profile=profile, **kw).comm_s == pytest.approx(want, rel=1e-6)
    assert "+0.0%" in format_fits(profile, fits).split("intra_broadcast: broadcast on 2 ranks")[1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(points={"intra": []}), "no all-reduce measurements"),
        (dict(points={"wan": [(1, 1.0)]}), "unknown levels"),
        (dict(points={"intra": [(1, 1.0), (2, 1.0)]}, algorithm="bruck"), "bruck"),
    ],
)
def test_fit_profile_rejects_bad_input(kwargs, match):
    points = kwargs.pop("points")
    with pytest.raises(ValueError, match=match):
        fit_profile(points, nodes=2, ranks_per_node=2, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sizes=(4096,)), "2 distinct"),
        (dict(sizes=(0, 8)), "sizes"),
        (dict(reps=0), "reps"),
        (dict(budget_s=-1.0), "budget_s"),
    ],
)
def test_sweep_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SweepConfig(**kwargs)


def test_default_sizes_span_4k_to_256m():
    assert FULL_SIZES[0] == 4096 and FULL_SIZES[-1] == 256 * 2**20 and len(FULL_SIZES) == 17
    assert set(QUICK_SIZES) < set(FULL_SIZES) and QUICK_SIZES[0] == 4096


# --------------------------------------------------------------------------- multi-process

TINY = ["--sizes", "4096,65536,262144", "--warmup", "1", "--reps", "3", "--budget-s", "0.1"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from hiersync.tools.cli import main

    out = tmp_path_factory.mktemp("cal") / "profile.json"
    assert main(["calibrate", "--nodes", "2", "--procs-per-node", "2", "--rails", "1", "--out", str(out), *TINY]) == 0
    return out


def test_calibrate_command_writes_profile(calibrated, capsys):
    profile = cm.Profile.load(calibrated)
    assert (profile.nodes, profile.ranks_per_node, profile.rails, profile.backend) == (2, 2, 1, "gloo")
    assert profile.intra.beta >= 0 and profile.inter.beta >= 0  # noisy tiny sweep: only signs are sure
    assert profile.intra_reduce_scatter is not None and profile.intra_all_gather is not None
    meta = profile.metadata
    assert set(meta["fits"]) == {"intra", "inter", "intra_reduce_scatter", "intra_all_gather", "intra_broadcast"}
    assert profile.intra_broadcast is not None and meta["fits"]["intra_broadcast"]["algorithm"] == "binomial"
    assert [n for n, _ in meta["points"]["inter"]] == [4096, 65536, 262144]
    assert all(t > 0 for level in meta["points"].values() for _, t in level)
    assert meta["mode"].startswith("local 2x2") and meta["topology"] == [[0, 1], [2, 3]]
    assert not list(calibrated.parent.glob(".*.tmp"))  # written atomically: no temporary left


def test_calibrate_needs_ranks(capsys):
    from hiersync.tools.cli import main

    assert main(["calibrate", "--out", "unused.json"]) == 2  # the error and its fix, no traceback
    assert "python -m hiersync calibrate: error:" in capsys.readouterr().err
    with pytest.raises(ValueError, match="torchrun"):
        main(["-v", "calibrate", "--out", "unused.json"])  # -v: the traceback


def _auto_profile(tmp_path) -> tuple[str, cm.Profile]:
    # A calibration of a 2x2 cluster whose intra link is as slow as its one NIC: the model
    # picks the two-level all-reduce for small buckets (fewer latencies) and the flat ring
    # for large ones (it pipelines the intra hops with the NIC), crossing near 400 KB.
    rail = cm.rail_link(cm.Link(100e-6, 1e-9), 2, 1)
    points = {"intra": _points(cm.Link(50e-6, 1e-9), 2), "inter": _points(rail, 2)}
    profile, _ = fit_profile(points, nodes=2, ranks_per_node=2, rails=1, backend="gloo")
    path = tmp_path / "auto.json"
    profile.save(path)
    return str(path), cm.Profile.load(path)


def auto_choices(paths: list[str]) -> list[dict]:
    """Rank body: train a few steps with ``algorithm="auto"`` per profile; return the choices."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    out = []
    for path in paths:
        torch.manual_seed(0)
        # Parameters of 16 B .. 1 MiB; a tiny bucket cap gives each its own bucket.
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.Tanh(),
            torch.nn.Linear(1024, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 4),
        )
        ref = DDP(copy.deepcopy(model), bucket_cap_mb=1e-6)
        ddp = DDP(model, bucket_cap_mb=1e-6)
        state = hiersync.HierState(algorithm="auto", profile=path)
        ddp.register_comm_hook(state, hiersync.hook)
        for net in (ddp, ref):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for step in range(3):
                g = torch.Generator().manual_seed(100 * step + dist.get_rank())
                x, y = torch.randn(4, 256, generator=g), torch.randn(4, 4, generator=g)
                torch.nn.functional.mse_loss(net(x), y).backward()
                opt.step()
                opt.zero_grad()
        for p, q in zip(ddp.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # both paths average exactly
        out.append(dict(state.exact_algorithms))
    return out


def test_auto_follows_calibrated_profile(tmp_path, calibrated):
    path, profile = _auto_profile(tmp_path)
    measured = cm.Profile.load(calibrated)
    res = launch(auto_choices, TOPOLOGIES["2x2"], [path, str(calibrated)])
    for crafted, from_command in res:
        assert crafted == {n: cm.choose_exact_algorithm(n, 2, 2, profile) for n in crafted}
        assert set(crafted.values()) == {"flat", "two_level"}, crafted
        assert from_command == {n: cm.choose_exact_algorithm(n, 2, 2, measured) for n in from_command}
        assert set(from_command) == set(crafted)
    assert all(r == res[0] for r in res)

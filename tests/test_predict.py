"""predict_allreduce: NCCL's tuning model on a profile, against NCCL's own rules and published numbers."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from hiersync import costmodel as cm
from hiersync.costmodel import nccl
from hiersync.costmodel.projection import project
from hiersync.costmodel.validation import DEFAULT_CSV, INFORMED_ROWS, load_rows, medians, score

H100 = cm.PRESETS["h100-8rail"]
A100 = cm.PRESETS["a100-1nic"]
MiB, GiB = 2**20, 2**30


def busbw(nbytes, profile, algorithm="auto"):
    p = profile.nodes * profile.ranks_per_node
    return nbytes / cm.predict_allreduce(nbytes, profile, algorithm) * 2 * (p - 1) / p / 1e9


def test_the_pinned_signature():
    params = inspect.signature(cm.predict_allreduce).parameters
    assert list(params) == ["nbytes", "profile", "algorithm"] and params["algorithm"].default == "auto"
    t = cm.predict_allreduce(25 * MiB, H100.with_shape(nodes=16))
    assert isinstance(t, float) and 0 < t < 1
    with pytest.raises(ValueError, match="valid: auto, ring, tree"):
        cm.predict_allreduce(1e6, H100, "nvls")
    with pytest.raises(ValueError, match="nbytes"):
        cm.predict_allreduce(-1, H100)


def test_one_node_picks_ring_ll_then_nvls_as_nccls_tuner_logs():
    node = H100.with_shape(nodes=1)
    # stas00/ml-engineering's TUNING log on 8 x H200: Ring/LL <= 1 MiB, NVLS/Simple >= 2 MiB
    assert [cm.explain_allreduce(n, node) for n in (32 * 1024, MiB, 2 * MiB, GiB)] == [
        "ring/LL",
        "ring/LL",
        "nvls/Simple",
        "nvls/Simple",
    ]
    # NVLS's bus bandwidth is the all-reduce's only; rings stay at ~370 GB/s
    assert busbw(16 * GiB, node) == pytest.approx(480, rel=0.01)
    assert busbw(16 * GiB, node, "ring") == pytest.approx(370, rel=0.01)
    # Ring/LL latency: NCCL's base 6.6 us + 14 NVLink hops of 0.6 us
    assert cm.predict_allreduce(0, node) == pytest.approx(15.0e-6)


def test_intra_reduce_scatter_and_all_gather_run_at_ring_speed():
    node = H100.with_shape(nodes=1)
    for predict in (cm.predict_reduce_scatter, cm.predict_all_gather):
        t = predict(GiB, node)
        assert 7 / 8 * GiB / t / 1e9 == pytest.approx(370, rel=0.02)  # not NVLS's 480
    assert cm.predict_reduce_scatter(GiB, H100.with_shape(ranks_per_node=1)) == 0.0


def test_two_nodes_move_n_not_2n_through_the_nics():
    """NVLSTree on two nodes: each node roots one tree, so its NICs carry n; busbw beats the ring's NIC bound."""
    two, four = H100.with_shape(nodes=2), H100.with_shape(nodes=4)
    nic_total = 8 * 47
    assert cm.explain_allreduce(8 * GiB, two) == "nvls_tree/Simple"
    assert busbw(8 * GiB, two) == pytest.approx(480, rel=0.02)  # measured 470-487
    assert busbw(8 * GiB, two) > 1.2 * nic_total
    assert busbw(8 * GiB, four) <= nic_total * 1.001  # more nodes: 2n per node, the NICs bound it
    assert busbw(8 * GiB, two, "ring") <= nic_total * 1.001


def test_tree_bandwidth_is_derated_at_medium_sizes():
    fab = cm.predict.fabric(A100.with_shape(nodes=8))

    def tree(nbytes, proto):
        return next(c for c in nccl.allreduce_choices(nbytes, fab, ("tree",)) if c.protocol == proto)

    # NCCL's treeCorrectionFactor (Simple): 0.5 at 128 KiB..1 MiB, 0.9 at 64 B, 1.0 above 256 MiB
    assert tree(512 * 1024, "Simple").algbw == pytest.approx(0.5 * tree(GiB, "Simple").algbw)
    assert tree(64, "Simple").algbw == pytest.approx(0.9 * tree(GiB, "Simple").algbw)


def test_the_fabric_latency_is_a_profile_field():
    ib, efa = H100.with_shape(nodes=8), replace(H100.with_shape(nodes=8), net_latency_us=75.0)
    small = 64 * 1024
    # LL adds it once per inter-node step; the tree crosses 2 lg N of them
    assert cm.explain_allreduce(small, ib) == cm.explain_allreduce(small, efa) == "tree/LL"
    assert cm.predict_allreduce(small, efa) - cm.predict_allreduce(small, ib) == pytest.approx(2 * 3 * 75e-6)
    # inside one node the network is never crossed
    assert cm.predict_allreduce(small, efa.with_shape(nodes=1)) == cm.predict_allreduce(small, ib.with_shape(nodes=1))
    assert cm.Profile.from_json(efa.to_json()) == efa


def test_rings_pay_their_steps_at_scale():
    """A ring's latency grows with its 2(p-1) steps (and NCCL's 1.4x plateau): busbw falls with the node count."""
    bws = [busbw(8 * GiB, H100.with_shape(nodes=n), "ring") for n in (4, 16, 32, 128)]
    assert bws == sorted(bws, reverse=True) and bws[-1] < 0.9 * bws[0]


def test_gloo_profiles_keep_the_alpha_beta_ring():
    emu = cm.PRESETS["emulated"]
    expected = cm.flat_allreduce_time(25 * MiB, 2, 2, emu.intra, emu.inter, emu.rails, "ring")
    assert cm.predict_allreduce(25 * MiB, emu) == expected
    assert cm.explain_allreduce(25 * MiB, emu) == "ring (gloo)"


def test_everything_that_prices_an_all_reduce_asks_predict_allreduce():
    prof = H100.with_shape(nodes=16)
    # DDP: one bucket, no backward to hide behind: the step's communication is one all-reduce
    st = cm.step_time("ddp", profile=prof, grad_bytes=25 * MiB, bucket_bytes=25 * MiB, backward_s=0.0)
    assert st.comm_s == st.exposed_s == cm.predict_allreduce(25 * MiB, prof)
    # the exact two-level step: its three legs, the rail leg on the rail's own profile
    two = cm.step_time("hiersync", profile=prof, grad_bytes=25 * MiB, bucket_bytes=25 * MiB, backward_s=0.0)
    rs, ar, ag = cm.predict_two_level(25 * MiB, prof)
    assert two.comm_s == pytest.approx(rs + ar + ag)
    assert ar == cm.predict_allreduce(25 * MiB / 8, cm.rail_profile(prof))
    # HierState(algorithm="auto") and the projection
    choice = cm.choose_exact_algorithm(25 * MiB, 16, 8, H100)
    assert choice == ("two_level" if rs + ar + ag < cm.predict_allreduce(25 * MiB, prof) else "flat")
    row = project(["h100-8rail"], gpus=(128,), grad_bytes=1e9, backward_s=0.1)[0]
    assert row["ar_ring_ms"] == pytest.approx(cm.predict_allreduce(25 * MiB, prof, "ring") * 1e3)


# --- against published measurements -----------------------------------------------------------

# Median |predicted / measured - 1| on the clean rows, as the model gives them now; a change that
# makes any of them worse fails here. The targets: intra <= 5%, inter bandwidth-bound <= 10%,
# inter 1-512 MiB <= 20%, latency-bound <= 25%.
PINNED = {"intra": 0.0185, "inter-bw": 0.0355, "inter-mid": 0.1265, "latency": 0.1375}
PINNED_HELD_OUT = {"intra": 0.0105, "inter-bw": 0.0355, "inter-mid": 0.1265, "latency": 0.1395}
TARGETS = {"intra": 0.05, "inter-bw": 0.10, "inter-mid": 0.20, "latency": 0.25}


@pytest.fixture(scope="module")
def points():
    return score(load_rows(DEFAULT_CSV))


def test_the_published_table_is_in_the_repository(points):
    assert len(points) == 62 and {p.row.regime for p in points} == {"intra", "inter-bw", "inter-mid", "latency"}
    assert all(row in {p.row.id for p in points} for row in INFORMED_ROWS)


@pytest.mark.parametrize("held_out", [False, True])
def test_medians_meet_the_targets_and_do_not_get_worse(points, held_out):
    got = medians(points, held_out=held_out)
    pinned = PINNED_HELD_OUT if held_out else PINNED
    for regime, (median, count) in got.items():
        assert count >= 8, regime
        assert median <= pinned[regime] <= TARGETS[regime], (regime, median)


def test_the_report_names_the_worst_points(points):
    text = cm.validation.format_report(points)
    assert "inter-mid" in text and "worst 8 clean points" in text and "A3M-2n-16777216" in text

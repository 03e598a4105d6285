"""The FSDP2 front-end against references, on 2x2 and 2x1 (CPU, gloo).

``fsdp_ranks.fsdp_check`` asserts after every step, on every rank, that hiersync over an
FSDP2 model equals its reference to rtol 1e-5: FSDP2's own HSDP on a (node, local) mesh
for exact steps, and hiersync's DDP front-end with the same options and the same
fragments (packed in the model's parameter order by both) for period k; ``synchronize``
with corrections still in flight against the reference's. Here: what the runs return,
checkpoints, and the set-ups that must be refused with the fix named.
"""

from __future__ import annotations

import fsdp_ranks
import pytest
from harness import (
    TOPOLOGIES,
    launch,
    nccl_mode,  # noqa: F401  (a fixture, used by name)
)

pytestmark = pytest.mark.usefixtures("nccl_mode")  # as is, and under emulated NCCL

CASES = {
    "exact_equals_hsdp": dict(reference="hsdp", period=1, steps=4),
    "warmup_then_blocking": dict(reference="ddp", period=3, warmup=2, steps=8),
    "overlap": dict(reference="ddp", period=3, tau=1, steps=8),
    # 11 steps: the fragment that syncs after step 10 is still in flight when synchronize() is called
    "streaming": dict(reference="ddp", period=4, fragments=4, tau=1, steps=11, in_flight=True),
    # an evaluation forward before synchronize() leaves the root unit unsharded
    "streaming_eval_then_synchronize": dict(
        reference="ddp", period=4, fragments=4, tau=2, steps=10, eval_before_sync=True, in_flight=True
    ),
    "streaming_blocking_bf16": dict(reference="ddp", period=4, fragments=2, compress="bf16", steps=9),
    "streaming_outer_bf16": dict(
        reference="ddp", period=4, fragments=2, tau=2, compress="bf16", outer=(0.7, 0.9), steps=9
    ),
    "streaming_exp_avg": dict(
        reference="ddp", period=4, fragments=2, tau=1, average_optimizer_state=("exp_avg", "exp_avg_sq"), steps=9
    ),
    "state_on_host": dict(reference="ddp", period=2, tau=1, outer=(0.7, 0.9), state_device="cpu", steps=6),
    # within the codes' steps, not 1e-5 (fsdp_ranks.fsdp_check): the blocks follow each front-end's shards
    "streaming_int4": dict(reference="ddp", period=4, fragments=2, tau=1, compress="int4", steps=9),
    "overlap_int8_outer": dict(reference="ddp", period=2, tau=1, compress="int8", outer=(0.7, 0.9), steps=6),
}


@pytest.mark.parametrize("name", ["2x2", pytest.param("2x1", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, name):
    cfg = CASES[case]
    res = launch(fsdp_ranks.fsdp_check, TOPOLOGIES[name], cfg)
    for r in res:
        assert r["synchronized"], "synchronize() must leave every rank with the same parameters"
        assert r["stats"]["steps"] == cfg["steps"]
        assert r["stats"]["bytes_sent"]["inter"] > 0
        if cfg["period"] > 1:
            assert r["nodes_differed"], "between syncs the nodes should drift apart"
            assert r["stats"]["sync_steps"] > 0
        if cfg["reference"] == "ddp":  # the same fragments as the DDP front-end's for the same model
            assert r["fsdp_layout"] == r["reference_layout"]
        if cfg.get("in_flight"):
            assert r["in_flight_at_synchronize"] > 0, "synchronize() should have met a correction in flight"


@pytest.mark.parametrize("compress", ["bf16", "int4"])  # int4: its error-feedback residuals too
def test_checkpoint_with_a_correction_in_flight_resumes_bitwise(tmp_path, compress):
    cfg = dict(period=2, tau=1, fragments=2, compress=compress, outer=(0.7, 0.9))
    node_ids, n = TOPOLOGIES["2x2"], 2  # a sync after step 1, applied after step 2: in flight at the save
    straight = launch(fsdp_ranks.fsdp_checkpoint_run, node_ids, cfg, "straight", str(tmp_path), n)
    launch(fsdp_ranks.fsdp_checkpoint_run, node_ids, cfg, "first", str(tmp_path), n)
    resumed = launch(fsdp_ranks.fsdp_checkpoint_run, node_ids, cfg, "resume", str(tmp_path), n)
    for r in range(len(node_ids)):
        assert resumed[r] == straight[r], f"rank {r} diverged after resume"


def test_portable_checkpoint_after_synchronize(tmp_path, nccl_mode):
    if nccl_mode == "emulated_nccl":
        pytest.skip("the same sync as the tests above")
    for r in launch(fsdp_ranks.fsdp_portable_checkpoint, TOPOLOGIES["2x2"], str(tmp_path)):
        assert r["equal"]


BAD = {
    "world_mesh": ("2x2", "ValueError", "fully_shard(module, mesh=hiersync.node_mesh())"),
    "uneven_node_mesh": ("uneven", "ValueError", "equal numbers of ranks"),
    "uneven_register": ("uneven", "ValueError", "equal numbers of ranks"),
    "fsdp1": ("2x2", "TypeError", "not FSDP1"),
    "no_optimizer": ("2x2", "TypeError", "needs the optimizer"),
    "too_many_fragments": ("2x2", "ValueError", "fragments=9 but the model has only 8 parameter tensors"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_setups_name_the_fix(case, nccl_mode):
    if nccl_mode == "emulated_nccl":
        pytest.skip("no collective result is read")
    topology, kind, text = BAD[case]
    for msg in launch(fsdp_ranks.fsdp_bad_setup, TOPOLOGIES[topology], case):
        assert msg.startswith(kind) and text in msg, msg


def test_sharded_grad_scaler_overflow_skips_everywhere_and_keeps_syncing(nccl_mode):
    if nccl_mode == "emulated_nccl":
        pytest.skip("the same collectives as the tests above")
    inject, steps = [1, 4], 7  # step 1 is a sync step: its average launches before step 2's forward
    for r in launch(fsdp_ranks.fsdp_scaler_overflow, TOPOLOGIES["2x2"], inject, steps):
        assert r["finite"]
        assert r["scales"][1] == r["scales"][0] / 2 and r["scales"][4] == r["scales"][3] / 2, r["scales"]
        assert r["identical_after_sync"] and all(r["identical_after_sync"]), r["identical_after_sync"]
        assert r["stats"]["sync_steps"] == 3  # steps 1, 3, 5


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_gradient_is_judged_per_node(policy, nccl_mode):
    if nccl_mode == "emulated_nccl":
        pytest.skip("the same collectives as the tests above")
    res = launch(fsdp_ranks.fsdp_nonfinite, TOPOLOGIES["2x2"], policy)
    for rank, r in enumerate(res):
        if rank in (0, 1) and policy == "raise":  # node 0: rank 0's NaN reached every shard of its node
            assert "non-finite gradient" in r["raised"], r
        elif rank in (0, 1):
            assert r["unchanged"] and r["skips"] == 1, r
        else:  # node 1 saw finite gradients: it steps
            assert not r["unchanged"] and r["skips"] == 0, r

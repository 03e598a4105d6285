"""Emulated NCCL completion (hiersync.emulation, HIERSYNC_EMULATE_NCCL=1).

The parity, local-SGD, guard and checkpoint tests run under it through the ``nccl_mode``
fixture (harness.py). Here: the mode's own semantics without processes, and proof that it
bites: each read of a collective's result is put back without its wait, one site at a
time, and the emulated run must fail, while the same defect passes unnoticed on plain gloo.
"""

from __future__ import annotations

import pytest
import ranks
import torch
from harness import TOPOLOGIES, launch

from hiersync import emulation, futures
from hiersync.futures import HierSyncError, completed, failed, settle, wait, when_all
from hiersync.tools.launch import RankFailed

pytestmark = pytest.mark.nccl_emulation  # selected by `pytest -m nccl_emulation`


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(emulation.ENV, "1")


def _start_after(real: torch.futures.Future, result: torch.Tensor):
    """A fake collective: writes ``result`` into its private output once ``real`` completes."""

    def start(out, *inputs):
        def finish(f):
            wait(f)
            out.copy_(result)
            return [out]

        return real.then(finish)

    return start


def test_switch_reads_the_environment(monkeypatch):
    for value, on in [("1", True), ("yes", True), ("0", False), ("", False), ("off", False)]:
        monkeypatch.setenv(emulation.ENV, value)
        assert futures.emulated() is on, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool])
def test_output_is_poisoned_until_wait_then_true(dtype):
    out = torch.zeros(5, dtype=dtype)
    real = torch.futures.Future()
    fut = emulation.launch(_start_after(real, torch.ones(5, dtype=dtype)), [out], [0], "test op")
    assert fut.done(), "an emulated collective completes at enqueue, like NCCL's"
    assert emulation.is_poisoned(out), out
    real.set_result(None)
    assert emulation.is_poisoned(out), "the real work finished, but nobody waited yet"
    (got,) = wait(fut)
    assert got is out and torch.equal(out, torch.ones(5, dtype=dtype))
    out.zero_()
    wait(fut)  # a second wait copies nothing again
    assert torch.equal(out, torch.zeros(5, dtype=dtype))


def test_inputs_run_on_private_copies():
    out, inp = torch.zeros(3), torch.arange(3.0)
    seen = []

    def start(o, i):
        seen.append((o.data_ptr() != out.data_ptr(), i.data_ptr() != inp.data_ptr(), i.tolist()))
        return completed([o])

    emulation.launch(start, [out, inp], [0], "test op")
    assert seen == [(True, True, [0.0, 1.0, 2.0])]
    assert not emulation.is_poisoned(inp), "an input the collective only reads stays readable"


def test_failure_surfaces_through_wait_every_time():
    out = torch.zeros(2)
    fut = emulation.launch(lambda o: failed(RuntimeError("Connection closed by peer")), [out], [0], "test op")
    assert fut.done(), "completed at enqueue; the failure shows at the wait"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            wait(fut)
    assert emulation.is_poisoned(out), "a failed collective leaves its output poisoned"


def test_write_before_wait_is_reported():
    out = torch.zeros(4)
    fut = emulation.launch(lambda o: completed([o]), [out], [0], "the test all-reduce")
    out[1] = 3.0  # races the collective on a GPU
    with pytest.raises(emulation.PoisonedWrite, match="the test all-reduce"):
        wait(fut)


def test_settled_results_stay_poisoned_until_their_own_wait(emulated):
    t = torch.arange(4.0)
    fut = torch.futures.Future()
    settle(fut, [t, t])  # the same tensor twice is held once
    assert emulation.is_poisoned(t)
    assert wait(fut)[0] is t and torch.equal(t, torch.arange(4.0))


def test_when_all_holds_its_values_until_waited(emulated):
    t = torch.arange(3.0)
    src = torch.futures.Future()
    joined = when_all([src], t.device, "a test join")
    settle(src, t)
    assert emulation.is_poisoned(t), "held by the source"
    assert joined.done() and emulation.is_poisoned(t), "when_all waited, but its own consumer has not"
    (got,) = wait(joined)
    assert torch.equal(got, torch.arange(3.0))


def test_off_by_default_nothing_poisoned(monkeypatch):
    monkeypatch.delenv(emulation.ENV, raising=False)
    t = torch.arange(3.0)
    fut = torch.futures.Future()
    settle(fut, t)
    assert torch.equal(t, torch.arange(3.0)) and not hasattr(fut, emulation.ATTR)


def test_errors_keep_their_hiersync_type(emulated):
    src = torch.futures.Future()
    joined = when_all([src], torch.device("cpu"), "step 3")
    src.set_exception(RuntimeError("peer gone"))
    with pytest.raises(HierSyncError, match="step 3"):
        wait(joined)


# ------------------------------------------------------------------ it bites
PARITY = ("ddp_parity", ["plain"], 3)
LOCAL_SGD = ("localsgd_check", dict(mode="hook", period=2, steps=4))
OVERLAP = ("localsgd_check", dict(mode="overlap", period=2, steps=5))
ATTACHED = ("localsgd_check", dict(mode="blocking", period=2, steps=4))
SYNCHRONIZE = ("synchronize_check", "blocking")
FSDP_EXACT = ("fsdp_ranks.fsdp_check", dict(reference="hsdp", period=1, steps=2))
FSDP_OVERLAP = ("fsdp_ranks.fsdp_check", dict(reference="ddp", period=2, tau=1, steps=4))

# (module, the function whose wait() is skipped, the run that must notice): every read of a
# collective's result in hiersync.
SITES = {
    "release_reads_buckets_unwaited": ("hiersync.ddp", "_release", PARITY),  # _finish_step
    "later_leg_launched_unwaited": ("hiersync.futures", "go", PARITY),  # Sequencer
    "broadcast_legs_joined_unwaited": ("hiersync.futures", "finish", PARITY),  # collect_all
    # After optimizer.step() (blocking) _complete() is the only reader. (With overlap, and in
    # the hook, it runs inside the gather's Sequencer launch, which has waited on the same future;
    # in the hook _release's wait on the step's join also covers what engine.apply reads.)
    "averaged_params_written_unwaited": ("hiersync.averagers", "_complete", ATTACHED),
    "gathered_shards_written_unwaited": ("hiersync.averagers", "write", ATTACHED),  # blocking: gather at write
    "gathered_correction_added_unwaited": ("hiersync.sync", "apply", OVERLAP),  # gathered early
    "ddp_future_set_unwaited": ("hiersync.futures", "forward", PARITY),  # DDP's futures
    "reduced_bucket_read_unwaited": ("hiersync.ddp", "__call__", PARITY),  # _Reduced: flag, early release
    "flat_leg_read_unwaited": ("hiersync.collectives", "<lambda>", LOCAL_SGD),
    "after_reads_unwaited": ("hiersync.futures", "cb", PARITY),
    "synchronize_reads_unwaited": ("hiersync.frontend", "mean_into", SYNCHRONIZE),
    "fsdp_gradient_shard_read_unwaited": ("hiersync.fsdp", "_on_reduced", FSDP_EXACT),  # exact step, in FSDP's hook
    "fsdp_correction_added_unwaited": ("hiersync.sync", "apply", FSDP_OVERLAP),
    "fsdp_synchronize_reads_unwaited": ("hiersync.frontend", "mean_into", FSDP_EXACT),
}
CAUGHT = ("not close", "nan", "PoisonedWrite", "ranks differ", "non-finite", "differs from rank")


def _run_with_skip(site: str):
    module, caller, (target, *args) = SITES[site]
    return launch(ranks.with_wait_skipped, TOPOLOGIES["2x2"], module, caller, target, *args, timeout=60)


@pytest.mark.parametrize("site", list(SITES))
def test_emulation_catches_a_skipped_wait(site, emulated):
    with pytest.raises(RankFailed) as e:
        _run_with_skip(site)
    report = str(e.value) + e.value.child_traceback
    assert any(word in report for word in CAUGHT), (
        f"skipping futures.wait() in {SITES[site][0]}.{SITES[site][1]} failed, but not because "
        f"of a poisoned read:\n{report[-2000:]}"
    )


@pytest.mark.parametrize("site", ["later_leg_launched_unwaited", "after_reads_unwaited"])
def test_plain_gloo_does_not_see_the_same_defect(site, monkeypatch):
    """Why the mode exists: on gloo a future completes when its data is there."""
    monkeypatch.delenv(emulation.ENV, raising=False)
    _run_with_skip(site)

"""The manager mode's user errors (hiersync.ft): each names the bad value and the fix. No processes."""

from __future__ import annotations

import sys

import pytest
import torch

from hiersync.ft import _manager_comm, register_with_manager
from hiersync.transport import Marker, import_torchft


class _FakeManager:
    """Has the methods hiersync checks for; never reached past the checks in these tests."""

    _use_async_quorum = False

    def start_quorum(self): ...

    def should_commit(self): ...

    def register_state_dict_fn(self, key, load, save): ...

    def num_participants(self):
        return 1


def test_missing_torchft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"hiersync\[peers\]"):
        import_torchft()


def test_not_a_manager():
    pytest.importorskip("torchft")
    with pytest.raises(TypeError, match=r"torchft\.Manager"):
        _manager_comm(object(), {"period": 4})


def test_async_quorum_is_refused():
    pytest.importorskip("torchft")
    m = _FakeManager()
    m._use_async_quorum = True
    with pytest.raises(ValueError, match=r"use_async_quorum=False"):
        _manager_comm(m, {"period": 4})


@pytest.mark.parametrize("name", ["process_group", "topology", "comm"])
def test_own_groups_are_refused(name):
    pytest.importorskip("torchft")
    with pytest.raises(ValueError, match=f"{name}= is not supported"):
        _manager_comm(_FakeManager(), {"period": 4, name: object()})


def test_optimizer_is_required():
    pytest.importorskip("torchft")
    with pytest.raises(TypeError, match="needs the optimizer"):
        register_with_manager(torch.nn.Linear(2, 2), None, _FakeManager(), period=4)


def test_marker_round_trips_and_reads():
    m = Marker("sync", 7, (1, 3), True, 9)
    assert Marker.from_dict(m.as_dict()) == m
    assert m.describe() == "the sync of fragments [1, 3] after step 7"
    assert Marker("sync", 3, (0,)).describe() == "the sync after step 3"
    assert Marker("exact", 2).describe() == "exact step 2"


class _Done:
    """A torch Work whose future is already complete."""

    def __init__(self, value) -> None:
        self.fut = torch.futures.Future()
        self.fut.set_result(value)

    def get_future(self):
        return self.fut


class _BarrierPG:
    """torchft's group as the rail barrier sees it: every node's row is given."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows

    def allgather(self, outs, ins, opts):
        for out, row in zip(outs[0], self.rows):
            out.copy_(torch.tensor(row, dtype=out.dtype))
        return _Done(outs)


class _Manager:
    def __init__(self, rows: list[list[float]], step: int = 10) -> None:
        self._pg, self._quorum_id, self.errors = _BarrierPG(rows), 7, []
        self.step = step

    def current_step(self) -> int:
        return self.step

    def batches_committed(self) -> int:
        return 3 * self.step

    def load_state_dict(self, sd) -> None:
        self.step = sd["step"]

    def num_participants(self) -> int:
        return len(self._pg.rows)

    def report_error(self, e) -> None:
        self.errors.append(str(e))

    def should_commit(self) -> bool:
        return not self.errors

    def errored(self):
        return self.errors[0] if self.errors else None


def _open(rows, step, contributes=True, commits=10):
    from hiersync.transport import TorchftRail

    rail = TorchftRail(_Manager(rows, commits))
    return rail, rail.open(Marker("sync", step, (0,)), torch.device("cpu"), contributes)


def test_a_sync_whose_contributors_agree_on_the_step_commits():
    # node 2 was healed in this quorum (it contributes nothing): its step is not compared
    rail, window = _open([[1, 40], [1, 40], [0, 0]], 40)
    assert window.error is None and window.contributors == 2 and window.participants == 3
    assert rail.decide(window) is True


def test_a_node_a_period_behind_its_peers_votes_no_and_is_healed_at_its_next_quorum():
    """It counts one commit fewer: torchft's next quorum sees it behind and heals it from a peer."""
    rail, window = _open([[1, 40], [1, 44], [1, 44]], 40)
    assert window.error is not None and "behind" in window.error
    assert rail.decide(window) is False and window.committed is False
    assert rail.manager.step == 9  # 10 commits, counted back by one


def test_a_node_behind_with_no_commit_to_count_back_stops_with_a_clear_error():
    from hiersync.futures import HierSyncError

    rail, window = _open([[1, 0], [1, 4], [1, 4]], 0, commits=0)
    with pytest.raises(HierSyncError, match="after step 0 while its peers opened theirs after step 4"):
        rail.decide(window)
    assert window.committed is False


def test_the_peers_of_a_node_behind_drop_the_window_and_go_on():
    rail, window = _open([[1, 40], [1, 44], [1, 44]], 44)
    assert rail.decide(window) is False  # dropped: their local progress is kept, no error
    assert rail.manager.step == 10  # and their commits are their own
    assert "1 at step 40, 2 at step 44" in window.error


@pytest.mark.parametrize(
    ("mine", "steps", "goes_on"),
    [
        (8, [8, 8, 8], True),
        (8, [8, 8, 12], True),  # the most nodes win
        (12, [8, 8, 12], False),
        (12, [8, 12], True),  # a tie: the later step (the node that did not wait out a timeout)
        (8, [8, 12], False),
    ],
)
def test_which_step_goes_on(mine, steps, goes_on):
    from hiersync.transport import stale_step

    verdict = stale_step(mine, steps)
    assert (verdict is None or not verdict[1]) == goes_on
    assert (verdict is None) == (len(set(steps)) == 1)


@pytest.mark.parametrize("bad", [0, -1.0, "5", True])
def test_heartbeat_timeout_must_be_seconds(bad):
    pytest.importorskip("torchft")
    with pytest.raises(ValueError, match=r"heartbeat_timeout=.*--heartbeat_timeout_ms"):
        register_with_manager(
            torch.nn.Linear(2, 2),
            torch.optim.SGD([torch.zeros(1)], lr=0.1),
            _FakeManager(),
            heartbeat_timeout=bad,
            period=4,
        )


@pytest.mark.parametrize("name", ["start_nodes", "heartbeat_timeout"])
def test_manager_options_without_a_manager_are_refused(name):
    import hiersync

    ddp = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=f"{name}=.*manager="):
        hiersync.register(ddp, None, period=4, **{name: 2})


def test_a_torchft_without_a_member_hiersync_uses_names_it_and_the_version(monkeypatch):
    """A torchft release that renamed a private member hiersync reads is refused at register, with
    the member, the installed version and the tested ones named (not an AttributeError mid-sync)."""
    torchft = pytest.importorskip("torchft")
    from hiersync import ftcompat

    manager = object.__new__(torchft.Manager)  # no __init__: no Lighthouse, no store
    for name in ftcompat.USED:
        setattr(manager, name, None)
    manager._pg = torchft.ProcessGroupGloo()
    ftcompat.check(manager)  # every member there: accepted
    del manager._quorum_timeout
    import re

    with pytest.raises(
        RuntimeError, match=rf"Manager\._quorum_timeout .* missing in {re.escape(ftcompat.version())}: .*tested"
    ):
        ftcompat.check(manager)


def test_bounded_sets_the_contact_bound_for_the_quorum_and_puts_the_timeouts_back():
    """While torchft holds the quorum (configures its group, heals), the group's and the Manager's
    timeouts are the contact bound; after it, the long ones again (the window's data uses them)."""
    from datetime import timedelta

    torchft = pytest.importorskip("torchft")
    from hiersync import ftcompat

    long, contact = timedelta(seconds=60), timedelta(seconds=5)
    manager = object.__new__(torchft.Manager)
    manager._pg, manager._timeout, manager._connect_timeout = torchft.ProcessGroupGloo(timeout=long), long, long
    seen = []
    with ftcompat.bounded(manager, contact):
        seen.append((manager._pg._timeout, manager._timeout, manager._connect_timeout))
    assert seen == [(contact, contact, contact)]
    assert (manager._pg._timeout, manager._timeout, manager._connect_timeout) == (long, long, long)
    with pytest.raises(KeyError), ftcompat.bounded(manager, contact):
        raise KeyError("a failed quorum")
    assert (manager._pg._timeout, manager._timeout) == (long, long)  # put back on a failure too
    with ftcompat.bounded(manager, timedelta(seconds=600)):  # never longer than the user's own
        assert manager._timeout == long


def test_the_barrier_runs_under_the_contact_bound_and_the_data_under_the_managers_timeout():
    from datetime import timedelta

    from hiersync.transport import TorchftRail

    limits = []

    class PG(_BarrierPG):
        def allgather(self, outs, ins, opts):
            limits.append(("gather", opts.timeout))
            return super().allgather(outs, ins, opts)

        def allreduce(self, ts, opts):
            limits.append(("reduce", opts.timeout))
            return _Done(ts)

    manager = _Manager([[1, 4], [1, 4]])
    manager._pg, manager._timeout = PG([[1, 4], [1, 4]]), timedelta(seconds=60)
    rail = TorchftRail(manager, contact=timedelta(seconds=3))
    rail.open(Marker("sync", 4, (0,)), torch.device("cpu"))
    rail.allreduce(torch.ones(2), "the average").wait()
    assert limits == [("gather", timedelta(seconds=3)), ("reduce", timedelta(seconds=60))]


def test_the_data_keeps_the_groups_own_timeout_and_the_group_gets_it_back():
    """A group that has its own timeout (torchft's): each data collective runs under it, issued while
    the group's timeout is that limit, and the group holds its own again after the barrier's."""
    from datetime import timedelta

    from hiersync.transport import TorchftRail

    seen = []

    class PG(_BarrierPG):
        _timeout = timedelta(seconds=45)

        def set_timeout(self, t):
            self._timeout = t

        def allgather(self, outs, ins, opts):
            seen.append(("gather", opts.timeout, self._timeout))
            return super().allgather(outs, ins, opts)

        def allreduce(self, ts, opts):
            seen.append(("reduce", opts.timeout, self._timeout))
            return _Done(ts)

    manager = _Manager([[1, 4], [1, 4]])
    manager._pg, manager._timeout = PG([[1, 4], [1, 4]]), timedelta(seconds=60)
    rail = TorchftRail(manager, contact=timedelta(seconds=3))
    rail.open(Marker("sync", 4, (0,)), torch.device("cpu"))
    rail.allreduce(torch.ones(2), "the average").wait()
    three, fortyfive = timedelta(seconds=3), timedelta(seconds=45)
    assert seen == [("gather", three, three), ("reduce", fortyfive, fortyfive)]
    assert manager._pg._timeout == fortyfive

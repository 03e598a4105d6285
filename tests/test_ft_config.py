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

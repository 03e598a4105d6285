"""The pure schedule: which step is exact, local or a sync (microsecond tests)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hiersync.schedule import Schedule


def test_pinned_example():
    s = Schedule(period=4, warmup_steps=2)
    assert [s.kind(i) for i in range(11)] == [
        "exact",
        "exact",
        "local",
        "local",
        "local",
        "sync",
        "local",
        "local",
        "local",
        "sync",
        "local",
    ]


def test_period_one_is_always_exact():
    s = Schedule(period=1, warmup_steps=5)
    assert all(s.kind(i) == "exact" for i in range(20))
    assert s.inter_syncs(20) == 20


@given(period=st.integers(2, 16), warmup=st.integers(0, 20), steps=st.integers(0, 200))
def test_sync_steps_are_every_kth_after_warmup(period, warmup, steps):
    s = Schedule(period=period, warmup_steps=warmup)
    syncs = [i for i in range(steps) if s.is_sync(i)]
    assert syncs == list(range(warmup + period - 1, steps, period))
    assert all(s.is_exact(i) == (i < warmup) for i in range(steps))
    assert s.inter_syncs(steps) == min(steps, warmup) + len(syncs)


@pytest.mark.parametrize(
    "kwargs, exc",
    [(dict(period=0), ValueError), (dict(period=1.0), TypeError), (dict(warmup_steps=-1), ValueError)],
)
def test_validation(kwargs, exc):
    with pytest.raises(exc):
        Schedule(**kwargs)

"""How hiersync launches a collective and keeps every group's issue order: mechanism only.

* :func:`issue` launches one async collective; every collective hiersync runs goes through
  it, so ``HIERSYNC_EMULATE_NCCL=1`` (:mod:`hiersync.emulation`) covers them all.
* :class:`Sequencer` issues the collectives of one group in submission order on every rank,
  whatever order their inputs complete in (later legs are launched from completion
  callbacks, which on gloo run on backend threads).
* gloo's reduce-scatter work has no ``get_future()`` (torch 2.13): one waiter thread turns
  such works into futures.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import emulation
from .futures import Future, completed, forward, new_future, on_side_stream, wait, wrap

__all__ = ["Sequencer", "issue", "reduce_scatter", "all_gather"]


class Sequencer:
    """Issue collectives on one group in submission order, whatever order inputs complete in.

    ``submit(ready, launch)`` calls ``launch()`` once ``ready`` is done *and* every earlier
    submission has been launched (or has failed: a failed submission is marked issued only
    after every earlier one, so the order of the rest never changes). ``launch`` issues one
    async collective and returns its future; ``submit`` returns a device future of that
    collective's result. ``launch`` runs on hiersync's side stream after that stream has
    waited on ``ready`` (docs/design.md, "CUDA streams").
    """

    def __init__(self) -> None:
        self._tail: Future = completed(None)
        self._lock = threading.Lock()

    def submit(self, ready: Future, launch: Callable[[], Future], device: torch.device, phase: str) -> Future:
        out = new_future(device)
        issued: Future = Future()
        with self._lock:
            prev, self._tail = self._tail, issued

        def go(_: Future) -> None:
            try:
                with on_side_stream(device):
                    wait(ready)  # re-raise the upstream failure; on CUDA the side stream waits
                    work = launch()
            except Exception as e:
                issued.set_result(None)
                out.set_exception(wrap(e, phase))
                return
            issued.set_result(None)
            work.add_done_callback(lambda w: forward(w, out, phase))

        # Both must be done: ``ready`` may fail while ``prev`` is still being issued.
        prev.add_done_callback(lambda _: ready.add_done_callback(go))
        return out


# torch 2.13 renamed reduce_scatter_tensor; keep working on older releases (>= 2.4).
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Waiter:
    """One daemon thread that turns ``Work`` objects without ``get_future()`` into futures.

    gloo's reduce-scatter work does not implement ``get_future()`` (torch 2.13). Works are
    waited in submission order, which is the order a group completes them in anyway.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work: dist.Work, value) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hiersync-waiter", daemon=True)
                self._thread.start()
        self._queue.put((work, value, fut))
        return fut

    def _loop(self) -> None:
        while True:
            work, value, fut = self._queue.get()
            try:
                work.wait()
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(value)


_WAITER = _Waiter()


def _async(work: dist.Work | None, value=None) -> torch.futures.Future:
    """The future of an async collective; ``value`` is its result where the backend has none."""
    assert work is not None
    try:
        return work.get_future()
    except RuntimeError as e:
        if "not implemented" not in str(e):
            raise
        return _WAITER.submit(work, [value])


def issue(op: Callable, out: torch.Tensor, *inputs: torch.Tensor, what: str, **kw) -> torch.futures.Future:
    """Launch ``op(out, *inputs, async_op=True, **kw)``; the future's value is ``[out]``.

    Every collective hiersync launches goes through here, so ``HIERSYNC_EMULATE_NCCL=1``
    (:mod:`hiersync.emulation`) covers them all: ``out`` is what the collective writes
    (all of them write their first argument, except a broadcast on its source rank).
    """

    def start(*ts: torch.Tensor) -> torch.futures.Future:
        return _async(op(*ts, async_op=True, **kw), ts[0])

    if not emulation.enabled():
        return start(out, *inputs)
    writes = not (op is dist.broadcast and kw["src"] == dist.get_rank())
    return emulation.launch(start, (out, *inputs), [0] if writes else [], what)

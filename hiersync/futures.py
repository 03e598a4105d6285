"""Futures, errors, the one way to launch a collective and the one way to read its result.

* :func:`issue` launches one async collective; every collective hiersync runs goes through
  it, so ``HIERSYNC_EMULATE_NCCL=1`` (:mod:`hiersync.emulation`) covers them all.
* :class:`Sequencer` issues the collectives of one group in submission order on every rank,
  whatever order their inputs complete in (later legs are launched from completion
  callbacks, which on gloo run on backend threads).
* gloo's reduce-scatter work has no ``get_future()`` (torch 2.13): one waiter thread turns
  such works into futures.

The rules (docs/design.md, "CUDA streams"):

* An NCCL future completes when its collective is *enqueued*; the result is ready only on
  the NCCL stream. ``Future.value()`` never synchronizes streams; ``Future.wait()`` makes
  the *current* streams wait on the future's events (and, on CPU, simply blocks).
* So every read of a collective's result goes through :func:`wait`, on the stream that
  then uses it. A reviewer checks this with ``grep -n "\\.value()" hiersync/``: the only
  ``.value()`` calls are inside :func:`wait` itself.
* A future handed to a consumer that reads it on a device (DDP, a later leg) is a *device*
  future (:func:`new_future`) whose result was set after :func:`wait`, so it records events
  on the stream that waited.
* ``torch.futures.collect_all`` fails as soon as *one* source fails while others still
  run, and its future carries no events. hiersync uses :func:`when_all` instead: it
  completes only when every source has completed, then reads them all through
  :func:`wait`.

Example::

    >>> fut = when_all([comm.intra_allreduce(a), comm.intra_allreduce(b)], a.device, "step 3")
    >>> reduced_a, reduced_b = wait(fut)
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import emulation

logger = logging.getLogger(__name__)
_announced = False

__all__ = [
    "HierSyncError",
    "new_future",
    "completed",
    "ready_now",
    "failed",
    "wait",
    "settle",
    "emulated",
    "then",
    "wrap",
    "when_all",
    "forward",
    "after",
    "span",
    "on_side_stream",
    "Sequencer",
    "issue",
    "reduce_scatter",
    "all_gather",
]

Future = torch.futures.Future


class HierSyncError(RuntimeError):
    """A hiersync collective failed (peer died, timeout, ...). The message names the phase."""


def new_future(device: torch.device) -> Future:
    """A future that, on CUDA, records events on the current streams when its value is set."""
    if device.type == "cuda":
        return Future(devices=[device])
    return Future()


def completed(value: Any, device: torch.device | None = None) -> Future:
    """A future that is already done with ``value``."""
    fut = new_future(device or torch.device("cpu"))
    fut.set_result(value)
    return fut


def ready_now(device: torch.device) -> Future:
    """A completed future to launch a later leg after: what the current stream has queued so far.

    A leg the :class:`Sequencer` launches runs on hiersync's side stream
    after ``wait(ready)``. A device future records events only for the devices of the
    tensors in its value, so on CUDA this one holds a one-element marker tensor: setting it
    records an event on the current stream, and waiting on it makes the side stream wait for
    the inputs the caller has just written. On CPU it is a plain completed future.
    """
    if device.type != "cuda":
        return completed(None)
    return completed(torch.empty(1, device=device), device)


def failed(error: BaseException, device: torch.device | None = None) -> Future:
    """A future that has already failed with ``error``."""
    fut = new_future(device or torch.device("cpu"))
    fut.set_exception(error)
    return fut


def _recover(e: BaseException) -> HierSyncError | None:
    """The :class:`HierSyncError` inside ``e``, if ``e`` is one or torch re-wrapped one."""
    if isinstance(e, HierSyncError):
        return e
    text = str(e)
    marker = "HierSyncError: "
    if marker not in text:
        return None
    err = HierSyncError(text[text.index(marker) + len(marker) :])
    err.__cause__ = e
    return err


def wait(fut: Future) -> Any:
    """Read a collective's result: make the current streams wait on it, return its value.

    The only sanctioned way to read a result in hiersync. Raises a failed hiersync
    collective as :class:`HierSyncError`: torch re-wraps an error raised inside a ``then``
    callback into a plain ``RuntimeError`` whose text contains the original, so the
    hiersync message and type are recovered here. Under ``HIERSYNC_EMULATE_NCCL=1`` this is
    also where a poisoned result gets its true value (:mod:`hiersync.emulation`).
    """
    try:
        pending = getattr(fut, emulation.ATTR, None)  # emulated NCCL mode (emulation.py)
        if pending is not None:
            pending.resolve()
        return fut.wait()
    except Exception as e:
        err = _recover(e)
        if err is None:
            raise
        if err is e:
            raise
        raise err from e


def wrap(e: BaseException, phase: str) -> BaseException:
    """``e`` as a :class:`HierSyncError` naming ``phase`` (kept if it already is one)."""
    err = _recover(e)
    if err is None:
        err = HierSyncError(f"hiersync {phase} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
    return err


def emulated() -> bool:
    """Whether ``HIERSYNC_EMULATE_NCCL`` is set to a true value, read at every call: then
    :func:`issue` and :func:`settle` emulate NCCL's completion (:mod:`hiersync.emulation`)."""
    global _announced
    on = os.environ.get(emulation.ENV, "").strip().lower() not in ("", "0", "false", "no", "off")
    if on and not _announced:
        _announced = True
        logger.warning("%s is set: results stay poisoned until futures.wait() (a slow correctness mode)", emulation.ENV)
    return on


def settle(fut: Future, value: Any, what: str = "a hiersync future") -> None:
    """Complete ``fut`` with ``value`` (read through :func:`wait`): the only way hiersync
    sets a result.

    On CUDA ``fut`` is a device future, so its result is ready on the streams that waited
    here and a consumer must :func:`wait` on ``fut`` in turn. Under emulated NCCL
    (:mod:`hiersync.emulation`) ``value``'s tensors stay poisoned until it does.
    """
    if emulated():
        emulation.hold(fut, value, what)
    fut.set_result(value)


def forward(src: Future, dst: Future, phase: str) -> None:
    """Complete ``dst`` with ``src``'s result (read through :func:`wait`) or its error."""
    try:
        value = wait(src)
    except Exception as e:
        dst.set_exception(wrap(e, phase))
    else:
        settle(dst, value, phase)


def when_all(futs: Sequence[Future], device: torch.device, phase: str) -> Future:
    """A device future of every source's value, completed only once *all* have completed.

    If any source failed, it fails with the first failure in list order (as a
    :class:`HierSyncError` naming ``phase``), but never before every source is done:
    nothing that reads the sources' buffers can run while one is still being written.
    """
    out = new_future(device)
    if not futs:
        out.set_result([])
        return out
    remaining = [len(futs)]
    lock = threading.Lock()

    def finish() -> None:
        values = []
        try:
            for f in futs:
                values.append(wait(f))
        except Exception as e:
            out.set_exception(wrap(e, phase))
        else:
            settle(out, values, phase)

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    for f in futs:
        f.add_done_callback(one_done)
    return out


def then(fut: Future, fn: Callable[[Future], Any], device: torch.device, phase: str = "") -> Future:
    """A device future of ``fn(fut)``; ``fn`` must read ``fut`` through :func:`wait`.

    Like ``fut.then(fn)``, but the result is set with :func:`settle` and an error raised by
    ``fn`` (``fut``'s own, re-raised by ``wait``) fails the returned future as a
    :class:`HierSyncError` naming ``phase``.
    """
    out = new_future(device)

    def cb(f: Future) -> None:
        try:
            value = fn(f)
        except Exception as e:
            out.set_exception(wrap(e, phase or "a hiersync step"))
        else:
            settle(out, value, phase or "a hiersync future")

    fut.add_done_callback(cb)
    return out


def after(fut: Future, value: Callable[[], Any], device: torch.device, phase: str = "") -> Future:
    """A device future of ``value()``, evaluated once ``fut`` is done; ``fut``'s error first.

    A ``then`` callback runs even when its parent failed; one that ignored its argument
    would turn a failed collective into a silently wrong result.
    """

    def cb(f: Future) -> Any:
        wait(f)
        return value()

    return then(fut, cb, device, phase)


def span(name: str, fut: Future) -> Future:
    """Show ``name`` in profiler traces from now until ``fut`` completes.

    Later legs are launched from backend threads that the profiler does not record, so each
    leg's range is opened here, on the calling thread, and closed by the future: the trace
    shows how long every phase really took. Free when no profiler is running.
    """
    if not torch.autograd._profiler_enabled():
        return fut
    with record_function(name) as rf:
        rf._call_end_callbacks_on_future(fut)  # ends the range when ``fut`` completes
    return fut  # the same future: a derived one would bypass its consumer's wait


class _SideStreams:
    """One side stream per CUDA device, created on first use (thread-safe)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
            return s


_SIDE = _SideStreams()


@contextlib.contextmanager
def on_side_stream(device: torch.device) -> Iterator[None]:
    """Run the body on hiersync's side stream of ``device`` (CUDA); a no-op on CPU.

    Later legs are launched from backend callback threads, whose current stream is the
    device's default stream: waiting there would serialize with all other work. The side
    stream waits only on what :func:`wait` tells it to.
    """
    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(_SIDE.get(device)):
        yield


# ----------------------------------------------------------------- issuing collectives
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

    if not emulated():
        return start(out, *inputs)
    writes = not (op is dist.broadcast and kw["src"] == dist.get_rank())
    return emulation.launch(start, (out, *inputs), [0] if writes else [], what)

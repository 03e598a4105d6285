"""NCCL's "complete at enqueue" futures, emulated on any backend (``HIERSYNC_EMULATE_NCCL=1``).

On NCCL a collective's future completes when the work is *enqueued*; its result is ready
only later, on NCCL's stream, and only :func:`hiersync.futures.wait` makes the reading
stream wait for it. The same holds for every device future hiersync derives from it: its
result is ready on the streams that waited, nowhere else. gloo completes a future when
the data is there, so on CPU a read that skips ``wait`` gives the right numbers, and the
same read races on a GPU. This mode makes such a read visible on CPU (docs/design.md,
"Emulated NCCL mode"):

* every collective hiersync launches runs on a *private copy* of its tensors
  (:func:`launch`); its future completes at once and the tensors the collective writes
  are *poisoned* (NaN for floating point, the dtype's minimum for integers, ``True`` for
  bool) until ``wait`` is called for that future, which waits for the real collective
  (raising its failure, as always) and copies the true result in, once;
* every future hiersync completes with a result it read through ``wait`` (the next leg's
  input, a bucket handed to DDP, an averaged parameter vector) is poisoned the same way
  until its own consumer waits on it (:func:`hold`, called by ``futures.settle``): on a
  GPU that consumer's stream has not waited yet, even though hiersync's callback has;
* an output written before its wait (a write racing the collective on a GPU) raises
  :class:`PoisonedWrite` at that wait.

It sees a missing or misplaced ``wait``. It cannot see stream contexts (which stream a
callback runs on), a missing ``record_stream``, caching-allocator reuse, or NCCL's own
watchdog: those need tests/gpu/ on a device. A wait blocks the host until the real
collective is done, so everything runs in launch order and overlaps nothing: this is a
correctness mode, never a benchmark one. The switch is read by :func:`hiersync.futures.emulated`
(the one place every collective and result goes through); this module imports only torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ENV", "ATTR", "PoisonedWrite", "launch", "hold", "poison", "is_poisoned"]

ENV = "HIERSYNC_EMULATE_NCCL"
ATTR = "_hiersync_pending"
"""The attribute of a future that holds its :class:`_Pending` (read by ``futures.wait``)."""


class PoisonedWrite(RuntimeError):
    """A collective's output was written before ``futures.wait`` was called for it."""


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def poison(t: torch.Tensor) -> None:
    """Overwrite ``t`` with the poison of its dtype."""
    t.fill_(_sentinel(t.dtype))


def is_poisoned(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` still holds the poison of its dtype."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).all())
    return bool((t == _sentinel(t.dtype)).all())


class _Pending:
    """The true values of poisoned tensors, copied in at the first ``wait`` of their future."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], what: str, real: Any = None) -> None:
        self.pairs = pairs  # (tensor the caller sees, private tensor with the true values)
        self.what = what
        self.real = real  # the real collective's future, waited first (None: values are known)
        self.error: BaseException | None = None
        self.done = False
        self.lock = threading.Lock()

    def resolve(self) -> None:
        with self.lock:
            if not self.done:
                self.done = True
                try:
                    if self.real is not None:
                        self.real.wait()  # the real collective; raises its failure
                    for dst, _ in self.pairs:
                        if dst.numel() and not is_poisoned(dst):
                            raise PoisonedWrite(
                                f"the result of {self.what} was overwritten before futures.wait() was "
                                "called for it (on a GPU that write races the collective)"
                            )
                    for dst, src in self.pairs:
                        dst.copy_(src)
                except BaseException as e:
                    self.error = e
                finally:
                    self.pairs, self.real = [], None
            if self.error is not None:
                raise self.error


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def hold(fut: Any, value: Any, what: str) -> None:
    """Poison ``value``'s tensors until ``futures.wait(fut)``; call before ``fut`` completes."""
    seen: set[int] = set()
    pairs = []
    for t in _tensors(value):
        if id(t) not in seen:  # the same tensor twice in one result is held once
            seen.add(id(t))
            pairs.append((t, t.detach().clone()))
    for t, _ in pairs:
        poison(t)
    setattr(fut, ATTR, _Pending(pairs, what))


def launch(start: Callable[..., Any], tensors: Sequence[torch.Tensor], written: Sequence[int], what: str) -> Any:
    """Run ``start(*private_copies)`` (which launches the real collective) and return a
    future completed at once with ``[tensors[0]]``, like a c10d work's future.

    ``written`` are the indices of the tensors the collective writes; they stay poisoned
    until ``futures.wait`` is called on the returned future.
    """
    private = [t.detach().clone() for t in tensors]
    real = start(*private)
    pairs = [(tensors[i], private[i]) for i in written]
    for dst, _ in pairs:
        poison(dst)
    device = tensors[0].device
    fut: Any = torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()
    setattr(fut, ATTR, _Pending(pairs, what, real))
    fut.set_result([tensors[0]])
    return fut

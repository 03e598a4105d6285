"""The non-finite guard: a NaN/Inf gradient never updates a parameter, and a GradScaler sees it.

Each reduced bucket gets a 0-d flag on its device (:meth:`NonFiniteGuard.flag`); when the
step's last bucket is done the flags become one verdict, still on the device
(:meth:`judge`): no host synchronization inside backward. The verdict is read on the host
only where it is needed, right before ``optimizer.step()`` (:meth:`skip_update`), from a
pinned copy that was started at the end of backward.

Gradients are **left as reduced**, non-finite values included, so that
``torch.amp.GradScaler`` sees the overflow, skips ``optimizer.step()`` and lowers its scale
(zeroing them would hide the overflow and keep a too-high scale forever). Without a scaler,
hiersync itself skips the update: right before the step of a torch optimizer that owns the
parameters it sets their ``grad`` to ``None``, so built-in optimizers leave them untouched
(no weight decay, no momentum, no step count). A hand-written update loop that reads
``p.grad`` directly gets no such protection: use ``nonfinite="raise"`` there.

Policies: ``"skip"`` (default), ``"raise"`` (raises inside backward; costs one host
synchronization per step to know the verdict there), ``"ignore"`` (no check, no cost).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .stats import Stats
from .vocab import StepKind

__all__ = ["NonFiniteGuard", "NonFiniteError", "flag"]

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """``nonfinite="raise"``: a reduced gradient held NaN or Inf."""


def flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device: is ``t`` free of NaN and Inf?

    The sum is NaN/Inf exactly when an element is (or when finite values overflow fp32,
    which is a blow-up worth skipping as well), and costs one pass with no temporary the
    size of the bucket: 5 ms instead of 190 ms for ``isfinite(t).all()`` on 100 MB here.
    """
    return torch.isfinite(t.sum(dtype=torch.float32))


@dataclass
class _Verdict:
    step: int
    kind: str
    ok: torch.Tensor  # 0-d bool on the host (pinned copy on CUDA)
    event: Any  # torch.cuda.Event recorded after the copy, or None on CPU
    skip: bool | None = None  # decided on the host: None until read


class NonFiniteGuard:
    """Per-step verdict on the reduced gradients of one rank."""

    def __init__(self, policy: str, rank: int, stats: Stats) -> None:
        self.policy = policy
        self.rank = rank
        self.stats = stats
        self._verdict: _Verdict | None = None
        self._lock = threading.Lock()
        self._decided = threading.Event()  # the current step's verdict is in (or failed)
        self._decided.set()
        self._deciding = -1

    @property
    def enabled(self) -> bool:
        return self.policy != "ignore"

    def judge(self, step: int, kind: str, flags: list[torch.Tensor]) -> None:
        """Combine the step's bucket flags. Call on a stream that waited on every bucket.

        ``"raise"`` raises here (a host synchronization); ``"skip"`` keeps the verdict on
        the device and starts a copy to the host that :meth:`skip_update` reads later.
        """
        if not self.enabled or not flags:
            return
        ok = torch.stack(flags).all()
        if self.policy == "raise":
            if not bool(ok):
                where = "the world" if kind == StepKind.EXACT else "this node"
                raise NonFiniteError(
                    f"hiersync: non-finite gradient at step {step} ({kind}) on rank {self.rank} after averaging "
                    f"over {where}; use HierState(nonfinite='skip') to skip such updates"
                )
            return
        event = None
        if ok.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(ok, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            ok = host
        with self._lock:
            self._verdict = _Verdict(step, str(kind), ok, event)

    def expect(self, step: int) -> None:
        """``step``'s buckets are being reduced: :meth:`skip_update` waits for its verdict."""
        with self._lock:
            self._deciding = step
            self._decided.clear()

    def decided(self, step: int) -> None:
        """``step``'s verdict is in (:meth:`judge` ran, or the step failed)."""
        with self._lock:
            if self._deciding == step:
                self._decided.set()

    def skip_update(self) -> bool:
        """Whether the last step's update must be skipped. Read on the host, counted once.

        Waits until the step's verdict is in: DDP may get its buckets (and ``backward()``
        return) before the last flag is judged.
        """
        self._decided.wait()
        with self._lock:
            v = self._verdict
            if v is None:
                return False
            if v.skip is None:
                if v.event is not None:
                    v.event.synchronize()
                v.skip = not bool(v.ok)
                if v.skip:
                    self.stats.count_skip(v.kind)
                    where = "the world" if v.kind == StepKind.EXACT else "this node"
                    logger.warning(
                        "hiersync: non-finite gradient at step %d (%s) on rank %d; %s skips this update",
                        v.step,
                        v.kind,
                        self.rank,
                        where,
                    )
            return v.skip

    def next_step(self) -> None:
        """A new step begins: settle (count) the previous verdict, then forget it."""
        self.skip_update()
        with self._lock:
            self._verdict = None

    @staticmethod
    def drop_grads(optimizer: torch.optim.Optimizer, owned: set[int] | None = None) -> None:
        """Set ``grad = None`` on the optimizer's parameters (those in ``owned``, if given)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if owned is None or id(p) in owned:
                    p.grad = None

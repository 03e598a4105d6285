"""The DDP front-end: the communication hook and its state (which step does what).

``hiersync.hook`` averages gradient buckets inside the node every step and across nodes
only on the steps the :class:`~hiersync.schedule.Schedule` says:

* *exact* steps (``period == 1``, or ``step < warmup_steps``): every bucket is averaged
  over the world with the two-level all-reduce, so training equals DDP's default.
* *local* steps: buckets are averaged inside the node only.
* *sync* steps (every ``period``-th step after warmup): additionally, *parameters* are
  averaged across nodes (rail-sharded) by the :class:`~hiersync.sync.CrossNodeSync` engine.
  Without an attached optimizer it is launched in the hook (at the step's first bucket),
  overlapped with the rest of backward, and applied before ``optimizer.step()``. With
  :meth:`HierState.attach_optimizer` it runs right after ``optimizer.step()``; with
  ``overlap=True`` it is launched there and applied one step later.

A bucket goes to DDP as soon as its own collectives are done, unless its step must decide
first (a sync step in the hook, or ``nonfinite="raise"``); the
:class:`~hiersync.guard.NonFiniteGuard`'s verdict is awaited before ``optimizer.step()``.
A failure is reported only once *every* bucket's collectives have completed, so nothing
still writes a buffer that DDP or the optimizer reads.

Example::

    >>> import hiersync
    >>> state = hiersync.HierState(period=4, warmup_steps=100)   # collective
    >>> ddp_model.register_comm_hook(state, hiersync.hook)
    >>> state.attach_optimizer(optimizer)                         # optional
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import record_function

from . import state_io
from .averagers import ReplicatedNodeAverager
from .ddp_checks import check_bucket, check_same_device, check_usable
from .exact import ExactPolicy
from .frontend import SyncState
from .futures import HierSyncError, new_future, settle, then, wait, when_all, wrap
from .guard import NonFiniteError, NonFiniteGuard, flag
from .localsgd import options_of
from .sync import Correction, CrossNodeSync
from .vocab import StepKind

__all__ = ["HierState", "hook", "HierSyncError"]

EXACT, SYNC = StepKind.EXACT, StepKind.SYNC


@dataclass
class _Bucket:
    reduced: torch.futures.Future  # (reduced gradient, finite flag or None)
    out: torch.futures.Future  # what DDP waits on


class HierState(SyncState):
    """State of the hierarchical hook. Collective: every rank must construct it, in the same order.

    Options are those of :class:`~hiersync.config.HierConfig` (``period``, ``warmup_steps``,
    ``overlap``, ``compress``, ``outer_lr``, ``outer_momentum``, ``outer_optimizer``, ``algorithm``,
    ``nonfinite``, ``timeout``, ``chunk_mb``, ``intra_algorithm``, ``profile``, ``fragments``,
    ``state_device``), plus:

    Args:
        process_group: must be ``None`` (the world); hiersync builds its own subgroups.
        topology: a :class:`Topology` to use instead of :meth:`Topology.detect`.
        comm: a ready :class:`~hiersync.collectives.HierComm` (tests inject a mock here);
            then no groups are built and ``topology``/``timeout`` are ignored.

    ``timeout`` defaults to the world process group's own timeout (the one given to
    ``init_process_group``). Release hooks and groups with :meth:`close` (or ``with``).
    """

    FRONTEND = "ddp"

    def __init__(self, period: int = 1, warmup_steps: int = 0, **kwargs: Any) -> None:
        super().__init__(period, warmup_steps, **kwargs)
        cfg, comm = self.config, self.comm
        # In the hook or after optimizer.step(): each rank keeps the state of its 1/L shard.
        self._use(
            ReplicatedNodeAverager(comm, self.registry, state_device=cfg.state_device, **options_of(cfg)),
            plain=lambda level: ReplicatedNodeAverager(level, self.registry, state_device=cfg.state_device),
        )
        self.exact = ExactPolicy(comm, cfg.algorithm, cfg.profile, self.backend)
        self._buckets: list[_Bucket] = []
        self._in_hook: list[Correction] | None = None  # a sync step in the hook: its averages in flight
        self._first_step = True  # first backward of this process: register every parameter
        self._device: torch.device | None = None
        self._skip_hook: Any = None  # process-wide optimizer pre-hook (no attached optimizer)

    # ------------------------------------------------------------------ public
    @property
    def exact_algorithms(self) -> dict[int, str]:
        """Bucket size in bytes -> exact all-reduce chosen for it (``algorithm="auto"``)."""
        return self.exact.choices

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        super().attach_optimizer(optimizer)
        self._unhook_skip()

    def _before_paced_syncs(self) -> None:
        """DDP rebuilds its buckets at a process's second forward, broadcasting their order over the
        world: under adaptive pace a slow node may reach a sync before its second forward, and wait
        there for the nodes that wait in the broadcast. So the rebuild runs here, after the first
        backward on every rank (as torch's own ``Join`` hook calls it)."""
        model = self._model
        if model is None:
            raise RuntimeError(
                "hiersync: pace='adaptive' needs the DDP model: build the state with hiersync.register(ddp_model, "
                "optimizer, pace='adaptive', ...) rather than register_comm_hook(HierState(...), hook)"
            )
        reducer: Any = model.reducer
        if reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True  # type: ignore[assignment]

    def _model_tensors(self, model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [], list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]

    def close(self) -> None:
        """Remove hiersync's optimizer and global hooks and destroy its process groups.

        Syncs in flight are *not* applied: call :meth:`drain` (or :meth:`synchronize`)
        first to keep them. The hook raises if DDP calls it after this.
        """
        self._unhook_skip()
        super().close()
        self._buckets = []

    # ------------------------------------------------------------------ hook body
    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        kind = self._kind if self._kind is not None else self._begin_step()
        buf = bucket.buffer()
        # bucket.parameters() builds a Python list per call: only the first step registers them.
        in_hook = kind == SYNC and self._optimizer is None
        if self._first_step:
            params = bucket.parameters()
            self._device = check_bucket(buf, params, self._device, self.config.compress)
            self.registry.register(params)
        else:
            check_same_device(buf, self._device)
        # record_function costs ~50 us per bucket even with no profiler running: only when profiling
        profiling = torch.autograd._profiler_enabled()
        with record_function(f"hiersync/hook_{kind}") if profiling else contextlib.nullcontext():
            fut = self.exact.reduce(buf) if kind == EXACT else self.comm.intra_allreduce(buf)
            # The parameters do not change during backward: the sync in the hook launches the whole
            # model at the first bucket (at the last on this process's first backward, which
            # registers the parameters bucket by bucket).
            if in_hook and self._in_hook is None and (bucket.is_last() or not self._first_step):
                self._in_hook = self.engine.launch_now(self.step)
            out = new_future(buf.device)
            # Release the bucket to DDP as soon as it is reduced, unless its step must decide
            # first (a parameter write in the hook, or nonfinite="raise"); then flag it, off
            # DDP's critical path. The verdict is awaited before optimizer.step() (guard).
            early = not in_hook and self.guard.policy != "raise"
            reduced = then(fut, _Reduced(out if early else None, self.guard.enabled), buf.device, self._label())
            self._buckets.append(_Bucket(reduced, out))
        if bucket.is_last():
            self._finish_step(kind)
        # Futures failed through set_exception only raise in Python; re-raising inside a
        # ``then`` callback marks the C++ future as failed, so DDP's backward() raises it.
        return out.then(wait)

    def _begin_step(self) -> StepKind:
        check_usable(self)
        if self._optimizer is None and self.guard.enabled and self._skip_hook is None:
            # No attached optimizer: skip a non-finite update in whatever torch optimizer steps these params.
            ref = weakref.ref(self)
            self._skip_hook = register_optimizer_step_pre_hook(lambda opt, *_: _skip_owned(ref, opt))
        return super()._begin_step()

    def _finish_step(self, kind: StepKind) -> None:
        step, buckets, self._buckets = self.step, self._buckets, []
        in_hook, self._in_hook = self._in_hook or [], None
        sources = [b.reduced for b in buckets] + [c.future for c in in_hook if c.future is not None]
        self.guard.expect(step)  # optimizer.step() waits for this step's verdict (buckets may be released early)
        joined = when_all(sources, self._device or torch.device("cpu"), self._label())
        where = f"step {step} ({kind} step) on rank {self.rank}"
        engine = self.engine
        joined.add_done_callback(lambda j: _release(self.guard, engine, in_hook, buckets, j, step, kind, where))
        if self._first_step:
            self._first_step = False
            state_io.check_loaded_shapes(self)
        self._end_step(kind)

    def _unhook_skip(self) -> None:
        if self._skip_hook is not None:
            self._skip_hook.remove()
            self._skip_hook = None


def _release(
    guard: NonFiniteGuard,
    engine: CrossNodeSync,
    in_hook: list[Correction],
    buckets: list[_Bucket],
    joined: torch.futures.Future,
    step: int,
    kind: StepKind,
    where: str,
) -> None:
    """Once every collective of a step has completed: judge, write, release DDP's futures."""
    try:
        wait(joined)  # on CUDA: this thread's stream now waits on every bucket
        results = [wait(b.reduced) for b in buckets]
        engine.apply(in_hook)  # a sync step in the hook: its averages, before optimizer.step()
        guard.judge(step, kind, [f for _, f in results if f is not None])
    except Exception as e:
        engine.discard(in_hook)
        err = e if isinstance(e, NonFiniteError) else wrap(e, where)
        for b in buckets:
            if not b.out.done():  # buckets released early already went to DDP
                b.out.set_exception(err)
        return
    finally:
        guard.decided(step)
    for b, (t, _) in zip(buckets, results):
        if not b.out.done():
            settle(b.out, t)


class _Reduced:
    """A bucket's reduced gradient, its finite flag, and (``early``) DDP's future set first."""

    def __init__(self, early: torch.futures.Future | None, flagged: bool) -> None:
        self.early, self.flagged = early, flagged

    def __call__(self, fut: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = wait(fut)
        if self.early is not None:
            settle(self.early, t)  # DDP may copy this bucket into .grad now
            t = wait(self.early)  # and this reader waits on what it was given, like any other
        return t, (flag(t) if self.flagged else None)


def _skip_owned(ref: weakref.ref, optimizer: torch.optim.Optimizer) -> None:
    state = ref()
    if state is not None and state.guard.skip_update():
        state.guard.drop_grads(optimizer, owned={id(p) for p in state.registry.params})


def hook(state: HierState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket hierarchically (inside the node; across nodes per the schedule).

    Register it with ``ddp_model.register_comm_hook(state, hiersync.hook)``. With
    ``HierState(period=1)`` training equals DDP's default all-reduce to fp32 rounding.

    Example::

        >>> state = hiersync.HierState(period=4)
        >>> ddp_model.register_comm_hook(state, hiersync.hook)
    """
    if not isinstance(state, HierState):
        raise TypeError(
            f"hiersync.hook needs a hiersync.HierState as its state, got {type(state).__name__}: "
            "ddp_model.register_comm_hook(hiersync.HierState(...), hiersync.hook)"
        )
    return state._on_bucket(bucket)


# DDP's register_comm_hook compares the annotations with the real objects, not strings
# (this module uses postponed evaluation), so spell them out.
hook.__annotations__ = {"state": HierState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}

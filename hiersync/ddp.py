"""The DDP front-end: the communication hook and its state (which step does what).

``hiersync.hook`` averages gradient buckets inside the node every step and across nodes
only on the steps the :class:`~hiersync.schedule.Schedule` says:

* *exact* steps (``period == 1``, or ``step < warmup_steps``): every bucket is averaged
  over the world with the two-level all-reduce, so training equals DDP's default.
* *local* steps: buckets are averaged inside the node only.
* *sync* steps (every ``period``-th step after warmup): additionally, *parameters* are
  averaged across nodes (rail-sharded). Without an attached optimizer this runs in the hook,
  overlapped with the rest of backward, and the averaged values are written before
  ``optimizer.step()``. With :meth:`HierState.attach_optimizer` the
  :class:`~hiersync.sync.CrossNodeSync` engine runs it right after ``optimizer.step()``;
  with ``overlap=True`` it is launched there and applied one step later.

A bucket goes to DDP as soon as its own collectives are done, unless its step must decide
first (a pure-hook sync step, or ``nonfinite="raise"``); the
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
import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.profiler import record_function

from . import state_io
from .collectives import HierComm
from .config import HierConfig
from .ddp_checks import (
    check_attachable,
    check_bucket,
    check_constructible,
    check_optimizer_owns,
    check_same_device,
    check_usable,
    unwrap_optimizer,
)
from .exact import ExactPolicy
from .futures import HierSyncError, new_future, settle, then, wait, when_all, wrap
from .guard import NonFiniteError, NonFiniteGuard, flag
from .localsgd import Launched, ParamAverager
from .stats import Stats
from .sync import build_sync, world_mean
from .topology import Topology, check_layout, world_timeout
from .vocab import StepKind

__all__ = ["HierState", "hook", "register", "HierSyncError"]

logger = logging.getLogger(__name__)
EXACT, LOCAL, SYNC = StepKind.EXACT, StepKind.LOCAL, StepKind.SYNC


@dataclass
class _Bucket:
    reduced: torch.futures.Future  # (reduced gradient, finite flag or None)
    params: Launched | None  # pure-hook sync: the parameter average of this bucket
    out: torch.futures.Future  # what DDP waits on


class HierState:
    """State of the hierarchical hook. Collective: every rank must construct it, in the same order.

    Options are those of :class:`~hiersync.config.HierConfig` (``period``, ``warmup_steps``,
    ``overlap``, ``compress``, ``outer_lr``, ``outer_momentum``, ``algorithm``,
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

    def __init__(
        self,
        period: int = 1,
        warmup_steps: int = 0,
        *,
        process_group: dist.ProcessGroup | None = None,
        topology: Topology | None = None,
        comm: HierComm | None = None,
        **options: Any,
    ) -> None:
        self.config = cfg = HierConfig(period=period, warmup_steps=warmup_steps, **options)
        check_constructible(topology)
        self.schedule = cfg.schedule
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self._world_group = dist.group.WORLD  # the groups below die with it
        self.backend = str(dist.get_backend())
        self.timeout = cfg.timeout if cfg.timeout is not None else world_timeout(process_group)
        if comm is None:
            topology = topology if topology is not None else Topology.detect(process_group)
            groups = topology.build_groups(process_group, timeout=self.timeout)
            comm = HierComm(groups, Stats(), label=self._label, intra_algorithm=cfg.intra_algorithm)
        self.comm = comm
        self.topology, self.groups, self.stats = comm.topology, comm.groups, comm.stats
        self.averager, self.engine = build_sync(comm, cfg)
        self.guard = NonFiniteGuard(cfg.nonfinite, self.rank, self.stats)
        self.exact = ExactPolicy(comm, cfg.algorithm, cfg.profile, self.backend)
        self.step = 0
        """Synchronized backward passes completed (the schedule's step counter)."""
        self._kind: StepKind | None = None  # kind of the step whose buckets are being reduced
        self._last_kind: StepKind | None = None  # kind of the last completed backward
        self._stepped_for = -1  # step count at the last optimizer.step() we acted on
        self._buckets: list[_Bucket] = []
        self._first_step = True  # first backward of this process: register every parameter
        self._capture_pending = True  # anchors are captured on the first non-exact step
        self._device: torch.device | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: list[Any] = []  # optimizer hooks of the attached optimizer
        self._skip_hook: Any = None  # process-wide optimizer pre-hook (no attached optimizer)
        self._owner_checked = False
        self._model: torch.nn.Module | None = None
        self._loaded: dict[str, Any] | None = None  # checkpoint facts not yet checked (state_io)
        self._closed = False
        check_layout(self.topology, cfg.period, self.rank, detail=str(cfg))

    # ------------------------------------------------------------------ public
    @property
    def exact_algorithms(self) -> dict[int, str]:
        """Bucket size in bytes -> exact all-reduce chosen for it (``algorithm="auto"``)."""
        return self.exact.choices

    @property
    def period(self) -> int:
        return self.schedule.period

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Average across nodes right after ``optimizer.step()`` on sync steps.

        Then every rank holds identical parameters after each sync step (without
        ``overlap``). Uses ``Optimizer.register_step_pre_hook``/``register_step_post_hook``.
        """
        optimizer = unwrap_optimizer(optimizer)
        check_attachable(self, optimizer)
        self._optimizer = optimizer
        self._handles = [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        ]
        self._unhook_skip()

    def synchronize(self, model: torch.nn.Module) -> None:
        """Blocking: make every rank's parameters and floating buffers identical (world mean).

        Applies syncs in flight first. Use it before evaluation and before saving a single
        checkpoint for all ranks; it also works right after :meth:`load_state_dict`. Collective.
        """
        if self._model is None:
            self._model = model
        self.drain()
        tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
        with record_function("hiersync/synchronize"):
            world_mean(self.comm, tensors, self.config.chunk_bytes)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the schedule exactly: save it with the model and optimizer.

        Syncs in flight are finished and saved as corrections still to apply (see
        :mod:`hiersync.state_io`). Called by Accelerate's ``save_state`` (the state was given to
        ``accelerator.register_for_checkpointing``), which writes rank 0's copy only, it returns
        every rank's state instead (:mod:`hiersync.integrations.accelerate`).
        """
        if sys._getframe(1).f_globals.get("__name__") == "accelerate.checkpointing":
            from .integrations import accelerate

            return accelerate.rank_states_of(self).state_dict()
        return state_io.save(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Call before the first backward after a restart."""
        from .integrations import _per_rank

        if _per_rank.is_per_rank(state_dict):  # what state_dict() gave Accelerate's save_state
            from .integrations import accelerate

            accelerate.rank_states_of(self).load_state_dict(state_dict)
            return
        state_io.load(self, state_dict)

    def drain(self) -> None:
        """Wait for every cross-node sync in flight and apply it to the parameters. Collective."""
        if self._model is not None:
            state_io.bootstrap_registry(self, self._model)
        self.engine.launch_owed()
        self.engine.apply_pending()

    def close(self) -> None:
        """Remove hiersync's optimizer and global hooks and destroy its process groups.

        Syncs in flight are *not* applied: call :meth:`drain` (or :meth:`synchronize`)
        first to keep them. The hook raises if DDP calls it after this.
        """
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        self._unhook_skip()
        self.engine.close()  # and the registry: DDP keeps this state alive as long as the model
        self.groups.destroy()
        self._model = self._optimizer = None
        self._buckets = []

    def __enter__(self) -> HierState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hook body
    def _label(self) -> str:
        if self._kind is None:  # between backward passes: the sync after optimizer.step()
            return f"step {self.step - 1}, sync after optimizer.step()"
        return f"step {self.step}, {self._kind} step"

    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self._kind is None:
            self._begin_step()
        kind = self._kind
        assert kind is not None
        buf = bucket.buffer()
        # bucket.parameters() builds a Python list per call: fetch it only when needed (the
        # first step registers every parameter; later, only anchors and pure-hook syncs).
        pure_sync = kind == SYNC and self._optimizer is None
        # anchors: per bucket in the pure hook; with an attached optimizer the engine's (sharded) ones, at _end_step
        capture = kind != EXACT and self._capture_pending and self.averager.needs_anchor and self._optimizer is None
        params = bucket.parameters() if (self._first_step or capture or pure_sync) else None
        if self._first_step:
            assert params is not None
            self._device = check_bucket(buf, params, self._device, self.config.compress)
            self.averager.register(params)
        else:
            check_same_device(buf, self._device)
        # record_function costs ~50 us per bucket even with no profiler running: only when profiling
        profiling = torch.autograd._profiler_enabled()
        with record_function(f"hiersync/hook_{kind}") if profiling else contextlib.nullcontext():
            launched = None
            if kind == EXACT:
                fut = self.exact.reduce(buf)
            else:
                if capture:
                    assert params is not None
                    self.averager.capture_anchor(params)
                fut = self.comm.intra_allreduce(buf)
                if pure_sync:
                    assert params is not None
                    launched = self.averager.launch(params)
            out = new_future(buf.device)
            # Release the bucket to DDP as soon as it is reduced, unless its step must decide
            # first (a pure-hook parameter write, or nonfinite="raise"); then flag it, off
            # DDP's critical path. The verdict is awaited before optimizer.step() (guard).
            early = launched is None and self.guard.policy != "raise"
            reduced = then(fut, _Reduced(out if early else None, self.guard.enabled), buf.device, self._label())
            self._buckets.append(_Bucket(reduced, launched, out))
        if bucket.is_last():
            self._end_step(kind)
        # Futures failed through set_exception only raise in Python; re-raising inside a
        # ``then`` callback marks the C++ future as failed, so DDP's backward() raises it.
        return out.then(wait)

    def _begin_step(self) -> None:
        check_usable(self)
        self.guard.next_step()
        self.engine.launch_owed(f" on rank {self.rank}")
        if self._optimizer is None and self.guard.enabled and self._skip_hook is None:
            # No attached optimizer: skip a non-finite update in whatever torch optimizer steps these params.
            ref = weakref.ref(self)
            self._skip_hook = register_optimizer_step_pre_hook(lambda opt, *_: _skip_owned(ref, opt))
        self._kind = self.schedule.kind(self.step)

    def _end_step(self, kind: StepKind) -> None:
        step, buckets, self._buckets = self.step, self._buckets, []
        self.stats.count_step(kind, step)
        sources = [b.reduced for b in buckets] + [b.params.future for b in buckets if b.params is not None]
        self.guard.expect(step)  # optimizer.step() waits for this step's verdict (buckets may be released early)
        joined = when_all(sources, self._device or torch.device("cpu"), self._label())
        where = f"step {step} ({kind} step) on rank {self.rank}"
        joined.add_done_callback(lambda j: _release(self.guard, self.averager, buckets, j, step, kind, where))
        self._last_kind, self._kind = kind, None
        if self._first_step:
            self._first_step = False
            state_io.check_loaded_shapes(self)
        if kind != EXACT and self._capture_pending:
            if self._optimizer is not None and self.averager.needs_anchor:
                self.engine.capture_anchor()  # before optimizer.step(): the values this step started from
            self._capture_pending = False  # every parameter has been seen on a non-exact step
        if kind == SYNC and self._optimizer is not None:
            self.engine.mark_due(step)  # after optimizer.step(), or before the next forward if it is skipped
        self.step += 1

    # ------------------------------------------------------------------ optimizer and global hooks
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.guard.skip_update():
            self.guard.drop_grads(optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._stepped_for == self.step:
            return  # optimizer.step() called again without a synchronized backward in between
        self._stepped_for = self.step
        if not self._owner_checked:
            check_optimizer_owns(optimizer, self.averager.params)
            self._owner_checked = True
        self.engine.after_step(self.step)

    def _unhook_skip(self) -> None:
        if self._skip_hook is not None:
            self._skip_hook.remove()
            self._skip_hook = None


def _release(
    guard: NonFiniteGuard,
    averager: ParamAverager,
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
        for b in buckets:
            if b.params is not None:  # pure-hook sync: write the averaged parameters
                averager.write(b.params.indices, averager.complete(b.params))
        guard.judge(step, kind, [f for _, f in results if f is not None])
    except Exception as e:
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
        state.guard.drop_grads(optimizer, owned={id(p) for p in state.averager.params})


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


def register(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> HierState:
    """Build a :class:`HierState` from ``options``, register the hook, attach ``optimizer``.

    ``optimizer`` may be a framework's wrapper (Accelerate's ``AcceleratedOptimizer`` after
    ``accelerator.prepare``): the torch optimizer inside it is attached.

    Example::

        >>> state = hiersync.register(ddp_model, optimizer, period=4, warmup_steps=100)
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"hiersync.register needs a DistributedDataParallel model, got {type(ddp_model).__name__}: "
            "wrap it first (DistributedDataParallel(model))"
        )
    ddp_group = getattr(ddp_model, "process_group", None)
    if ddp_group is not None and dist.is_initialized() and ddp_group.size() != dist.get_world_size():
        raise ValueError(
            f"hiersync averages over the whole world ({dist.get_world_size()} ranks) but this DDP model "
            f"syncs a process group of {ddp_group.size()} ranks; build DDP without process_group=..."
        )
    state = HierState(**options)
    state._model = ddp_model
    ddp_model.register_comm_hook(state, hook)
    if optimizer is not None:
        state.attach_optimizer(optimizer)
    return state

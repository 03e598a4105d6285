"""The DDP communication hook and its state: which step does what (policy).

``hiersync.hook`` averages gradient buckets inside the node every step and across nodes
only on the steps the :class:`~hiersync.schedule.Schedule` says:

* *exact* steps (``period == 1``, or ``step < warmup_steps``): every bucket is averaged
  over the world with the two-level all-reduce, so training equals DDP's default.
* *local* steps: buckets are averaged inside the node only.
* *sync* steps (every ``period``-th step after warmup): additionally, *parameters* are
  averaged across nodes (rail-sharded). Without an attached optimizer this runs in the hook,
  bucket by bucket, overlapped with the rest of backward, and the averaged values are
  written before ``optimizer.step()``. With :meth:`HierState.attach_optimizer` it runs right
  after ``optimizer.step()`` so every rank holds identical parameters after each sync step;
  with ``overlap=True`` it is launched there and applied one step later as a delta
  correction, hiding the inter-node transfer behind a whole step of compute.

Example::

    >>> import hiersync
    >>> state = hiersync.HierState(period=4, warmup_steps=100)   # collective
    >>> ddp_model.register_comm_hook(state, hiersync.hook)
    >>> state.attach_optimizer(optimizer)                         # optional
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .collectives import INTRA_ALGORITHMS, HierComm, HierSyncError, _new_future, wait
from .localsgd import ParamAverager, Pending, chunk_by_bytes
from .schedule import EXACT, LOCAL, SYNC, Schedule
from .stats import Stats
from .topology import Topology

__all__ = ["HierState", "hook", "register", "ALGORITHMS", "COMPRESS", "NONFINITE"]

logger = logging.getLogger(__name__)

ALGORITHMS = ("two_level", "flat", "auto")
COMPRESS = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
NONFINITE = ("skip", "raise", "ignore")
_FORMAT = "hiersync.HierState/1"


def _choice(name: str, value: Any, allowed: Iterable) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}")


class HierState:
    """State of the hierarchical hook. Collective: every rank must construct it, in the same order.

    Args:
        period: steps between inter-node syncs (k); 1 = exact every step.
        warmup_steps: steps at the start that use exact sync.
        overlap: apply each sync one step late as a delta correction, hiding the inter-node
            transfer behind a step of compute. Needs :meth:`attach_optimizer` and ``period >= 2``.
        compress: ``"bf16"`` or ``"fp16"`` to send parameter *deltas* against the fp32 anchor
            in 16 bits on the inter-node leg (sync steps only); ``None`` sends fp32.
        outer_lr, outer_momentum: DiLoCo outer Nesterov step on the averaged pseudo-gradient
            (e.g. 0.7 and 0.9). ``None`` (default) is plain averaging.
        algorithm: exact-step all-reduce: ``"two_level"`` (default), ``"flat"`` (one world
            all-reduce), or ``"auto"`` (per bucket size, from the cost model and ``profile``).
        nonfinite: what a NaN/Inf gradient does: ``"skip"`` the update (default), ``"raise"``,
            or ``"ignore"`` (no check, no cost).
        timeout: timeout of every collective hiersync issues (``timedelta`` or seconds).
            Default: torch's default for new groups (30 min on gloo, 10 min on NCCL).
        process_group: must be ``None`` (the world); hiersync builds its own subgroups.
        topology: a :class:`Topology` to use instead of :meth:`Topology.detect`.
        profile: path of a calibration profile (``python -m hiersync calibrate``) for ``"auto"``.
        chunk_mb: parameter averaging after ``optimizer.step()`` runs in chunks of this size.
        intra_algorithm: how the node reduces and gathers around the rail leg: ``"rs_ag"``
            (reduce-scatter + all-gather) or ``"allreduce_bcast"`` (all-reduce + one
            broadcast per shard). Default: ``"rs_ag"`` on NCCL, ``"allreduce_bcast"`` on
            gloo, whose reduce-scatter and all-gather are slow on CPU.
    """

    def __init__(
        self,
        period: int = 1,
        warmup_steps: int = 0,
        *,
        overlap: bool = False,
        compress: str | None = None,
        outer_lr: float | None = None,
        outer_momentum: float = 0.0,
        algorithm: str = "two_level",
        nonfinite: str = "skip",
        timeout: datetime.timedelta | float | None = None,
        process_group: dist.ProcessGroup | None = None,
        topology: Topology | None = None,
        profile: str | None = None,
        chunk_mb: float = 25.0,
        intra_algorithm: str | None = None,
    ) -> None:
        self.schedule = Schedule(period=period, warmup_steps=warmup_steps)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        if overlap and period < 2:
            raise ValueError(f"overlap=True needs period >= 2 (there is nothing to overlap at period={period})")
        _choice("compress", compress, COMPRESS)
        _choice("algorithm", algorithm, ALGORITHMS)
        _choice("nonfinite", nonfinite, NONFINITE)
        _choice("intra_algorithm", intra_algorithm, (None, *INTRA_ALGORITHMS))
        if outer_lr is not None and not (isinstance(outer_lr, (int, float)) and outer_lr > 0):
            raise ValueError(f"outer_lr must be a positive number or None, got {outer_lr!r}")
        if not (isinstance(outer_momentum, (int, float)) and 0.0 <= outer_momentum < 1.0):
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if outer_momentum and outer_lr is None:
            raise ValueError(f"outer_momentum={outer_momentum} needs outer_lr (e.g. outer_lr=0.7)")
        if not (isinstance(chunk_mb, (int, float)) and chunk_mb > 0):
            raise ValueError(f"chunk_mb must be > 0, got {chunk_mb!r}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if timeout <= 0:
                raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
            timeout = datetime.timedelta(seconds=timeout)
        elif timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a timedelta or seconds, got {timeout!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "hiersync.HierState needs an initialized process group: call "
                "torch.distributed.init_process_group() on every rank first"
            )
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a hiersync.Topology, got {type(topology).__name__}")

        self.overlap = overlap
        self.compress = compress if compress != "none" else None
        self.algorithm = algorithm
        self.nonfinite = nonfinite
        self.timeout = timeout
        self.chunk_bytes = int(chunk_mb * 2**20)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._world_group = dist.group.WORLD  # the groups below die with it
        self.backend = str(dist.get_backend())
        self.topology = topology if topology is not None else Topology.detect(process_group)
        self.groups = self.topology.build_groups(process_group, timeout=timeout)
        self.stats = Stats()
        self.comm = HierComm(self.groups, self.stats, label=self._label, intra_algorithm=intra_algorithm)
        self.averager = ParamAverager(
            self.comm, compress=COMPRESS[compress], outer_lr=outer_lr, outer_momentum=outer_momentum
        )
        self._profile = profile
        self._auto_cache: dict[int, str] = {}
        self.step = 0
        """Synchronized backward passes completed (the schedule's step counter)."""
        self._kind: str | None = None  # kind of the step whose buckets are being reduced
        self._last_kind: str | None = None  # kind of the last completed backward
        self._stepped_for = -1  # step count at the last optimizer.step() we acted on
        self._step_outputs: list[tuple[torch.futures.Future, torch.futures.Future]] = []
        self._skip_update = False
        self._first_step = True  # first backward of this process: register every parameter
        self._capture_pending = True  # anchors are captured on the first non-exact step
        self._device: torch.device | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_handles: list[Any] = []
        self._owner_checked = False
        self._pending: list[Pending] = []
        self._model: torch.nn.Module | None = None
        logger.info(
            "hiersync: %s, period=%d warmup=%d overlap=%s compress=%s algorithm=%s",
            self.topology.describe(), period, warmup_steps, overlap, self.compress, algorithm,
        )

    # ------------------------------------------------------------------ public
    @property
    def period(self) -> int:
        return self.schedule.period

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Average across nodes right after ``optimizer.step()`` on sync steps.

        Then every rank holds identical parameters after each sync step (without
        ``overlap``). Uses ``Optimizer.register_step_post_hook``.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self._optimizer is not None:
            raise RuntimeError("an optimizer is already attached to this HierState; attach exactly one")
        if self._model is not None:
            self._check_optimizer_owns(optimizer, self._model.parameters())
        self._optimizer = optimizer
        self._optimizer_handles = [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        ]

    def synchronize(self, model: torch.nn.Module) -> None:
        """Blocking: make every rank's parameters and floating buffers identical (world mean).

        Applies a pending overlapped correction first. Use it before evaluation and
        before saving a single checkpoint for all ranks. Collective.
        """
        self._apply_pending()
        tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad(), record_function("hiersync/synchronize"):
            for idx in chunk_by_bytes([t.numel() * 4 for t in tensors], self.chunk_bytes):
                chunk = [tensors[i] for i in idx]
                flat = torch.cat([t.detach().reshape(-1).float() for t in chunk])
                flat = wait(self.comm.allreduce(flat))
                offset = 0
                for t in chunk:
                    t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                    offset += t.numel()

    def state_dict(self) -> dict:
        """Everything needed to continue the schedule exactly: save it with the model and optimizer."""
        # Finish in-flight syncs first: their completion updates the anchor and momentum
        # that averager.state() below saves.
        for p in self._pending:
            p.resolve()
        return {
            "format": _FORMAT,
            "step": self.step,
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "world_size": self.world_size,
            "nodes": [list(n) for n in self.topology.nodes],
            "param_shapes": [tuple(p.shape) for p in self.averager.params],
            "averager": self.averager.state(),
            "pending": [{"indices": list(p.indices), "correction": p.resolve().cpu()} for p in self._pending],
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from :meth:`state_dict`. Call before the first backward after a restart."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise ValueError(
                "not a hiersync HierState state_dict (missing or wrong 'format' key, expected "
                f"{_FORMAT!r}); pass what state.state_dict() returned"
            )
        missing = [k for k in ("step", "period", "warmup_steps", "world_size", "averager", "pending") if k not in state_dict]
        if missing:
            raise ValueError(f"corrupt hiersync state_dict: missing keys {missing}")
        if state_dict["world_size"] != self.world_size:
            raise ValueError(
                f"hiersync state_dict was saved with world size {state_dict['world_size']} but this job has "
                f"{self.world_size}; local-SGD state (anchor, pending corrections) cannot be remapped: call "
                "state.synchronize(model) before saving and start a fresh HierState instead"
            )
        step = state_dict["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"corrupt hiersync state_dict: step={step!r}")
        if (state_dict["period"], state_dict["warmup_steps"]) != (self.period, self.warmup_steps):
            logger.warning(
                "hiersync: checkpoint had period=%s warmup=%s, continuing with period=%s warmup=%s",
                state_dict["period"], state_dict["warmup_steps"], self.period, self.warmup_steps,
            )
        shapes = state_dict.get("param_shapes")
        if shapes is not None and self.averager.params:
            mine = [tuple(p.shape) for p in self.averager.params]
            if [tuple(s) for s in shapes] != mine:
                raise ValueError(
                    f"hiersync state_dict parameter shapes {shapes[:4]}... do not match this model's {mine[:4]}...: "
                    "the checkpoint is from a different model"
                )
        self.averager.load(state_dict["averager"])
        self._pending = [
            Pending(indices=list(p["indices"]), snapshot=None, future=None, correction=p["correction"])
            for p in state_dict["pending"]
        ]
        self.step = step
        self._kind = None
        self._last_kind = None
        self._stepped_for = step
        saved = state_dict.get("stats") or {}
        for k in ("steps", "exact_steps", "local_steps", "sync_steps", "nonfinite_skips", "nonfinite_sync_skips"):
            if k in saved:
                setattr(self.stats, k, saved[k])

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
        capture = kind != EXACT and self._capture_pending and self.averager.needs_anchor
        params = bucket.parameters() if (self._first_step or capture or pure_sync) else None
        if self._first_step:
            self._check_bucket(buf, params)
            self.averager.register(params)
        elif buf.device != self._device:
            raise RuntimeError(
                f"hiersync: gradient bucket on {buf.device} but earlier buckets were on {self._device}; "
                "keep the whole model on one device per rank"
            )
        with record_function(f"hiersync/hook_{kind}"):
            if kind == EXACT:
                fut = self._exact(buf)
            else:
                if capture:
                    self.averager.capture_anchor(params)
                fut = self.comm.intra_allreduce(buf)
                if pure_sync:
                    indices = self.averager.register(params)
                    pfut = self.averager.launch(params).then(lambda f: self.averager.write(indices, f.value()))
                    fut = torch.futures.collect_all([fut, pfut]).then(lambda f: f.value()[0].value())
            if self.nonfinite != "ignore":
                # Check each bucket as soon as it is reduced (overlapping the rest of
                # backward); the step's verdict is taken once, after the last bucket.
                checked = fut.then(_finite_flag)
                out = _new_future(buf.device)
                self._step_outputs.append((checked, out))
                fut = out
        if bucket.is_last():
            self._end_step(kind)
        # Futures failed through set_exception only raise in Python; re-raising inside a
        # ``then`` callback marks the C++ future as failed, so DDP's backward() raises it.
        return fut.then(_value)

    def _begin_step(self) -> None:
        if not dist.is_initialized() or dist.group.WORLD is not self._world_group:
            now = dist.get_world_size() if dist.is_initialized() else "no"
            raise RuntimeError(
                f"this HierState was built for another process group (world size {self.world_size}; now: {now} "
                "ranks): its subgroups died with that group. Build a new HierState (and register the hook "
                "again) after every init_process_group, e.g. after an elastic restart"
            )
        if self.overlap and self._optimizer is None:
            raise RuntimeError(
                "HierState(overlap=True) needs an optimizer: call state.attach_optimizer(optimizer) before training"
            )
        self._kind = self.schedule.kind(self.step)

    def _end_step(self, kind: str) -> None:
        step = self.step
        s = self.stats
        s.steps += 1
        if kind == EXACT:
            s.exact_steps += 1
        elif kind == LOCAL:
            s.local_steps += 1
        else:
            s.sync_steps += 1
            s.recent_sync_steps.append(step)
        outputs, self._step_outputs = self._step_outputs, []
        if outputs:
            torch.futures.collect_all([f for f, _ in outputs]).add_done_callback(
                lambda _: self._finish_step(step, kind, outputs)
            )
        self._last_kind = kind
        self._kind = None
        self._first_step = False
        if kind != EXACT:
            self._capture_pending = False  # every parameter has been seen on a non-exact step
        self.step += 1

    def _finish_step(self, step: int, kind: str, outputs: list) -> None:
        """Runs once every bucket of the step is reduced: the non-finite check, then release DDP."""
        try:
            checked = [f.value() for f, _ in outputs]
            results = [t for t, _ in checked]
            ok = bool(torch.stack([flag for _, flag in checked]).all())  # one device sync per step
        except Exception as e:  # noqa: BLE001
            for _, out in outputs:
                out.set_exception(e)
            return
        if not ok:
            where = "the world" if kind == EXACT else "this node"
            if self.nonfinite == "raise":
                err = RuntimeError(
                    f"hiersync: non-finite gradient at step {step} ({kind}) on rank {self.rank} after averaging "
                    f"over {where}; use HierState(nonfinite='skip') to skip such updates"
                )
                for _, out in outputs:
                    out.set_exception(err)
                return
            self.stats.nonfinite_skips += 1
            if kind == SYNC:
                self.stats.nonfinite_sync_skips += 1
            logger.warning(
                "hiersync: non-finite gradient at step %d (%s) on rank %d; %s skips this update",
                step, kind, self.rank, where,
            )
            self._skip_update = True
            for t in results:
                t.zero_()
        for (_, out), t in zip(outputs, results):
            out.set_result(t)

    def _exact(self, buf: torch.Tensor) -> torch.futures.Future:
        algorithm = self.algorithm
        if algorithm == "auto":
            nbytes = buf.numel() * buf.element_size()
            algorithm = self._auto_cache.get(nbytes) or self._choose(nbytes)
        if algorithm == "flat":
            return self.comm.flat_allreduce(buf)
        return self.comm.allreduce(buf)

    def _choose(self, nbytes: int) -> str:
        from . import costmodel

        topo = self.topology
        if not topo.even:
            choice = "two_level"
        else:
            if isinstance(self._profile, costmodel.Profile):
                profile = self._profile
            elif self._profile is not None:
                profile = costmodel.Profile.load(self._profile)
            else:
                profile = costmodel.PRESETS[costmodel.preset_for_backend(self.backend)]
            self._profile = profile
            choice = costmodel.choose_exact_algorithm(
                nbytes, topo.num_nodes, topo.ranks_per_node, profile, intra_algorithm=self.comm.intra_algorithm
            )
            choice = "flat" if choice == "flat" else "two_level"
        self._auto_cache[nbytes] = choice
        logger.debug("hiersync auto: %d-byte buckets use %s", nbytes, choice)
        return choice

    def _check_bucket(self, buf: torch.Tensor, params: list[torch.Tensor]) -> None:
        devices = {p.device for p in params} | {buf.device}
        if len(devices) > 1:
            raise RuntimeError(
                f"hiersync: parameters of one DDP bucket are on several devices {sorted(map(str, devices))}; "
                "move the whole model to one device per rank (model.to(device)) before wrapping it in DDP"
            )
        if self._device is None:
            self._device = buf.device
        elif buf.device != self._device:
            raise RuntimeError(
                f"hiersync: gradient bucket on {buf.device} but earlier buckets were on {self._device}; "
                "keep the whole model on one device per rank"
            )
        if self.compress is not None and not buf.is_floating_point():
            raise TypeError(
                f"hiersync: compress={self.compress!r} needs floating-point gradients, got a {buf.dtype} bucket; "
                "use compress=None for this model"
            )

    # ------------------------------------------------------------------ optimizer hooks
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._skip_update:
            # Built-in optimizers skip parameters whose grad is None entirely (no weight decay,
            # no momentum, no step count), which is what skipping the update means.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._skip_update = False
        if self._stepped_for == self.step:
            return  # optimizer.step() called again without a synchronized backward in between
        self._stepped_for = self.step
        if not self._owner_checked:
            self._check_optimizer_owns(optimizer, self.averager.params)
            self._owner_checked = True
        self._apply_pending()
        if self._last_kind != SYNC:
            return
        with torch.no_grad(), record_function("hiersync/sync_after_step"):
            chunks = self.averager.chunks(self.chunk_bytes)
            if self.overlap:
                for idx in chunks:
                    params = [self.averager.params[i] for i in idx]
                    snapshot = self.averager.flat(idx)
                    self._pending.append(Pending(idx, snapshot, self.averager.launch(params, snapshot)))
                return
            futs = [self.averager.launch([self.averager.params[i] for i in idx]) for idx in chunks]
            for idx, fut in zip(chunks, futs):
                self.averager.write(idx, wait(fut))

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for p in pending:
                corr = p.resolve()
                n = sum(self.averager.params[i].numel() for i in p.indices) if p.indices else 0
                if corr.numel() != n or max(p.indices, default=-1) >= len(self.averager.params):
                    raise ValueError(
                        f"hiersync pending correction has {corr.numel()} values but its parameters hold {n}: "
                        "the checkpoint is from a different model"
                    )
                self.averager.write(p.indices, corr.to(self.averager.params[p.indices[0]].device), add=True)

    def _check_optimizer_owns(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [tuple(p.shape) for p in params if p.requires_grad and id(p) not in owned]
        if missing:
            raise ValueError(
                f"attach_optimizer: the optimizer does not own {len(missing)} of the model's parameters "
                f"(shapes {missing[:3]}...); build the optimizer from ddp_model.parameters()"
            )


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def _finite_flag(fut: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduced bucket and a 0-d bool: is it free of NaN and Inf?

    The sum is NaN/Inf exactly when an element is (or when finite values overflow fp32,
    which is a blow-up worth skipping as well), and costs one pass with no temporary the
    size of the bucket: 5 ms instead of 190 ms for ``isfinite(t).all()`` on 100 MB here.
    """
    t = fut.value()
    return t, torch.isfinite(t.sum(dtype=torch.float32))


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




"""What the DDP and FSDP2 front-ends share: options, groups, the engine, the step, the optimizer hooks.

A front-end (:class:`hiersync.HierState` for DDP, :class:`hiersync.fsdp.FSDPState` for
FSDP2) knows where a step's gradients are reduced inside the node and tells the shared
parts here what happened: a backward began (:meth:`SyncState._begin_step`) and ended
(:meth:`SyncState._end_step`); the optimizer stepped (its post-hook calls the engine).
This base owns the rest of the lifecycle: the schedule's step counter, the non-finite
guard's hooks around ``optimizer.step()``, checkpoints (:mod:`hiersync.state_io`),
:meth:`drain` and :meth:`close`.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import state_io
from .averagers import RailAverager
from .collectives import HierComm
from .config import HierConfig
from .ddp_checks import check_attachable, check_constructible, check_optimizer_owns, unwrap_optimizer
from .futures import wait
from .guard import NonFiniteGuard
from .levels import RACK, HierLevel, due
from .localsgd import Registry, chunk_by_bytes
from .optstate import with_optimizer_state
from .pace import Windows
from .schedule import Schedule
from .stats import Stats
from .sync import Averager, CrossNodeSync
from .tally import Tally
from .topology import ENV_RACK_IDS, ENV_RACK_KEY, Topology, check_layout, world_timeout
from .transport import GroupRail, Window
from .vocab import StepKind

__all__ = ["SyncState", "LevelEngine"]

EXACT, SYNC = StepKind.EXACT, StepKind.SYNC
logger = logging.getLogger(__name__)


@dataclass
class LevelEngine:
    """A cross-node level at run time: its place in the hierarchy and the engine that averages over it."""

    level: HierLevel
    engine: CrossNodeSync


class CheckpointAdapter(Protocol):
    """How a framework that saves registered objects its own way checkpoints a state.

    An integration (:mod:`hiersync.integrations`) appends one to :data:`CHECKPOINT_ADAPTERS`;
    the core never imports the framework or the integration.
    """

    def state_dict(self, state: SyncState) -> dict[str, Any] | None:
        """What to save instead of ``state_io.save(state)``, or ``None`` when this call is not the framework's."""
        ...

    def load_state_dict(self, state: SyncState, state_dict: Any) -> bool:
        """Load ``state_dict`` if it is this adapter's form; whether it did."""
        ...


CHECKPOINT_ADAPTERS: list[CheckpointAdapter] = []
"""The adapters :meth:`SyncState.state_dict` and :meth:`SyncState.load_state_dict` ask first, in order."""

_OPEN: weakref.WeakSet[SyncState] = weakref.WeakSet()


@atexit.register
def _close_open_states() -> None:
    """A job that ends without ``close()``: end the syncs in flight before the interpreter tears
    the groups down under them (collectives still running then abort the process: 'terminate
    called without an active exception', a failed rank to torchrun)."""
    for state in list(_OPEN):
        state._close_at_exit()


class SyncState:
    """The state both front-ends share. Collective: every rank constructs it, in the same order.

    Options are those of :class:`~hiersync.config.HierConfig`. ``comm`` replaces the groups
    (tests inject a mock); ``timeout`` defaults to the world process group's own timeout.
    """

    FRONTEND = ""
    """The front-end's name in checkpoints (``"ddp"``, ``"fsdp"``)."""

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
        self.windows = Windows(cfg.schedule) if cfg.pace == "adaptive" else None
        """This node's windows under adaptive pace (None: fixed pace, ``period`` steps each)."""
        self.schedule: Schedule | Windows = self.windows if self.windows is not None else cfg.schedule
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self._world_group = dist.group.WORLD  # the groups below die with it
        self.backend = str(dist.get_backend())
        self.timeout = cfg.timeout if cfg.timeout is not None else world_timeout(process_group)
        racks = cfg.rack_period is not None
        if comm is None:
            topology = topology if topology is not None else Topology.detect(process_group)
            self._check_topology(topology)
            if racks:
                _check_racks(topology)
            groups = topology.build_groups(process_group, timeout=self.timeout, racks=racks)
            comm = HierComm(groups, Stats(), label=self._label, intra_algorithm=cfg.intra_algorithm)
        self.comm = comm
        self.topology, self.groups, self.stats = comm.topology, comm.groups, comm.stats
        self.registry = Registry()
        """The parameters hiersync averages, by position (checkpoints refer to these positions)."""
        self.tally: Tally | None = None
        """The samples and step times each sync agrees (None: one node, a test's mock, the manager mode)."""
        if getattr(self.groups, "tally", None) is not None and cfg.period > 1:
            self.tally = Tally(
                self.topology,
                self.rank,
                self.groups.tally,
                self.groups.tally_intra,
                self.stats,
                period=cfg.period,
                fragments=cfg.fragments,
                windows=self.windows,
            )
        self.engine: CrossNodeSync = None  # type: ignore[assignment]  # set by the front-end (_use)
        """The top level's engine (the world's)."""
        self.levels: list[LevelEngine] = []
        """The cross-node levels, bottom to top (the last one's engine is :attr:`engine`)."""
        self.guard = NonFiniteGuard(cfg.nonfinite, self.rank, self.stats)
        self.step = 0
        """Synchronized backward passes completed (the schedule's step counter)."""
        self._kind: StepKind | None = None  # kind of the step whose gradients are being reduced
        self._stepped_for = -1  # step count at the last optimizer.step() we acted on
        self._capture_pending = True  # anchors are captured on the first non-exact step
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: list[Any] = []  # hooks to remove at close()
        self._owner_checked = False
        self._model: torch.nn.Module | None = None
        self._loaded: dict[str, Any] | None = None  # checkpoint facts not yet checked (state_io)
        self._closed = False
        self._paced_once = False  # adaptive pace: _before_paced_syncs ran in this process
        self._check_layout()
        _OPEN.add(self)

    def _check_topology(self, topology: Topology) -> None:
        """A front-end's requirement on the node layout (before any group is built)."""

    def _check_layout(self) -> None:
        """Log the layout and warn about one that defeats hierarchical sync (the manager mode logs its own)."""
        check_layout(self.topology, self.config.period, self.rank, detail=str(self.config))
        racks = self.topology.racks
        if self.config.rack_period is not None and racks is not None and self.rank == 0:
            import warnings

            msg = None
            if len(racks) == 1:
                msg = "one rack holds every node, so the rack level averages what the world level does"
            elif max(len(r) for r in racks) == 1:
                msg = "every rack holds one node, so the rack level averages nothing"
            if msg:
                warnings.warn(f"hiersync: rack_period={self.config.rack_period} but {msg}", UserWarning, stacklevel=4)

    def _use(self, averager: Averager, plain: Callable[[HierComm], Averager] | None = None) -> None:
        """Build the engine of every cross-node level: the top one over the front-end's ``averager``,
        a level below it over ``plain(comm)`` (the same kind of averager, fp32, on that level's rail)."""
        cfg = self.config
        positions = lambda: state_io.model_positions(self)
        self.levels = []
        for level in cfg.levels[1:-1]:
            assert level.name == RACK and plain is not None, level
            rail = self.groups.rack_rail
            comm = self.comm.over(GroupRail(rail, rail.size() if rail is not None else 1), RACK)
            engine = CrossNodeSync(
                plain(comm),
                self.registry,
                level.schedule,
                overlap=0,
                chunk_bytes=cfg.chunk_bytes,
                transport=comm.rail,
                model_positions=positions,
            )
            self.levels.append(LevelEngine(level, engine))
        self.engine = CrossNodeSync(
            averager,
            self.registry,
            self.schedule,
            overlap=cfg.overlap,
            chunk_bytes=cfg.chunk_bytes,
            transport=self.comm.rail,
            model_positions=positions,
            tally=self.tally,
            weights_to=self.comm,
        )
        self.levels.append(LevelEngine(cfg.levels[-1], self.engine))

    # ------------------------------------------------------------------ public
    @property
    def period(self) -> int:
        return self.schedule.period

    @property
    def warmup_steps(self) -> int:
        return self.schedule.warmup_steps

    @property
    def window(self) -> int:
        """Windows this node has closed (its syncs of the whole model): equal on every node after the
        same sync, whatever the pace. Under adaptive pace :attr:`step` differs across nodes and this
        does not: stop, evaluate and checkpoint at a window (``if state.window == w``), not a step."""
        if self.windows is not None:
            return self.windows.window
        return max(0, self.step - self.warmup_steps) // self.period if self.period > 1 else 0

    def count_samples(self, n: float) -> None:
        """Count ``n`` samples (or tokens) trained by this rank in the step under way.

        Every cross-node average weighs a node by the samples its ranks trained since its last
        sync (one unit per rank and step until a rank first counts; from then on what it counts).
        Call it on every rank, once or more per step, before ``optimizer.step()``.
        """
        if self.tally is not None:
            self.tally.count(n)
        elif isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 <= n < float("inf"):
            raise ValueError(f"count_samples(n) needs a finite number >= 0 (the step's samples or tokens), got {n!r}")

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Average across nodes right after ``optimizer.step()`` on sync steps.

        Then every rank holds identical parameters after each sync step (without
        ``overlap``). Uses ``Optimizer.register_step_pre_hook``/``register_step_post_hook``.
        """
        optimizer = unwrap_optimizer(optimizer)
        check_attachable(self, optimizer)
        self._optimizer = optimizer
        names = self.config.average_optimizer_state
        if names:
            assert isinstance(self.engine.averager, RailAverager)
            self.engine.averager = with_optimizer_state(
                self.engine.averager, optimizer, names, self.comm, self.config.compress
            )
        self._handles += [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        ]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the schedule exactly: save it with the model and optimizer.

        Each rank saves its own (its shard of the local-SGD state). Syncs in flight are
        finished and saved as corrections still to apply (see :mod:`hiersync.state_io`).
        A framework that writes rank 0's copy only (Accelerate's ``save_state``) gets every
        rank's state instead, through the :data:`CHECKPOINT_ADAPTERS` its integration registers
        (:mod:`hiersync.integrations.accelerate`).
        """
        for adapter in CHECKPOINT_ADAPTERS:
            saved = adapter.state_dict(self)
            if saved is not None:
                return saved
        return state_io.save(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Call before the first backward after a restart."""
        if not any(adapter.load_state_dict(self, state_dict) for adapter in CHECKPOINT_ADAPTERS):
            state_io.load(self, state_dict)

    def synchronize(self, model: torch.nn.Module | None = None) -> None:
        """Blocking: make every rank's parameters and floating buffers identical (the world mean).

        Applies syncs in flight first. Use it before evaluation and before saving a single
        checkpoint for all ranks; it also works right after :meth:`load_state_dict`. Collective.
        """
        if self._model is None:
            self._model = model
        self.drain()
        self._average_model(model if model is not None else self._model)

    def _model_tensors(self, model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What :meth:`synchronize` averages: (this rank's shards, averaged on its rail; tensors
        every rank of the node holds alike, averaged over the world)."""
        raise NotImplementedError

    @torch.no_grad()
    def _average_model(self, model: torch.nn.Module | None, window: Window | None = None) -> None:
        """Average ``model`` across every rank, in ``window`` (written only if it commits)."""
        assert model is not None, "synchronize(model) needs the model"
        shards, replicated = self._model_tensors(model)
        if self.tally is not None:  # each node weighed by its samples in the open window
            self._weigh_open_window(shards, replicated, window)
        droppable = window is not None and self.comm.rail.droppable
        targets = [[t.detach().clone() for t in ts] if droppable else ts for ts in (shards, replicated)]
        with record_function("hiersync/synchronize"):
            mean_into(self.comm.average_shard, targets[0], self.config.chunk_bytes)
            mean_into(self.comm.allreduce, targets[1], self.config.chunk_bytes)
        if window is not None and self.comm.rail.decide(window) and droppable:
            for t, new in zip(shards + replicated, targets[0] + targets[1]):
                t.copy_(new)

    def _weigh_open_window(
        self, shards: list[torch.Tensor], replicated: list[torch.Tensor], window: Window | None = None
    ) -> None:
        """Scale this node's tensors so that the plain means of :meth:`_average_model` weigh each node
        by its samples in the open window (nothing when every node has as many, or none has any)."""
        assert self.tally is not None
        if window is not None and self.comm.rail.droppable:  # torchft: the window's barrier carried them
            samples = self.tally.open_window(window.rows, window.rank)
            own, total = (samples[window.rank], sum(samples)) if samples else (0.0, 0.0)
            counted = [s for s, row in zip(samples, window.rows) if row[0]]  # a node healed here counts none
            if total == 0 or all(s == own for s in counted):
                return
            for t in shards + replicated:  # nodes of one size: both means are over the contributors
                t.mul_(self.comm.rail_divisor() * own / total)
            return
        samples = self.tally.open_window()
        own, total = samples[self.tally.node], sum(samples)
        if total == 0 or all(
            s * len(n) == samples[0] * len(self.topology.nodes[0]) for s, n in zip(samples, self.topology.nodes)
        ):
            return
        N, L = self.topology.num_nodes, self.groups.node_size
        for t in shards:  # averaged on the rail: a mean over nodes
            t.mul_(N * own / total)
        for t in replicated:  # averaged over the world: a mean over ranks
            t.mul_(self.world_size * own / (L * total))

    def drain(self) -> None:
        """Wait for every cross-node sync in flight and apply it to the parameters. Collective."""
        if self._model is not None:
            state_io.bootstrap_registry(self, self._model)
        for lv in self.levels:
            lv.engine.launch_due()
            lv.engine.apply_corrections()

    def close(self) -> None:
        """Remove hiersync's hooks and destroy its process groups (before the job's
        ``destroy_process_group()``, which destroys them under the syncs still in flight).

        Syncs in flight are *not* applied: their collectives are waited for (every node takes
        part in them), their results dropped. Call :meth:`drain` (or ``synchronize``) first
        to keep them.
        """
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        for lv in self.levels:
            lv.engine.close()  # and the registry: DDP keeps a hook's state alive as long as the model
        self.groups.destroy()
        self._model = self._optimizer = None

    def _close_at_exit(self) -> None:
        """The interpreter exits and this state is still open: close it (see ``_close_open_states``)."""
        if not dist.is_initialized() and any(lv.engine.in_flight for lv in self.levels):
            logger.warning(
                "hiersync: the job destroyed its process groups with cross-node syncs still in flight, which "
                "fail now; call state.close() (or state.drain() to keep them) before dist.destroy_process_group()"
            )
        self.close()

    def __enter__(self) -> SyncState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the step
    def _label(self) -> str:
        if self._kind is None:  # between backward passes: the sync after optimizer.step()
            return f"step {self.step - 1}, sync after optimizer.step()"
        return f"step {self.step}, {self._kind} step"

    def _begin_step(self) -> StepKind:
        """A synchronized backward begins: settle the last verdict, launch a due sync; its kind."""
        self.guard.next_step()
        for lv in self.levels:
            lv.engine.launch_due(f" on rank {self.rank}")
        self._kind = self.schedule.kind(self.step)
        return self._kind

    def _end_step(self, kind: StepKind) -> int:
        """The step's gradients are reduced: count it, capture anchors, mark its sync due; the step."""
        step = self.step
        self.stats.count_step(kind, step)
        self._kind = None
        if kind != EXACT and self._capture_pending:
            self.engine.capture_anchor()  # before optimizer.step(): the values this step started from
            self._capture_pending = False  # every parameter has been seen on a non-exact step
        if self.tally is not None:
            self.tally.end_step(kind == EXACT)
        if kind != EXACT and self.windows is not None and self._optimizer is None:
            raise RuntimeError(
                "hiersync: pace='adaptive' times each step by its optimizer.step(): attach the optimizer "
                "(hiersync.register(model, optimizer, ...) or state.attach_optimizer(optimizer))"
            )
        if kind != EXACT:  # without an optimizer, a sync step's average was launched in the hook
            names = self._due(step) if self._optimizer is not None else ()
            for lv in self.levels:
                if lv.level.name in names:  # after optimizer.step(), or before the next forward if it is skipped
                    lv.engine.mark_due(step)
                else:
                    lv.engine.idle()
        self.step += 1
        return step

    def _before_paced_syncs(self) -> None:
        """Adaptive pace, this process's first ``optimizer.step()`` (every rank has exactly one):
        what the front-end must do on every rank before the nodes' steps part ways."""

    def _due(self, step: int) -> tuple[str, ...]:
        """The levels whose average runs after ``step`` (adaptive pace: the world's, at this node's windows)."""
        if self.windows is not None:
            return (self.config.levels[-1].name,) if self.windows.is_sync(step) else ()
        return due(self.config.levels, step)

    def resume_windows(self, step: int, saved_tally: dict[str, Any] | None) -> None:
        """After a checkpoint's load at ``step``: windows from one saved without them start at the
        fixed schedule's place (``period`` steps each until the tally has paced a window)."""
        w = self.windows
        if w is None or (saved_tally is not None and "windows" in saved_tally):
            return
        done = max(0, step - self.warmup_steps) // self.period
        w.load({"start": self.warmup_steps + done * self.period, "length": self.period, "window": done})

    # ------------------------------------------------------------------ optimizer hooks
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.guard.skip_update():
            self.guard.drop_grads(optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._stepped_for == self.step:
            return  # optimizer.step() called again without a synchronized backward in between
        self._stepped_for = self.step
        if not self._owner_checked:
            check_optimizer_owns(optimizer, self.registry.params)
            self._owner_checked = True
        tally = self.tally
        if tally is not None and not self.schedule.is_exact(self.step - 1):
            tally.step_timed()
        if self.windows is not None and not self._paced_once:
            self._paced_once = True
            self._before_paced_syncs()
        if len(self.levels) > 1:  # the top's corrections first: a lower level then averages them in
            self.engine.apply_corrections(self.step)
        for lv in self.levels:
            lv.engine.after_step(self.step)
        if tally is not None:
            tally.update_ended()


def _check_racks(topology: Topology) -> None:
    """A rack level needs racks, and nodes of equal size (its rail is a rail's piece)."""
    if topology.racks is None:
        raise ValueError(
            f"rack_period is set but no racks are known: set {ENV_RACK_IDS} (one rack id per global rank, e.g. "
            f"'0,0,0,0,1,1,1,1') or {ENV_RACK_KEY} (the name of a variable naming each rank's rack), or pass "
            "topology=Topology.from_node_ids(node_ids, rack_ids)"
        )
    if not topology.even:
        raise ValueError(
            f"rack_period needs nodes with equal numbers of ranks; this job's nodes hold "
            f"{[len(n) for n in topology.nodes]} ranks: drop rack_period"
        )


@torch.no_grad()
def mean_into(
    average: Callable[[torch.Tensor], torch.futures.Future], tensors: list[torch.Tensor], chunk_bytes: int
) -> None:
    """Overwrite ``tensors`` with ``average`` of their values, fp32, chunked: ``comm.allreduce`` (the
    world mean of replicated tensors) or ``comm.average_shard`` (the rail mean of own shards)."""
    for idx in chunk_by_bytes([t.numel() * 4 for t in tensors], chunk_bytes):
        chunk = [tensors[i] for i in idx]
        flat = wait(average(torch.cat([t.detach().reshape(-1).float() for t in chunk])))
        offset = 0
        for t in chunk:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()

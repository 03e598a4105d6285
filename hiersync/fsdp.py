"""The FSDP2 front-end: period-k and streaming sync across nodes for a model sharded inside the node.

FSDP2 (``fully_shard``) over :func:`node_mesh` reduce-scatters the gradients inside the
node every step: that is the intra leg. hiersync owns everything across nodes, on the
rails (local rank ``l`` of every node holds the same shard of every parameter):

* *exact* steps (``period=1``, or warmup): each gradient shard is averaged on its rail
  inside backward (FSDP2's all-reduce hook, after the reduce-scatter), so training equals
  FSDP2's HSDP on a (node, local) mesh;
* *local* steps: nothing crosses nodes;
* *sync* steps: after ``optimizer.step()`` each rank averages its own parameter shards on
  its rail (blocking, overlapped or streaming, with every option of the DDP front-end);
  the local-SGD state is that of the rank's shard by construction, nothing is gathered.
  Fragments are whole parameters packed in ``model.parameters()`` order, as on the DDP
  front-end, so the two front-ends stream the same fragments of the same model.

Example::

    >>> mesh = hiersync.node_mesh()
    >>> for block in model.blocks: fully_shard(block, mesh=mesh)
    >>> fully_shard(model, mesh=mesh)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> state = hiersync.register(model, opt, period=4, fragments=4, overlap=1)

Not run on a GPU yet (docs/fsdp.md): the CUDA path follows docs/design.md's stream rules
(the hook runs on FSDP2's all-reduce stream and waits there).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
import torch.distributed as dist

from .averagers import ShardedNodeAverager
from .ddp_checks import check_usable
from .frontend import SyncState
from .futures import wait
from .guard import flag
from .localsgd import options_of
from .topology import Topology
from .vocab import StepKind

__all__ = ["FSDPState", "node_mesh", "is_fsdp2"]

logger = logging.getLogger(__name__)
EXACT = StepKind.EXACT

_IGNORED = {"algorithm": "two_level", "intra_algorithm": None, "profile": None}
"""DDP-only options: the exact step's bucket all-reduce (FSDP2 reduce-scatters inside the node)."""


def is_fsdp2(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` was called on it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _even_topology(topology: Topology) -> Topology:
    if not topology.even:
        raise ValueError(
            f"the FSDP2 front-end needs nodes with equal numbers of ranks (the shards of local rank l line up "
            f"across nodes only then); this job has nodes {[len(n) for n in topology.nodes]} ranks: give every "
            "node the same number of ranks (or use DDP with hiersync.register(ddp_model, ...))"
        )
    return topology


def node_mesh(device_type: str | None = None) -> Any:
    """A 1-D ``DeviceMesh`` over this rank's node, for ``fully_shard(..., mesh=node_mesh())``. Collective.

    Nodes are found as :meth:`hiersync.Topology.detect` finds them (``HIERSYNC_NODE_IDS``,
    ``HIERSYNC_NODE_KEY``, hostname + torchrun's ``GROUP_RANK``); they need not be
    contiguous but must hold equal numbers of ranks. ``device_type``: ``"cuda"`` where
    CUDA is available, else ``"cpu"``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hiersync.node_mesh() needs an initialized process group: call init_process_group() first")
    topology = _even_topology(Topology.detect())
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    grid = torch.tensor([list(n) for n in topology.nodes], dtype=torch.int)
    return DeviceMesh(device_type, grid, mesh_dim_names=("node", "local"))["local"]


class FSDPState(SyncState):
    """hiersync's state for an FSDP2 model. Collective: every rank builds it, in the same order.

    Use :func:`hiersync.register` (``hiersync.register(fsdp_model, optimizer, period=...)``);
    options are those of :class:`~hiersync.config.HierConfig` (the DDP-only ``algorithm``,
    ``intra_algorithm`` and ``profile`` are ignored with a warning).
    """

    FRONTEND = "fsdp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
        if not is_fsdp2(model):
            raise TypeError(_not_fsdp2(model))
        for key, default in _IGNORED.items():
            if options.get(key, default) != default:
                logger.warning("hiersync: %s=%r applies to DDP only; the FSDP2 front-end ignores it", key, options[key])
        super().__init__(**options)
        self._check_sharding(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.registry.register(params)
        cfg = self.config
        self._use(
            ShardedNodeAverager(self.comm, self.registry, state_device=cfg.state_device, **options_of(cfg)),
            plain=lambda level: ShardedNodeAverager(level, self.registry, state_device=cfg.state_device),
        )
        self._flags: list[torch.Tensor] = []
        self._model = model
        self._fsdp_modules: list[Any] = [m for m in model.modules() if is_fsdp2(m)]
        for m in self._fsdp_modules:
            try:
                m.set_all_reduce_hook(self._on_reduced)
            except ValueError as e:
                raise ValueError(
                    f"hiersync: {e}; shard each module with one mesh (fully_shard(module, mesh=hiersync.node_mesh()))"
                ) from e
        self.attach_optimizer(optimizer)

    def _check_topology(self, topology: Topology) -> None:
        _even_topology(topology)

    def _check_sharding(self, model: torch.nn.Module) -> None:
        node = sorted(self.topology.node_ranks(self.rank))
        for name, p in model.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None:
                raise ValueError(
                    f"hiersync: parameter {name!r} is not sharded by fully_shard (a plain tensor): call "
                    "fully_shard(model, mesh=hiersync.node_mesh()) on the root module too"
                )
            ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
            if mesh.ndim != 1 or ranks != node:
                raise ValueError(
                    f"hiersync: parameter {name!r} is sharded over ranks {ranks} (a {mesh.ndim}-D mesh), but this "
                    f"rank's node holds ranks {node}: shard the model inside the node with "
                    "fully_shard(module, mesh=hiersync.node_mesh()); hiersync itself syncs across nodes"
                )
            if self.backend == "nccl" and p.device.type == "cpu":
                raise ValueError(
                    f"hiersync: parameter {name!r} is kept on the CPU (FSDP2 CPU offload), which NCCL rails cannot "
                    "average; keep the sharded parameters on the GPU"
                )

    # ------------------------------------------------------------------ public
    def _model_tensors(self, model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A rank's own parameter shards (DTensors once :meth:`drain` resharded) and the floating
        buffers, which FSDP2 replicates."""
        shards = [cast(Any, p).to_local() for p in model.parameters()]
        return shards, [b for b in model.buffers() if b.is_floating_point()]

    def drain(self) -> None:
        """Wait for every cross-node sync in flight and apply it to the parameter shards. Collective."""
        # A forward without a backward (evaluation) leaves the root unit unsharded (its
        # reshard_after_forward defaults to False): writes into the shards would not reach that
        # copy, and the next forward would train on it. Free it first.
        for m in self._fsdp_modules:
            m.reshard()
        super().drain()

    def close(self) -> None:
        """Remove hiersync's hooks (FSDP2's all-reduce hooks included) and destroy its groups."""
        if not self._closed:
            for m in self._fsdp_modules:
                m.set_all_reduce_hook(_no_hook)
            self._fsdp_modules = []
        super().close()

    # ------------------------------------------------------------------ the step
    def _on_reduced(self, reduced: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: one unit's gradient shard, reduce-scattered inside the node."""
        if self._kind is None:
            check_usable(self)
            self._begin_step()
            # The end of this backward (after FSDP2's own final callback, queued at its start).
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self._kind == EXACT:  # HSDP: the rail all-reduce of the gradient shard, on this (FSDP's) stream
            wait(self.comm.average_shard(reduced))
        if self.guard.enabled:
            self._flags.append(flag(reduced))

    def _backward_done(self) -> None:
        kind, step = self._kind, self.step
        assert kind is not None
        flags, self._flags = self._flags, []
        self.guard.expect(step)
        try:
            if flags:
                # One verdict per node: its ranks hold different shards of the same gradient.
                bad = (~torch.stack(flags).all()).float().reshape(1)
                wait(self.comm.intra_allreduce(bad))
                self.guard.judge(step, kind, [bad[0] == 0])
        finally:
            self.guard.decided(step)
            self._end_step(kind)


def _no_hook(_: torch.Tensor) -> None:
    return None


def _not_fsdp2(model: Any) -> str:
    return f"hiersync's FSDP2 front-end needs a module that fully_shard was called on, got {type(model).__name__}"

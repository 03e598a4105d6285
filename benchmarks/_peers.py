"""A small gloo world whose rank 0 is the pytest process itself (benchmarks only).

pytest-benchmark times code in the pytest process, but a collective needs peers. This
module starts ``world_size - 1`` helper processes, forked in milliseconds from the
forkserver of :mod:`hiersync.tools.launch` (torch is imported there already), that rendezvous
with the pytest process through a ``FileStore`` in a temporary folder (no ports).
:meth:`PeerWorld.call` sends ``(function, args)`` to every helper and then runs the same
function here, so every collective is issued by every rank the same number of times,
whatever pytest-benchmark's rounds, warm-up or ``--benchmark-disable`` do. Helpers die
with the world: on exit, on error, or after ``timeout`` seconds without a command.

Example::

    >>> with PeerWorld(4, node_ids=[0, 0, 1, 1]) as world:
    ...     world.call("allreduce_setup", "two_level", 1 << 18)
    ...     benchmark(world.call, "allreduce", "two_level")
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hiersync.futures import wait

__all__ = ["PeerWorld", "FUNCTIONS"]

_STATE: dict[str, Any] = {}


# ---------------------------------------------------------------- functions every rank runs
def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _timed_hiersync_hook(state, bucket):
    import hiersync

    t0 = time.perf_counter_ns()
    fut = hiersync.hook(state, bucket)
    _STATE["hook_ns"].append(time.perf_counter_ns() - t0)
    return fut


for _h in (_noop_hook, _timed_hiersync_hook):
    _h.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


def ddp_setup(variant: str, layers: int) -> None:
    """A DDP model of ``layers`` tiny Linear layers, one bucket per parameter, with hook ``variant``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
    # 100 bytes: smaller than any parameter, so DDP puts every parameter in its own bucket.
    ddp = DDP(model, bucket_cap_mb=1e-4)
    state = None
    if variant == "noop_hook":
        ddp.register_comm_hook(None, _noop_hook)
    elif variant == "torch_allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif variant.startswith("hiersync_p"):
        state = hiersync.HierState(period=int(variant[len("hiersync_p") :]))
        ddp.register_comm_hook(state, _timed_hiersync_hook)
    elif variant != "ddp_default":
        raise ValueError(f"variant={variant!r} is not known")
    g = torch.Generator().manual_seed(dist.get_rank())
    _STATE.update(ddp=ddp, state=state, hook_ns=[], x=torch.randn(4, 32, generator=g), loss=None)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        forward()
        backward()
    _STATE["hook_ns"].clear()


def forward() -> None:
    ddp = _STATE["ddp"]
    for p in ddp.parameters():
        p.grad = None
    _STATE["loss"] = ddp(_STATE["x"]).square().mean()


def backward() -> None:
    _STATE["loss"].backward()


def hook_ns() -> list[int]:
    return list(_STATE.get("hook_ns", []))


def teardown() -> None:
    state = _STATE.get("state")
    if state is not None:
        state.close()
    _STATE.clear()


def allreduce_setup(kind: str, numel: int) -> None:
    import hiersync
    from hiersync.collectives import HierComm

    if "comm" not in _STATE:
        _STATE["comm"] = HierComm(hiersync.Topology.detect().build_groups())
    _STATE["tensor"] = torch.ones(numel)
    allreduce(kind)


def allreduce(kind: str) -> None:
    x = _STATE["tensor"]
    if kind == "two_level":
        wait(_STATE["comm"].allreduce(x))
    elif kind == "flat":
        wait(_STATE["comm"].flat_allreduce(x))
    else:
        raise ValueError(f"kind={kind!r} is not known; use two_level or flat")


FUNCTIONS = {f.__name__: f for f in (ddp_setup, forward, backward, hook_ns, teardown, allreduce_setup, allreduce)}


# ---------------------------------------------------------------- the world
class PeerWorld:
    """Rank 0 = this process, ranks 1.. = helper processes; a context manager."""

    def __init__(self, world_size: int, node_ids: Sequence[int] | None = None, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        if node_ids is not None and len(node_ids) != world_size:
            raise ValueError(f"node_ids={list(node_ids)} needs {world_size} entries")
        self.world_size = world_size
        self.node_ids = list(node_ids) if node_ids is not None else [0] * world_size
        self.timeout = timeout
        self.helpers: list[Any] = []
        self.conns: list[Any] = []
        self._tmp = ""
        self._env_before: str | None = None
        self._threads_before = torch.get_num_threads()

    def __enter__(self) -> PeerWorld:
        if dist.is_initialized():
            raise RuntimeError("a default process group already exists in this process")
        self._tmp = tempfile.mkdtemp(prefix="hiersync-peers-")
        store = os.path.join(self._tmp, "store")
        ids = ",".join(map(str, self.node_ids))
        self._env_before = os.environ.get("HIERSYNC_NODE_IDS")
        os.environ["HIERSYNC_NODE_IDS"] = ids
        from hiersync.tools.launch import forkserver_context

        ctx = forkserver_context()
        try:
            for rank in range(1, self.world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_helper,
                    args=(store, rank, self.world_size, self.timeout, ids, child),
                    name=f"peer-rank{rank}",
                    daemon=True,
                )
                p.start()
                child.close()
                self.helpers.append(p)
                self.conns.append(parent)
            torch.set_num_threads(1)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(store, self.world_size),
                rank=0,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
        except BaseException:
            self._kill()
            raise
        return self

    def call(self, name: str, *args: Any) -> Any:
        """Run ``FUNCTIONS[name](*args)`` on every rank; return rank 0's result."""
        for p, conn in zip(self.helpers, self.conns):
            if p.exitcode is not None:
                raise RuntimeError(f"helper {p.name} died (exit code {p.exitcode}); see its traceback above")
            conn.send((name, args))
        return FUNCTIONS[name](*args)

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                self.call("teardown")
                for conn in self.conns:
                    conn.send(("exit", ()))
                dist.barrier()
            dist.destroy_process_group()
        finally:
            self._kill()

    def _kill(self) -> None:
        for p in self.helpers:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(10)
        for conn in self.conns:
            conn.close()
        self.helpers, self.conns = [], []
        torch.set_num_threads(self._threads_before)
        if self._env_before is None:
            os.environ.pop("HIERSYNC_NODE_IDS", None)
        else:
            os.environ["HIERSYNC_NODE_IDS"] = self._env_before
        shutil.rmtree(self._tmp, ignore_errors=True)


def _helper(store: str, rank: int, world_size: int, timeout: float, node_ids: str, conn: Any) -> None:
    os.environ["HIERSYNC_NODE_IDS"] = node_ids
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    code = 0
    try:
        while True:
            if not conn.poll(timeout):
                raise TimeoutError(f"rank {rank}: no command from rank 0 for {timeout} s")
            name, args = conn.recv()  # EOFError when rank 0 went away
            if name == "exit":
                dist.barrier()
                break
            FUNCTIONS[name](*args)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)  # skip gloo's teardown, which can hang once a peer has left

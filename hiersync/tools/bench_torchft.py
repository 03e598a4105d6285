"""torchft's LocalSGD, DiLoCo and Streaming DiLoCo as bench rows, deployed the way torchft documents.

torchft (``pip install 'hiersync[peers]'``) is what a user would pick instead of hiersync for
local SGD across nodes. Its deployment, as in its examples and ``DESIGN``: a Lighthouse on a
stable host; one *replica group* per node, each with its own store and a ``torchft.Manager``
per rank (synchronous quorum, which its DiLoCo requires; ``min_replica_size`` = every node, as
DDP's world is); DDP over the node's own ranks inside the replica group; and torchft's
``ProcessGroupGloo`` across nodes, between the ranks of the same local rank. Every rank
all-reduces its whole share of the model there: with L ranks per node each node sends L times
what hiersync's rail-sharded average sends.

The bench starts a Lighthouse process for each torchft row (rank 0 starts it, in node 0's
network namespace on the testbed, and stops it when the row ends; it is killed with its
parent, so a failed or interrupted run leaves none behind) and builds the algorithm with
:func:`attach`. :func:`refusal` asks torchft's own ``DiLoCo`` constructor whether it accepts a
configuration, and :func:`describe` says which options each row uses and why.

Example::

    >>> row = attach("diloco", 4, 2, 1, model, optimizer, intra_group, nodes)   # every rank
    >>> ...train: the algorithm syncs from optimizer.step()...
    >>> row.close()
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench_spec import OUTER, ScheduleSpec, torchft_accepts, torchft_streaming_choice

__all__ = [
    "require_torchft",
    "Lighthouse",
    "refusal",
    "accepted",
    "split_fragments",
    "attach",
    "TorchftRow",
    "describe",
]

logger = logging.getLogger(__name__)

EXTRA = "pip install 'hiersync[peers]' (torchft)"


def require_torchft() -> Any:
    """``import torchft``, or an ImportError that names the extra to install."""
    # torchft's Rust half logs every quorum and commit at INFO on stderr unless told otherwise.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as e:
        raise ImportError(f"the torchft rows need torchft: {EXTRA}") from e
    return torchft


# ---------------------------------------------------------------------------- the Lighthouse
# Started through this shim so that the Lighthouse dies with the process that started it
# (prctl PR_SET_PDEATHSIG = SIGKILL, kept across exec) even when that process is killed.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
_LISTENING = re.compile(r"listening on: http://\S+?:(\d+)")


class Lighthouse:
    """A ``torchft_lighthouse`` process bound to ``host`` on a port the OS picks; a context manager.

    ``min_replicas``: replica groups a quorum needs. :attr:`address` is what every Manager is
    given. :meth:`close` stops it (SIGTERM, then SIGKILL); it also dies with this process.
    """

    def __init__(self, host: str, min_replicas: int, start_timeout: float = 20.0) -> None:
        binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
        if not Path(binary).exists():
            raise ImportError(f"torchft_lighthouse was not found next to {sys.executable} nor on PATH: {EXTRA}")
        self._dir = tempfile.mkdtemp(prefix="hiersync-lighthouse-")
        self.log_path = Path(self._dir) / "lighthouse.log"
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), binary]
        cmd += ["--min_replicas", str(min_replicas), "--bind", f"{host}:0"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "RUST_LOG": "info"},
            )
        deadline = time.monotonic() + start_timeout
        while True:
            m = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if m:
                self.address = f"http://{host}:{m.group(1)}"
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log_path.read_text(errors="replace")[-2000:]
                self.close()
                raise RuntimeError(
                    f"torchft_lighthouse did not start on {host} (exit code {self.proc.returncode}): {text}"
                )
            time.sleep(0.02)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------- what torchft accepts
def refusal(period: int, fragments: int, delay: int) -> str | None:
    """torchft's own reason to refuse ``DiLoCo(sync_every=period, fragments, fragment_sync_delay=delay)``.

    Builds torchft's ``DiLoCo`` over a mocked Manager and ``fragments`` tiny layers (no process
    group, milliseconds) and returns its ValueError's message, or None when it accepts.
    """
    from unittest import mock

    import torch

    torchft = require_torchft()
    from torchft.local_sgd import DiLoCo

    manager = mock.create_autospec(torchft.Manager, instance=True)
    manager._use_async_quorum = False
    layers = [torch.nn.Linear(1, 1) for _ in range(fragments)]
    params = [p for layer in layers for p in layer.parameters()]
    inner, outer = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(params, lr=0.7)
    try:
        DiLoCo(manager, layers, inner, outer, sync_every=period, fragment_sync_delay=delay)
    except ValueError as e:
        return str(e)
    return None


def accepted(period: int) -> list[tuple[int, int]]:
    """Every ``(fragments, fragment_sync_delay)`` torchft's DiLoCo accepts at ``sync_every=period``."""
    return [(f, d) for f in range(1, period + 1) for d in range(period) if refusal(period, f, d) is None]


def split_fragments(model: Any, fragments: int) -> list[Any]:
    """``model``'s layers in ``fragments`` consecutive groups of about equal bytes, each an nn.Module.

    torchft's DiLoCo takes its fragments as modules and reads their ``named_parameters()``.
    The units are the modules that own parameters themselves (a Linear's weight and bias stay
    together; a parameter the root owns is a unit of its own); each fragment is a module that
    holds the model's own Parameter objects (shared, not copied), whatever the module tree.
    """
    import torch

    units = [[p for p in m.parameters(recurse=False) if p.requires_grad] for m in model.modules()]
    units = [u for u in units if u]
    if not 1 <= fragments <= len(units):
        raise ValueError(f"fragments={fragments} must be in 1..{len(units)} (the model's layers with parameters)")
    sizes = [sum(p.numel() for p in u) for u in units]
    total = sum(sizes)
    groups: list[list[Any]] = []
    current: list[Any] = []
    seen = 0
    for i, (unit, n) in enumerate(zip(units, sizes)):
        later = fragments - len(groups) - 1  # groups to open after the current one
        # start the next group where this unit's middle passes the current group's share, or
        # where the units left are just enough to give every later group one
        if current and later > 0 and (seen + n / 2 > total * (len(groups) + 1) / fragments or len(units) - i == later):
            groups.append(current)
            current = []
        current += unit
        seen += n
    groups.append(current)
    out = []
    for group in groups:
        holder = torch.nn.Module()
        for j, param in enumerate(group):
            holder.register_parameter(f"p{j}", param)
        out.append(holder)
    return out


# ---------------------------------------------------------------------------- one row
class TorchftRow:
    """The torchft objects of one row on this rank; :meth:`close` releases them (collective)."""

    def __init__(self, algorithm: Any, manager: Any, pg: Any, store: Any, lighthouse: Lighthouse | None) -> None:
        self.algorithm = algorithm
        self.manager = manager
        self.pg = pg
        self.store = store  # the replica group's TCPStore (its leader hosts it): alive as long as the Manager
        self.lighthouse = lighthouse

    def drain(self) -> None:
        """Wait for a fragment's all-reduce still in flight (Streaming DiLoCo); it is applied as usual."""
        for fragment in getattr(self.algorithm, "_fragments", []):
            for work in fragment._allreduce_work:
                work.wait()

    def close(self) -> None:
        import torch.distributed as dist

        try:
            self.drain()  # a fragment still in flight lands before teardown
            self.algorithm.__exit__(None, None, None)
            dist.barrier()  # every rank is done with the quorum and the Manager servers
            self.manager.shutdown(wait=False)
            self.pg.shutdown()
        finally:
            if self.lighthouse is not None:
                self.lighthouse.close()


def attach(
    algorithm: str,
    period: int,
    fragments: int,
    delay: int,
    model: Any,
    optimizer: Any,
    intra_group: Any,
    nodes: Sequence[Sequence[int]],
    *,
    outer: dict[str, float] | None = None,
    timeout_s: float = 120.0,
) -> TorchftRow:
    """Build torchft's ``algorithm`` (``"localsgd"`` or ``"diloco"``) over ``model`` on every rank.

    ``model`` is the module DDP wraps (DDP over ``intra_group``, the node's ranks), ``optimizer``
    its inner optimizer; ``outer``: DiLoCo's outer SGD (``lr``, ``momentum``, Nesterov when
    momentum > 0; default :data:`OUTER`). Collective over the world: rank 0 starts the
    Lighthouse, each node's first rank hosts its replica group's store.
    """
    import torch
    import torch.distributed as dist

    torchft = require_torchft()
    from torchft.local_sgd import DiLoCo, LocalSGD

    rank = dist.get_rank()
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    leader, local, size = nodes[node][0], list(nodes[node]).index(rank), len(nodes[node])
    host = os.environ.get("HIERSYNC_TESTBED_ADDR", "127.0.0.1")  # this node's address on the testbed
    lighthouse = Lighthouse(host, min_replicas=len(nodes)) if rank == 0 else None
    try:
        address = [lighthouse.address if lighthouse else None]
        dist.broadcast_object_list(address, src=0)
        store = None
        where: list[Any] = [None, None]
        if rank == leader:
            store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            where = [host, store.port]
        dist.broadcast_object_list(where, src=leader, group=intra_group)
        timeout = datetime.timedelta(seconds=timeout_s)
        pg = torchft.ProcessGroupGloo(timeout=timeout)
        manager = torchft.Manager(
            pg=pg,
            min_replica_size=len(nodes),
            use_async_quorum=False,
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
            replica_id=f"node{node}",
            store_addr=where[0],
            store_port=int(where[1]),
            rank=local,
            world_size=size,
            lighthouse_addr=address[0],
            hostname=host,
            init_sync=False,  # every rank starts from the same seeded weights, as DDP(init_sync=False) does
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        if algorithm == "localsgd":
            algo: Any = LocalSGD(manager, model, optimizer, sync_every=period)
        elif algorithm == "diloco":
            o = {"lr": OUTER["outer_lr"], "momentum": OUTER["outer_momentum"]} if outer is None else outer
            parts = [model] if fragments == 1 else split_fragments(model, fragments)
            # One outer optimizer per fragment (torchft's DiLoCo takes a list, one per fragment): a
            # fragment's sync sets .grad (its pseudo-gradient) on its own parameters only, so one
            # optimizer over the whole model would step the other fragments again with the
            # pseudo-gradients their last sync left there (the loss diverges within tens of steps).
            outer_opts = [
                torch.optim.SGD(part.parameters(), lr=o["lr"], momentum=o["momentum"], nesterov=o["momentum"] > 0)
                for part in parts
            ]
            algo = DiLoCo(manager, parts, optimizer, outer_opts, sync_every=period, fragment_sync_delay=delay)
        else:
            raise ValueError(f"algorithm={algorithm!r} is not known; use 'localsgd' or 'diloco'")
        algo.__enter__()
    except BaseException:
        if lighthouse is not None:
            lighthouse.close()
        raise
    return TorchftRow(algo, manager, pg, store, lighthouse)


# ---------------------------------------------------------------------------- what the output says
def describe(specs: Sequence[ScheduleSpec], nodes: int, ranks_per_node: int) -> list[str]:
    """Lines that say which torchft options the rows use and why (empty without torchft rows)."""
    rows = [s for s in specs if s.kind == "torchft"]
    if not rows:
        return []
    try:
        from importlib.metadata import version as dist_version

        version = dist_version("torchft")
    except ImportError:
        version = ""
    lines = [
        f"torchft rows (torchft {version or '?'}), deployed as torchft documents: a Lighthouse (started and stopped "
        "by this run) with min_replicas = every node; one replica group per node, its own store, a Manager per rank "
        "(synchronous quorum, which DiLoCo requires; init_sync off: every rank starts from the same weights); DDP "
        "over the node's ranks inside the group; torchft's ProcessGroupGloo across nodes between ranks of the same "
        f"local rank, each all-reducing the whole model ({ranks_per_node} ranks per node: {ranks_per_node}x the "
        "bytes of hiersync's rail-sharded average on every node's link)."
    ]
    for s in rows:
        k = s.period
        if s.algorithm == "localsgd":
            lines.append(
                f"  {s.name}: LocalSGD(sync_every={k}): the parameters averaged after every {k}th step, blocking"
            )
            continue
        outer = f"outer SGD lr {OUTER['outer_lr']}, momentum {OUTER['outer_momentum']}, Nesterov (torchft's examples)"
        if s.fragments == 1:
            why = ""
            if s.overlap == k - 1 and k > 1:
                why = (
                    f": the most overlap torchft accepts at sync_every={k} (the whole model's all-reduce starts "
                    f"{k - 1} steps before the step that applies it), the fastest of the configurations it "
                    f"accepts at k=4 (--peers torchft-all); with fragment_update_alpha=0 the {k - 1} local steps "
                    "taken meanwhile are dropped when it is applied"
                )
            lines.append(
                f"  {s.name}: DiLoCo(one fragment, sync_every={k}, fragment_sync_delay={s.overlap}, {outer}){why}"
            )
            continue
        why = ""
        if (s.fragments, s.overlap) == torchft_streaming_choice(k):
            why = _why_streaming(k)
        lines.append(
            f"  {s.name}: Streaming DiLoCo = DiLoCo({s.fragments} fragments of about equal bytes, sync_every={k}, "
            f"fragment_sync_delay={s.overlap}, {outer}){why}"
        )
    lines.append(
        "  left at torchft's defaults: fragment_update_alpha=0 (a synced fragment takes the global value), "
        "use_bucketization=False (one all-reduce per parameter tensor), should_quantize=False (needs triton and a GPU)"
    )
    return lines


def _why_streaming(k: int) -> str:
    """Why the chosen Streaming DiLoCo configuration: what torchft refuses and accepts at ``k``."""
    f, _ = torchft_streaming_choice(k) or (0, 0)
    text = (
        f": the most fragments torchft lets overlap a step at sync_every={k} (with fragment_update_alpha=0 the "
        "overlapped step is dropped for that fragment); its step hook keeps one fragment in flight "
        "(fragment_sync_delay < sync_every / fragments)"
    )
    if k // f > 1:
        text += f", so fragments={k} with fragment_sync_delay=1 is refused"
        try:
            text += f" (torchft: {refusal(k, k, 1)!r})"
        except ImportError:
            text += f" ({torchft_accepts(k, k, 1)})"
    try:
        text += "; at sync_every=" + f"{k} torchft accepts (fragments, delay) = "
        text += ", ".join(f"({a}, {b})" for a, b in accepted(k))
    except ImportError:
        pass
    return text

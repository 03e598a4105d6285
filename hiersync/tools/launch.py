"""Private multi-process launcher shared by the tests, the benchmarks and the CLI.

:func:`run` starts one process per rank, initializes a gloo (or NCCL) process group that
rendezvous through a ``FileStore`` in a temporary folder (no fixed ports), calls
``fn(*args)`` on every rank and returns the per-rank results. The first rank to fail
kills all the others and its traceback is re-raised here; a wall-clock limit kills every
rank; no process outlives the call, whatever happens (including Ctrl-C).

Processes are forked from a ``forkserver`` that has already imported torch, so a rank
starts in milliseconds instead of re-importing torch; ``fn`` must be importable
(a module-level function).

Example::

    >>> from hiersync.tools.launch import run
    >>> run(my_fn, world_size=4, node_ids=[0, 0, 1, 1], timeout=60)
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["run", "run_all", "Outcome", "RankFailed", "forkserver_context"]

_CTX: Any = None


def forkserver_context() -> Any:
    """The ``forkserver`` multiprocessing context every rank is started from (torch preloaded).

    One per process, created on first use; helpers that start their own rank processes
    (e.g. ``benchmarks/_peers.py``) use it too, so they share the warm forkserver.
    """
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        # DDP's constructor imports torch._dynamo (~2 s per rank on a slow CPU): load it once.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "hiersync"])
        _CTX = ctx
    return _CTX


class RankFailed(RuntimeError):
    """A rank raised or died; ``rank`` and ``child_traceback`` say which and why."""

    def __init__(self, rank: int, message: str, child_traceback: str = "") -> None:
        super().__init__(
            f"rank {rank} {message}"
            + (f"\n--- traceback of rank {rank} ---\n{child_traceback}" if child_traceback else "")
        )
        self.rank = rank
        self.child_traceback = child_traceback


@dataclass
class Outcome:
    rank: int
    exitcode: int | None
    """Process exit code; negative = killed by that signal; None = still running at the limit."""
    result: Any = None
    error: str | None = None
    """The rank's traceback if it raised."""
    elapsed_s: float = 0.0
    """Seconds from start until this rank exited."""
    pid: int | None = None
    failed_at: float | None = None
    """Wall-clock time at which the rank raised, if it did."""


def _child(
    fn: Callable,
    rank: int,
    world_size: int,
    tmpdir: str,
    env: dict,
    args: tuple,
    pg_timeout: float,
    backend: str,
    threads: int,
) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    code = 0
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        result = fn(*args)
        with open(os.path.join(tmpdir, f"result-{rank}.tmp"), "wb") as f:
            pickle.dump(result, f)
        os.replace(os.path.join(tmpdir, f"result-{rank}.tmp"), os.path.join(tmpdir, f"result-{rank}"))
        # A rank must not exit while a peer is still connecting to it (gloo builds its
        # full mesh lazily): leave together.
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        failed_at = time.time()  # lets the parent tell the root cause from its consequences
        # tmp + rename: a rank killed while writing leaves no half-written report
        with open(os.path.join(tmpdir, f"error-{rank}.tmp"), "w") as f:
            f.write(f"{failed_at!r}\n{traceback.format_exc()}")
        os.replace(os.path.join(tmpdir, f"error-{rank}.tmp"), os.path.join(tmpdir, f"error-{rank}"))
        code = 1
    # Skip interpreter teardown: gloo's threads and a dead peer can make a graceful
    # destroy_process_group() hang; the parent only needs the result files.
    os._exit(code)


def _stopped(pid: int | None) -> bool:
    """Whether ``pid`` is stopped by a signal (Linux /proc; False where unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def run_all(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    node_ids: Sequence[int] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    backend: str = "gloo",
    threads: int = 1,
    fail_fast: bool = True,
) -> list[Outcome]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return every rank's :class:`Outcome`.

    With ``fail_fast`` the first failing rank kills the others (killed while still running:
    their ``exitcode`` is None, as for ranks still running at ``timeout``). Without it every
    rank runs until it exits or ``timeout`` passes (used by tests that kill a rank on purpose
    and check how the survivors fail).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    env = dict(env or {})
    # The forkserver keeps the environment it started with: pass the emulation switch
    # (hiersync.emulation) explicitly, so that the ranks follow the parent's setting now.
    env.setdefault("HIERSYNC_EMULATE_NCCL", os.environ.get("HIERSYNC_EMULATE_NCCL", ""))
    if node_ids is not None:
        if len(node_ids) != world_size:
            raise ValueError(f"node_ids has {len(node_ids)} entries for world_size {world_size}")
        env["HIERSYNC_NODE_IDS"] = ",".join(str(i) for i in node_ids)
    ctx = forkserver_context()
    tmpdir = tempfile.mkdtemp(prefix="hiersync-")
    procs = []
    start = time.monotonic()
    ended: dict[int, float] = {}
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, tmpdir, env, tuple(args), pg_timeout, backend, threads),
                name=f"hiersync-rank{rank}",
            )
            p.start()
            procs.append(p)
        failed = False
        while True:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in ended and p.exitcode is not None:
                    ended[r] = now - start
                    failed = failed or p.exitcode != 0
            if len(ended) == world_size or (fail_fast and failed) or now - start > timeout:
                break
            # Ranks frozen on purpose (SIGSTOP) never exit: once every other rank has, stop
            # waiting for them (they are killed below and reported with exitcode None).
            alive = [p for r, p in enumerate(procs) if r not in ended]
            if ended and all(_stopped(p.pid) for p in alive):
                break
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join(10)
        outcomes = []
        for r, p in enumerate(procs):
            out = Outcome(
                rank=r,
                exitcode=p.exitcode if r in ended else None,
                pid=p.pid,
                elapsed_s=ended.get(r, time.monotonic() - start),
            )
            try:
                with open(os.path.join(tmpdir, f"result-{r}"), "rb") as f:
                    out.result = pickle.load(f)
            except FileNotFoundError:
                pass
            try:
                with open(os.path.join(tmpdir, f"error-{r}")) as f:
                    stamp, _, out.error = f.read().partition("\n")
                out.failed_at = float(stamp)
            except FileNotFoundError:
                pass
            outcomes.append(out)
        shutil.rmtree(tmpdir, ignore_errors=True)
    return outcomes


def run(fn: Callable, world_size: int, args: Sequence[Any] = (), **kwargs: Any) -> list[Any]:
    """Run ``fn(*args)`` on every rank; return the results, or raise the first failure.

    Raises :class:`RankFailed` with the child's traceback when a rank raises or dies, and
    ``TimeoutError`` when ranks are still running after ``timeout`` seconds (all killed).
    """
    outcomes = run_all(fn, world_size, args, fail_fast=True, **kwargs)
    # The rank that raised first is the root cause; later errors are usually its peers
    # noticing that it is gone.
    errors = [o for o in outcomes if o.error]
    codes = ", ".join(f"rank {o.rank}: {o.exitcode}" for o in outcomes)
    if errors:
        first = min(errors, key=lambda o: o.failed_at or 0.0)
        raise RankFailed(first.rank, f"raised (exit codes {codes})", first.error or "")
    dead = [o for o in outcomes if o.exitcode not in (0, None)]
    if dead:
        o = dead[0]
        sig = -o.exitcode if o.exitcode and o.exitcode < 0 else None
        how = f"was killed by {signal.Signals(sig).name}" if sig else f"exited with code {o.exitcode}"
        raise RankFailed(o.rank, f"{how} (exit codes {codes})")
    hung = [o.rank for o in outcomes if o.exitcode is None]
    if hung:
        raise TimeoutError(
            f"ranks {hung} were still running after {kwargs.get('timeout', 120.0)} s and were killed "
            "(a hang, or raise the timeout)"
        )
    return [o.result for o in outcomes]

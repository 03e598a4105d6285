"""Shared helpers for the multi-process tests (imported by name: not a conftest.py,
which would clash with benchmarks/conftest.py when pytest collects both folders).

Every multi-process test goes through hiersync.tools.launch.run: FileStore rendezvous (no
ports), a process-group timeout, a wall-clock limit, and all ranks killed on the first
failure. Keep worlds <= 4 (6 at most) and models tiny: the machine has two cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Sequence

import pytest
import torch.distributed as dist

from hiersync.tools.launch import run

# Topologies every distributed behaviour is checked on (one node id per global rank).
TOPOLOGIES = {
    "1x2": [0, 0],
    "2x1": [0, 1],
    "2x2": [0, 0, 1, 1],
    "noncontiguous": [0, 1, 0, 1],
    "uneven": [0, 0, 0, 1],
}

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def launch(fn, node_ids, *args, timeout: float = 120.0, pg_timeout: float = 60.0, **kw):
    """Run ``fn(*args)`` on ``len(node_ids)`` ranks emulating ``node_ids``; return rank results."""
    return run(fn, len(node_ids), args, node_ids=node_ids, timeout=timeout, pg_timeout=pg_timeout, **kw)


def torchrun(args: Sequence[str], nproc: int, env: dict[str, str], timeout: float, what: str, cwd=None) -> str:
    """``torchrun --standalone --nproc-per-node nproc *args`` on loopback, its output; the test
    fails unless it exits 0 within ``timeout`` seconds (then its whole process tree is killed:
    it runs in a session of its own)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-3000:]}"
    return out


@pytest.fixture
def world1(tmp_path, monkeypatch):
    """A one-rank gloo world in the test process itself (no extra processes)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("HIERSYNC_NODE_IDS", raising=False)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# The emulated twins run under `pytest -m slow` (CI) and `pytest -m nccl_emulation`, not by default.
@pytest.fixture(params=["as_is", pytest.param("emulated_nccl", marks=[pytest.mark.nccl_emulation, pytest.mark.slow])])
def nccl_mode(request, monkeypatch):
    """Run a test as it is and again under emulated NCCL completion (hiersync.emulation).

    Use it as ``pytestmark = pytest.mark.usefixtures("nccl_mode")``; the ranks inherit the
    switch (``_launch.run_all`` passes ``HIERSYNC_EMULATE_NCCL`` on). ``pytest -m
    nccl_emulation`` runs only the emulated variants.
    """
    if request.param == "emulated_nccl":
        monkeypatch.setenv("HIERSYNC_EMULATE_NCCL", "1")
    return request.param


def assert_checkpoint_resumes_exactly(cfg: dict, folder: str, n: int, node_ids=TOPOLOGIES["2x2"]) -> None:
    """2n steps straight == n steps, save, new processes, load, n more steps: bit for bit."""
    import ranks

    straight = launch(ranks.checkpoint_run, node_ids, cfg, "straight", folder, n)
    launch(ranks.checkpoint_run, node_ids, cfg, "first", folder, n)
    resumed = launch(ranks.checkpoint_run, node_ids, cfg, "resume", folder, n)
    for r in range(len(node_ids)):
        assert resumed[r] == straight[r], f"rank {r} diverged after resume"

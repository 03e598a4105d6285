"""The end of a job with cross-node syncs in flight (streaming, overlap 1): ``close()`` and an
interpreter exit without it must leave the job's own collectives working and every rank exiting 0.

2 emulated nodes x 2 ranks on loopback; the last step's sync is still in flight at the end, and
one rank reaches it late, as ranks of a real job do.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ranks
from harness import TOPOLOGIES, launch, torchrun

TESTS = Path(__file__).resolve().parent  # the job imports ranks from here


@pytest.mark.parametrize("drain", [False, True], ids=["dropped", "drained"])
def test_close_with_a_sync_in_flight_leaves_the_jobs_collectives_working(drain):
    """close() ends the collectives of the syncs in flight before it destroys its groups: a rank
    that destroys them first leaves its late node peer's gather, then the job's next world
    collective, waiting until the timeout."""
    res = launch(ranks.close_in_flight, TOPOLOGIES["2x2"], drain, timeout=90.0, pg_timeout=20.0)
    assert all(r == {"in_flight": 1, "sum": 4.0} for r in res), res


_LEFT_OPEN = """
import sys
import torch.distributed as dist
import ranks

dist.init_process_group("gloo")
ddp, state = ranks.streaming_with_a_sync_in_flight()
assert state.engine.in_flight
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
print("trained", flush=True)
"""


@pytest.mark.parametrize("end", ["destroy", pytest.param("exit", marks=pytest.mark.slow)])
def test_a_job_that_never_closes_exits_cleanly_with_a_sync_in_flight(end, tmp_path):
    """Interpreter exit with a sync in flight and the state never closed (after the job's own
    destroy_process_group(), or without it): every rank exits 0 (collectives still running at
    teardown abort the process)."""
    script = tmp_path / "left_open.py"
    script.write_text(_LEFT_OPEN)
    env = {
        "HIERSYNC_NODE_IDS": "0,0,1,1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    out = torchrun([str(script), end], 4, env, 120, "the job")
    assert out.count("trained") == 4 and "terminate called" not in out, out[-3000:]

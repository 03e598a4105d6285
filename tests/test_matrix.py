"""Every mode with every front-end over either transport, 2 nodes x 2 ranks, CPU gloo.

Cells: front-end (DDP, FSDP2) x transport (hiersync's process-group rail, torchft's) x codec
(fp32, bf16, int8, int4, topk2) x schedule (DDP's hook alone, blocking, overlapped, streaming, the
outer Nesterov step, optimizer-state averaging). Each cell runs 6 steps of AdamW on a tiny
model and a ``synchronize()``, or is refused with the error DESIGN.md names for it. Checked:

* the refused cells are exactly those: the hook alone without an optimizer on FSDP2 and
  with a Manager (both sync after ``optimizer.step()``);
* torchft's rail, nothing failing, trains every cell exactly as the process-group rail;
* FSDP2 trains every cell as DDP does (fp32/bf16 to 1e-5; int8/int4 within the codes'
  steps, topk2 within what a window moves: each front-end cuts its own blocks);
* the nodes drift apart between syncs, and ``synchronize()`` leaves every rank equal.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RUST_LOG", "error")
pytest.importorskip("torchft")

import matrix_ranks as mr
from harness import TOPOLOGIES, launch

from hiersync.quant import codec_for
from hiersync.tools.ft_nodes import Lighthouse, Nodes

REFUSED = {  # (front-end, transport, codec, schedule) -> what the error says
    **{("fsdp", t, c, "hook"): "needs the optimizer" for t in ("group", "torchft") for c in mr.CODECS},
    **{("ddp", "torchft", c, "hook"): "needs the optimizer" for c in mr.CODECS},
}
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def runs():
    """{transport: [rank results]}: each rank's {cell: trajectory or refusal}."""
    group = launch(mr.group_rail, TOPOLOGIES["2x2"], timeout=300)
    with Lighthouse(min_replicas=1) as lh, Nodes(lh.address, procs_per_node=2) as nodes:
        for n in range(2):
            nodes.start(n, mr.torchft_rail)
        out = nodes.wait([0, 1], timeout=400)
    return {"group": group, "torchft": out[0] + out[1]}


def _cells(transport: str | None = None):
    for frontend, codec, schedule in mr.cells():
        for t in (transport,) if transport else ("group", "torchft"):
            yield frontend, t, codec, schedule


def test_every_cell_runs_or_is_refused_for_a_named_reason(runs):
    for frontend, t, codec, schedule in _cells():
        name = mr.cell_name(frontend, codec, schedule)
        results = [r[name] for r in runs[t]]
        refused = REFUSED.get((frontend, t, codec, schedule))
        if refused:
            assert all(isinstance(r, str) and refused in r for r in results), (name, t, results[0])
        else:
            assert all(isinstance(r, list) and len(r) == mr.STEPS + 1 for r in results), (name, t, results[0])


def test_torchft_rail_trains_as_the_group_rail(runs):
    for frontend, _, codec, schedule in _cells("torchft"):
        name = mr.cell_name(frontend, codec, schedule)
        for rank, (ft, pg) in enumerate(zip(runs["torchft"], runs["group"])):
            if isinstance(pg[name], str) or isinstance(ft[name], str):
                continue
            for s, (a, b) in enumerate(zip(ft[name], pg[name])):
                torch.testing.assert_close(
                    a, b, **TOL, msg=lambda m, s=s, r=rank, c=name: f"{c} rank {r} step {s}: {m}"
                )


def test_fsdp_trains_as_ddp(runs):
    for t in ("group", "torchft"):
        for codec in mr.CODECS:
            for schedule in mr.SCHEDULES:
                ddp, fsdp = mr.cell_name("ddp", codec, schedule), mr.cell_name("fsdp", codec, schedule)
                for r in runs[t]:
                    if isinstance(r[fsdp], str) or isinstance(r[ddp], str):
                        continue
                    a, b = torch.stack(r[fsdp]), torch.stack(r[ddp])
                    moved = float((b[1:] - b[:-1]).abs().max())
                    if codec in ("int8", "int4"):  # a few code steps of what a window moves
                        bound = 8 * moved * (mr.SCHEDULES[schedule]["period"]) / codec_for(codec).qmax + 1e-6
                        assert float((a - b).abs().max()) <= bound, (t, fsdp, float((a - b).abs().max()), bound)
                    elif codec == "topk2":  # what a window moves: each front-end sends its own largest values
                        bound = 2 * moved * mr.SCHEDULES[schedule]["period"]
                        assert float((a - b).abs().max()) <= bound, (t, fsdp, float((a - b).abs().max()), bound)
                    else:
                        torch.testing.assert_close(a, b, **TOL, msg=lambda m, c=fsdp, t=t: f"{t} {c}: {m}")


def test_nodes_drift_and_synchronize_makes_every_rank_equal(runs):
    for frontend, t, codec, schedule in _cells():
        name = mr.cell_name(frontend, codec, schedule)
        results = [r[name] for r in runs[t]]
        if isinstance(results[0], str):
            continue
        finals = [r[-1] for r in results]
        assert all(torch.equal(f, finals[0]) for f in finals), (t, name)
        first_step = [r[0] for r in results]  # period >= 2: step 0 is local; nodes 0 and 1 differ
        assert not torch.equal(first_step[0], first_step[2]), (t, name)

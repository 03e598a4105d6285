"""Time to loss: the example LM on the emulated 2 x 2 testbed, DDP vs hiersync vs post-local SGD and torchft.

Trains examples/lm_torchrun.py's model (a byte-level GPT on the Python standard library,
examples/_lm.py; peak lr ``LR`` = 1e-3 unless ``--lr`` is given, a third of the example's:
see "Seeds" below) under ``python -m hiersync testbed --nodes 2 --procs-per-node 2`` with
every schedule on the same initial weights, the same per-rank batches and the same lr
schedule; only the synchronization differs (the default run: ``ddp``,
``hiersync_k4_stream``, ``hiersync_k4_stream_expavg``):

* ``ddp``: DDP's all-reduce every step (no hook), the reference.
* ``postlocal_k4``: PyTorch's post-local SGD (``post_localSGD_hook`` on intra-node
  subgroups + ``PeriodicModelAverager(period=4)``).
* ``hiersync_k4``: ``hiersync.register(ddp, opt, period=4)`` (blocking sync after the step).
* ``hiersync_k4_stream``: ``period=4, fragments=4, overlap=1`` (streaming).
* ``hiersync_k2_stream``: ``period=2, fragments=2, overlap=1`` (streaming at k=2: each step
  syncs half the model, hidden behind the next step).
* ``hiersync_k4_stream_expavg``: k=4 streaming with ``average_optimizer_state=("exp_avg",)``
  (AdamW's first moment averaged across nodes with each fragment's parameters);
  ``hiersync_k4_stream_adam``: both moments, ``("exp_avg", "exp_avg_sq")``.

With ``--peers torchft`` (``pip install 'hiersync[peers]'``), torchft's rows beside them, built as
the bench builds them (:mod:`hiersync.tools.bench_torchft`: a Lighthouse, one replica group
per node, DDP over the node's ranks inside it), on the same data and seeds:

* ``torchft_diloco_k4``: ``DiLoCo(sync_every=4)``, the whole model as one fragment;
* ``torchft_diloco_k4_d3`` (not in ``--peers torchft``: pass it in ``--schedules``): the same
  with ``fragment_sync_delay=3``, the fastest configuration torchft accepts at ``sync_every=4``
  in the bench (its all-reduce starts 3 steps before the step that applies it; the 3 local
  steps taken meanwhile are dropped then);
* ``torchft_streaming_k4``: Streaming DiLoCo, ``DiLoCo`` with 2 fragments and
  ``fragment_sync_delay=1`` (torchft refuses 4 fragments with a delay at ``sync_every=4``: it
  keeps one fragment in flight).

Both use an outer SGD step of lr 1 without momentum, which makes DiLoCo's outer step plain
parameter averaging, as in the hiersync rows beside them (``torchft_diloco_k4_nesterov``, not
in the default run: torchft's example outer optimizer, lr 0.7, Nesterov momentum 0.9).

Every ``--eval-every`` steps the ranks stop the clock, evaluate the validation loss of the
world-mean parameters (computed aside: the trajectory is not touched) and start it again;
the final value is measured after ``state.synchronize`` (post-local SGD: a parameter
all-reduce), included in the wall-clock. DDP runs ``--steps`` steps; the other schedules
run ``--max-steps-factor`` x as many (the lr held at its floor after ``--steps``), or, with
``--budget B``, an lr schedule sized to B x ``--steps`` that ends there, as a run planned for
a step budget would: the report then compares each schedule's final loss with DDP's, seed
by seed, with a 90% bootstrap interval over seeds.

**Seeds, and what decides the verdict.** At the example's peak lr (3e-3) this 300-step run
is chaotic: DDP's own final loss spreads over 0.4 across eight seeds, and one seed's gap
between a k=4 schedule and DDP swings by +-0.12, more than the effect being measured. At
1e-3 both spread over about 0.03, so a few seeds decide what eight could not. Every schedule
runs every seed of ``--seeds`` (initial weights and batches), and the report reads its mean
curve over seeds: the target is DDP's mean final val loss, steps and wall-clock to it are
where the schedule's mean curve comes down to it (linear interpolation between evaluations),
with a 90% bootstrap interval over seeds (DDP's and the schedule's seeds resampled
together). ``--goal G`` (default 1.05) prints, per schedule, PASS when the whole interval of
steps-to-DDP's-loss is at or below G x DDP's steps, FAIL when it is above, UNDECIDED when it
spans G.

Steps to a loss do not depend on the link, so the steps figure comes from a loss-only run
with many seeds on the plain loopback (``--inter-rate none``: no probes, no shaping), and
the wall-clock from fewer seeds on the shaped link, ``--steps-from`` the loss-only run's
JSON (or several, on the same seeds and DDP: one per ``--max-steps-factor``): wall-clock to
DDP's loss = steps to it (many seeds) x s/step (this link). A warm-up row (``_w<W>``) is timed
by its two phases: its first W steps at ``hiersync_k1``'s s/step (exact sync, what a warm-up
step does) and the rest at its steady twin's (the name without ``_w<W>``); the run times those
rows instead of the warm-up row itself.

**Link rate.** A 2-core CPU box computes this model in a few hundred ms per step, so the
800 Mbit default link would make communication a small share of DDP's step: nothing like a
large model on a real cluster. The run first asks the planner (``python -m hiersync plan``,
``--plan-args``: by default a 7B model on 16 x 8 A100, one 100 Gb NIC per node,
``--preset a100-1nic``, forward 400 ms and backward 800 ms per step) what fraction of DDP's
step is exposed communication there, then measures this model's step without
communication (a no-op hook) and with DDP at ``--inter-rate``, prints the measured
fraction beside the planner's and the rate that would match it (communication time scales
as 1/rate). The default ``--inter-rate`` was picked that way on this machine
(docs/time-to-loss.md).

    python benchmarks/time_to_loss.py --inter-rate none --seeds 0-2 --out results/ttl_steps
    sudo python benchmarks/time_to_loss.py --seeds 0 --peers torchft \
        --steps-from results/ttl_steps/time_to_loss.json --plot docs/img/time_to_loss.png

Writes ``time_to_loss.json`` (curves, table, planner output, measured fractions) and a
loss-vs-wall-clock PNG to ``--out`` (default results/time_to_loss). Needs root for the
shaped link (else plain loopback, which it says).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import _lm  # noqa: E402
from _ttl_stats import (  # noqa: E402
    combine_steps,
    combined_table,
    final_gap,
    plot,
    summarize,
    table,
    timed_schedules,
    verdict,
)
from _ttl_worker import GRAMMAR, SCHEDULES, TORCHFT, hiersync_options, worker  # noqa: E402

__all__ = ["main", "loss_runs", "worker", "SCHEDULES", "summarize", "table", "final_gap", "verdict"]

DEFAULT_SCHEDULES = ["ddp", "hiersync_k4_stream", "hiersync_k4_stream_expavg"]
PEER_SCHEDULES = {"torchft": ["torchft_diloco_k4", "torchft_streaming_k4"]}
# The example's peak lr (3e-3) makes this short run chaotic: two schedules on one seed end apart by
# more than the effect measured (docs/time-to-loss.md). A third of it is the benchmark's default.
LR = 1e-3
ROW_KEYS = ("period", "fragments", "overlap", "warmup_steps")
PLAN_ARGS = "--preset a100-1nic --params 7e9 --nodes 16 --gpus-per-node 8 --forward-ms 400 --backward-ms 800"


def _schedule(name: str) -> str:
    if name in SCHEDULES or hiersync_options(name) is not None:
        return name
    raise argparse.ArgumentTypeError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)} or {GRAMMAR}")


# ---------------------------------------------------------------- driver
def _run_testbed(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run one testbed launch; if this process is interrupted, stop it with SIGTERM first.

    The testbed's SIGTERM handler stops its torchrun agents and ranks and removes the
    namespaces; rank 0's torchft Lighthouse dies with rank 0. A SIGKILL (what
    ``subprocess.run`` sends on an exception) would leave all of them behind.
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


def _launch(a: argparse.Namespace, schedule: str, max_steps: int, seed: int, schedule_steps: int | None = None) -> dict:
    """One testbed run of ``schedule``; its lr schedule spans ``schedule_steps`` (default ``--steps``)."""
    what = ["--schedule", schedule, "--steps", str(schedule_steps or a.steps), "--max-steps", str(max_steps)]
    what += ["--eval-every", str(a.eval_every), "--seed", str(seed), *a.lm_args]
    cached = None
    if a.cache:  # one file per run: the same run (rate, schedule, steps, seed, LM flags) is not run twice
        key = hashlib.sha256(json.dumps([a.inter_rate, *what]).encode()).hexdigest()[:16]
        cached = Path(a.cache) / f"{schedule}-seed{seed}-{key}.json"
        if cached.exists():
            result = json.loads(cached.read_text())
            print(f"  seed {seed} {schedule:20s} (from {cached})", flush=True)
            if a.inter_rate == "none" and result["link"].startswith("tbf"):
                result["link"] = "testbed namespaces, link not shaped"
            return result
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "hiersync", "testbed", "--nodes", "2", "--procs-per-node", "2"]
        cmd += ["--inter-rate", a.inter_rate, "--timeout", str(a.timeout), "--log-dir", tmp]
        cmd += ["--", str(Path(__file__).resolve()), "--worker", "--out", str(out), *what]
        t0 = time.perf_counter()
        proc = _run_testbed(cmd)
        if proc.returncode != 0 or not out.exists():
            logs = "".join(p.read_text()[-4000:] for p in sorted(Path(tmp).glob("*.log")))
            raise SystemExit(f"{schedule} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}\n{logs}")
        result = json.loads(out.read_text())
        result["launch_s"] = time.perf_counter() - t0
        shaped = "network namespaces" in proc.stderr + "".join(p.read_text() for p in Path(tmp).glob("*.log"))
        result["link"] = "loopback (not shaped)" if not shaped else f"tbf {a.inter_rate}"
    if a.inter_rate == "none" and result["link"].startswith("tbf"):
        result["link"] = "testbed namespaces, link not shaped"
    result["seed"] = seed
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(result))
    print(
        f"  seed {seed} {schedule:20s} {result['steps']:5d} steps {result['wall_s']:7.1f} s"
        f"  final val {result['final_val_loss']:.4f}"
        f"  (launch {result['launch_s']:.0f} s)",
        flush=True,
    )
    return result


def plan_fraction(plan_args: str) -> dict[str, Any]:
    """DDP's exposed-communication share of the step at its best bucket size, per the planner."""
    cmd = [sys.executable, "-m", "hiersync", "plan", *plan_args.split()]
    text = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = []
    for line in text.splitlines():
        if line.startswith("ddp "):
            nums = [float(v.replace(",", "")) for v in line.split()[1:5]]
            rows.append(dict(bucket_mb=nums[0], comm_ms=nums[1], exposed_ms=nums[2], step_ms=nums[3]))
    best = min(rows, key=lambda r: r["step_ms"])
    best_hier = re.search(r"recommend: .*?step ([\d,.]+) ms, ([\d.]+)x vs best DDP", text)
    return dict(
        command="python -m hiersync plan " + plan_args,
        ddp=best,
        exposed_fraction=best["exposed_ms"] / best["step_ms"],
        recommended_step_ms=float(best_hier.group(1).replace(",", "")) if best_hier else None,
        recommended_speedup=float(best_hier.group(2)) if best_hier else None,
    )


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` or ``"0-15"`` (or a mix, ``"0-3,8"``) as a list of seeds."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds {text!r} repeats a seed")
    return seeds


def probes(a: argparse.Namespace) -> tuple[dict, dict, float]:
    """The planner's DDP exposed fraction, this model's measured one at ``--inter-rate``, the matching rate."""
    plan = plan_fraction(a.plan_args)
    print(
        f"planner ({plan['command']}): DDP's best step {plan['ddp']['step_ms']:,.0f} ms, exposed communication "
        f"{plan['ddp']['exposed_ms']:,.0f} ms = {plan['exposed_fraction']:.0%} of the step",
        flush=True,
    )
    print(f"probes on the testbed at {a.inter_rate} ({a.probe_steps} steps):", flush=True)
    probe = argparse.Namespace(**{**vars(a), "steps": a.probe_steps})
    compute = _launch(probe, "compute_only", a.probe_steps, a.seeds[0])
    ddp_probe = _launch(probe, "ddp", a.probe_steps, a.seeds[0])
    c_step, d_step = compute["wall_s"] / compute["steps"], ddp_probe["wall_s"] / ddp_probe["steps"]
    measured = max(0.0, 1 - c_step / d_step)
    f = plan["exposed_fraction"]
    number = re.match(r"[\d.]+", a.inter_rate)
    rate = float(number.group()) if number else math.nan
    unit = re.sub(r"^[\d.]+", "", a.inter_rate)
    # exposed comm scales ~ 1/rate; want exposed = f/(1-f) x compute
    match_rate = rate * (d_step - c_step) / (f / (1 - f) * c_step) if d_step > c_step else math.nan
    print(
        f"  step without communication {c_step * 1e3:.0f} ms, DDP {d_step * 1e3:.0f} ms: exposed communication "
        f"{measured:.0%} of DDP's step (planner {f:.0%}); the rate that would match: ~{match_rate:.0f}{unit}",
        flush=True,
    )
    return plan, dict(compute_s_per_step=c_step, ddp_s_per_step=d_step, exposed_fraction=measured), match_rate


def loss_runs(paths: list[str]) -> dict[str, Any]:
    """One loss-only run from one or several time_to_loss.json files on the same seeds and DDP runs.

    Steps to DDP's loss are read against DDP's mean final loss, so the files must share it (the
    same seeds, DDP steps and LM flags: e.g. two runs with different ``--max-steps-factor``);
    a schedule in several files counts from the first.
    """
    runs = [json.loads(Path(path).read_text()) for path in paths]
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:]):
        if (run["seeds"], run["target"], run["lm_args"]) != (first["seeds"], first["target"], first["lm_args"]):
            raise SystemExit(
                f"--steps-from {path}: seeds {run['seeds']}, DDP's loss {run['target']:.4f}, LM flags "
                f"{run['lm_args']} differ from {paths[0]}'s ({first['seeds']}, {first['target']:.4f}, "
                f"{first['lm_args']}): pass loss-only runs of the same seeds and DDP"
            )
    table: dict[str, dict] = {}
    for run in runs:
        for row in run["table"]:
            table.setdefault(row["schedule"], row)
    return dict(first, table=list(table.values()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # --seed is not --seeds
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="results/time_to_loss", help="folder for time_to_loss.json (+ png)")
    p.add_argument("--plot", default=None, help="PNG path (default OUT/time_to_loss.png)")
    p.add_argument("--steps", type=int, default=300, help="DDP's steps (the others: at least this many)")
    p.add_argument("--max-steps-factor", type=float, default=1.25, help="the others run this x steps")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="instead: the others train an lr schedule sized to BUDGET x --steps and stop there, and the "
        "report compares their final loss with DDP's (how a run is planned: a step budget, the schedule fit to it)",
    )
    p.add_argument(
        "--seeds",
        type=parse_seeds,
        default=[0, 1, 2],
        help="seeds (initial weights and data), e.g. 0,1,2 or 0-15; every schedule runs each (default 0,1,2)",
    )
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--inter-rate", default="50mbit", help="tbf rate of each node's egress (see the docstring)")
    p.add_argument("--probe-steps", type=int, default=30, help="steps of the compute-only and DDP probes")
    p.add_argument("--plan-args", default=PLAN_ARGS, help="the real setting whose DDP exposed fraction to match")
    p.add_argument(
        "--schedules",
        nargs="+",
        default=DEFAULT_SCHEDULES,
        type=_schedule,
        help=f"rows: {', '.join(SCHEDULES)}, or any {GRAMMAR}",
    )
    p.add_argument(
        "--peers",
        nargs="+",
        default=[],
        choices=list(PEER_SCHEDULES),
        help="add other libraries' rows: torchft (its DiLoCo and Streaming DiLoCo at k=4; "
        "pip install 'hiersync[peers]')",
    )
    p.add_argument("--goal", type=float, default=1.05, help="the verdict: steps to DDP's loss <= GOAL x DDP's")
    p.add_argument(
        "--steps-from",
        nargs="+",
        default=None,
        help="a loss-only run's time_to_loss.json (many seeds, e.g. --inter-rate none), or several on the same seeds "
        "and DDP (e.g. one per --max-steps-factor): wall-clock to DDP's loss is also given as its steps to it x this "
        "run's s/step",
    )
    p.add_argument(
        "--cache",
        default=None,
        help="keep each run's result in this folder and reuse it when the same run (link rate, schedule, steps, "
        "seed, LM flags) is asked for again: add seeds or schedules to a finished run without redoing it",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="per testbed launch, seconds")
    a, rest = p.parse_known_args(argv)
    if a.worker:
        args = _lm.parser("worker").parse_args(rest, namespace=a)
        args.max_steps = args.max_steps or args.steps
        worker(args)
        return 0
    # any examples/_lm.py flag: --batch-size, --dim, --layers, --lr, ...; the peak lr defaults to LR
    a.lm_args = rest if any(r == "--lr" or r.startswith("--lr=") for r in rest) else ["--lr", str(LR), *rest]
    for peer in a.peers:
        a.schedules = list(dict.fromkeys(a.schedules + PEER_SCHEDULES[peer]))
    if any(n in TORCHFT for n in a.schedules):
        from hiersync.tools.bench_torchft import require_torchft

        require_torchft()  # ImportError naming the extra, before any run
    if _lm.parser("check").parse_args(rest).seed != 0:
        p.error("pass seeds with --seeds (every schedule runs each), not --seed")

    signal.signal(signal.SIGTERM, _interrupted)  # a SIGTERM stops the testbed run in flight, too
    t_start = time.perf_counter()
    plan, probe_out, match_rate = probes(a) if a.inter_rate != "none" else (None, None, math.nan)

    if a.budget is not None and not a.budget >= 1:
        p.error(f"--budget={a.budget} must be >= 1 (a multiple of DDP's --steps)")
    max_steps = int(round(a.steps * a.budget)) if a.budget else int(a.steps * a.max_steps_factor)
    sized = max_steps if a.budget else a.steps  # the others' lr schedule
    how = "with their lr schedule sized to that budget" if a.budget else "the lr held at its floor after --steps"
    print(f"training, seeds {a.seeds}: DDP {a.steps} steps, the others {max_steps} ({how}):", flush=True)
    names = timed_schedules(a.schedules) if a.steps_from else a.schedules  # a warm-up row: timed by phases
    runs: dict[str, list[dict]] = {name: [] for name in ["ddp", *(n for n in names if n != "ddp")]}
    for seed in a.seeds:
        for name in runs:
            ddp = name == "ddp"
            runs[name].append(_launch(a, name, a.steps if ddp else max_steps, seed, a.steps if ddp else sized))
    target, rows = summarize(runs, a.steps)
    for row in rows:  # what the planner reads a row's period and kind from
        row.update({k: v for k, v in (hiersync_options(row["schedule"]) or {}).items() if k in ROW_KEYS})
    md = table(rows, a.steps, target, a.seeds)
    ddp_wall = rows[0]["wall_to_target"]
    print(f"\ntarget: DDP's final val loss {target:.4f} after {a.steps} steps, {ddp_wall:.1f} s\n{md}")
    for row in rows[1:]:
        print(f"steps to DDP's loss <= {a.goal:g}x DDP's, {row['schedule']}: {verdict(row, a.goal)}")
    if not a.budget:
        for row in rows[1:]:
            gap = row["final_gap"] = final_gap(runs, row["schedule"])
            print(
                f"  {row['schedule']} after {row['steps_run']} steps: final val loss minus DDP's after {a.steps}, "
                f"seed by seed, {gap['mean']:+.4f} (90% interval {gap['lo']:+.4f}..{gap['hi']:+.4f})"
            )
    combined = None
    if a.steps_from:
        loss_run = loss_runs(a.steps_from)
        ddp_steps = next(r["steps_to_target"] for r in loss_run["table"] if r["schedule"] == "ddp")
        combined = combine_steps(rows, loss_run["table"], ddp_steps)
        print(
            f"\nwall-clock to DDP's loss = steps to it from {' + '.join(a.steps_from)} "
            f"({len(loss_run['seeds'])} seeds, "
            f"{loss_run['link']}) x s/step on this link ({runs['ddp'][0]['link']}):\n"
            + combined_table(combined, len(loss_run["seeds"]))
        )
    if a.budget:
        ddp_final = sum(r["final_val_loss"] for r in runs["ddp"]) / len(runs["ddp"])
        shaped = runs["ddp"][0]["link"].startswith("tbf")
        print(f"\nwith a {a.budget:g}x step budget ({max_steps} steps, the lr schedule sized to it):")
        for row in rows[1:]:
            rs = runs[row["schedule"]]
            gap = row["budget_gap"] = final_gap(runs, row["schedule"])
            wall = sum(r["wall_s"] for r in rs) / len(rs) / ddp_wall
            row["budget_wall_x_ddp"] = wall
            said = "PASS" if gap["hi"] <= 0 else "FAIL" if gap["lo"] > 0 else "UNDECIDED (the interval spans 0)"
            clock = f", wall-clock {wall:.2f}x DDP's" if shaped else " (link not shaped: no wall-clock)"
            print(
                f"  {row['schedule']}: final val loss {row['final_val_loss']:.4f} vs DDP's {ddp_final:.4f} "
                f"({gap['mean']:+.4f}, 90% interval over seeds {gap['lo']:+.4f}..{gap['hi']:+.4f}): DDP's loss "
                f"within {a.budget:g}x its steps {said}{clock}"
            )

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    png = Path(a.plot) if a.plot else out / "time_to_loss.png"
    title = f"byte-level GPT on the stdlib, 2x2 testbed, {runs['ddp'][0]['link']}, seeds {a.seeds}"
    if plan and probe_out:
        title += (
            f"; DDP exposed comm {probe_out['exposed_fraction']:.0%} "
            f"(planner, 7B on 16x8 A100 1 NIC: {plan['exposed_fraction']:.0%})"
        )
    plot(runs, rows, target, png, title, wall=runs["ddp"][0]["link"].startswith("tbf"))
    command = "python benchmarks/time_to_loss.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "time_to_loss.json").write_text(
        json.dumps(
            dict(
                command=command.strip(),
                inter_rate=a.inter_rate,
                budget=a.budget,
                link=runs["ddp"][0]["link"],
                seeds=a.seeds,
                plan=plan,
                probe=probe_out,
                lm_args=a.lm_args,
                goal=a.goal,
                steps_from=" ".join(a.steps_from or []) or None,
                combined=combined,
                matching_rate=match_rate,
                target=target,
                table=rows,
                markdown=md,
                results=runs,
                loadavg=os.getloadavg(),
                total_s=time.perf_counter() - t_start,
            ),
            indent=1,
        )
    )
    print(f"wrote {out / 'time_to_loss.json'} and {png} ({time.perf_counter() - t_start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

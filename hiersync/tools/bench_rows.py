"""Every rank's bench results, turned into one row per (model, bucket size, compute model, schedule).

:func:`summarize` reads what :func:`hiersync.tools.bench_worker.worker` returned on each rank:
the attributed phases (barrier to barrier), the timed steps' ends, the inter-node bytes of each
timed step and the peak memory, and computes the row's numbers and its ratios against DDP and
against PyTorch's post-local SGD at the same k, always within one compute model. Pure.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from .bench_spec import NEVER

__all__ = [
    "PHASES",
    "step_durations",
    "node_bytes_per_step",
    "summarize",
    "row_key",
]

PHASES = ("data", "forward", "backward", "comm", "optimizer")


def step_durations(runs: Sequence[dict]) -> list[float]:
    """The job's unsynchronized step durations: step i ends when its last rank ends it.

    Every rank times its step ends from the same barrier, so step i lasts from the last
    rank's end of step i - 1 to the last rank's end of step i; the durations add up to
    the slowest rank's elapsed time, so their mean is the mean step time. (The largest
    per-rank duration of each step would count a rank that merely caught up after a slow
    step as a second slow step: ranks of different nodes drift apart by tens of ms.)
    """
    ends = [max(e) for e in zip(*(r["unsync_step_ends"] for r in runs))]
    return [b - a for a, b in zip([0.0] + ends[:-1], ends)]


def node_bytes_per_step(runs: Sequence[dict], nodes: Sequence[Sequence[int]]) -> tuple[float, float, str] | None:
    """The mean and the largest inter-node bytes one node sent per step, and where they come from.

    ``"link"``: counted on each node's link by its first rank (the testbed), for every method
    alike: the mean over the attributed steps (a multiple of k, from a drained link to a
    drained link, so a transfer in flight at either end is counted once), the largest over
    the timed steps' own readings; else the sum over the node's ranks of what each rank
    reported per timed step (``"counted"``: hiersync's own counters; ``"modelled"``: a ring
    model). None where a rank reported nothing (torchft off the testbed). ``runs[r]`` is rank
    r's run.
    """
    leaders = [runs[n[0]] for n in nodes]
    if all(r.get("link_tx_steps") is not None for r in leaders):
        mean = statistics.fmean(r["link_tx_per_step"] for r in leaders)
        return mean, max(b for r in leaders for b in r["link_tx_steps"]), "link"
    per_rank = [r.get("inter_bytes_steps") for r in runs]
    if any(x is None for x in per_rank):
        return None
    per_node = [b for n in nodes for b in (sum(v) for v in zip(*(per_rank[r] for r in n)))]
    sources = {r.get("inter_bytes_source") for r in runs}
    return statistics.fmean(per_node), max(per_node), "modelled" if "modelled" in sources else "counted"


def row_key(r: dict, schedule: str | None = None) -> tuple:
    """(model, bucket MB, compute model, schedule): rows of one run are compared within a key's first three."""
    return (r["model"], r["bucket_mb"], r.get("compute", "cpu"), schedule or r["schedule"])


NUMBERS = (
    "step_s",
    "step_p50_s",
    "step_p99_s",
    "step_std_s",
    "cpu_s_per_step",
    "attributed_total_s",
    *(f"{p}_s" for p in PHASES),
    "inter_mb_sent_per_step",
    "inter_mb_step_mean",
    "inter_mb_step_peak",
    "peak_mb",
    "extra_mb",
)


def summarize(rank_results: Sequence[dict]) -> list[dict]:
    """One row per (model, bucket, compute model, schedule) from every rank's :func:`worker` result.

    Phases are barrier to barrier; compute parts use the slowest rank (the critical path)
    and the rest of each interval is communication wait, so the phases add up to the
    attributed total. ``step_s`` is the unsynchronized step time of the slowest rank (the
    mean over the timed steps), ``step_p50_s``/``step_p99_s`` percentiles of the job's per-step
    durations (:func:`step_durations`; ``step_durations_s`` lists them, ";"-joined, over
    every repeat); ``inter_mb_step_mean``/``inter_mb_step_peak`` the mean and the largest
    inter-node MB one node sent per step (:func:`node_bytes_per_step`; ``inter_source``
    says how they were counted); ``peak_mb`` the largest rank's peak memory in the memory
    pass (:func:`hiersync.tools.bench_worker.memory_worker`, ``--memory``) and ``extra_mb`` the
    most any rank's peak exceeds its peak in ``compute_only``'s run of that pass (else DDP's;
    ``extra_over`` says which; the same for every compute model: it does not depend on it). FSDP2
    rows: ``extra_mb`` over FSDP2 HSDP's (:data:`FSDP_MEMORY_REFERENCES`), ``shard_mb`` the rank's own
    fp32 parameter shard, ``extra_per_shard`` their ratio, ``vs_hsdp`` the step against HSDP's. A row
    run several times (``--repeat``, a claim's rounds) has the mean of its runs' mean steps as
    ``step_s`` (``step_s_runs`` lists them, in the order they ran) and every other number the
    median over its runs. A
    schedule the installed hiersync cannot build has ``unsupported`` set and no numbers.
    """
    first = rank_results[0]
    nodes = first.get("nodes") or [[r["rank"] for r in rank_results]]
    rows: list[dict] = []
    for i, run0 in enumerate(first["runs"]):
        runs = [r["runs"][i] for r in rank_results]
        row = _empty_row(run0, runs)
        if not row["unsupported"]:
            row.update(_numbers(runs, run0, nodes))
        rows.append(row)
    merged = _merge_repeats(rows)
    _add_memory(merged, rank_results)
    _add_ratios(merged)
    return merged


MEMORY_REFERENCES = ("compute_only", "ddp")
"""What extra memory is measured over: DDP with a hook that sends nothing (the model, gradients,
buckets and optimizer every row has, and nothing else), else DDP (whose own all-reduce on gloo
holds scratch buffers: +0.8 P per rank on the 800 Mbit testbed)."""
FSDP_MEMORY_REFERENCES = ("fsdp_hsdp", "fsdp_intra_only")
"""The FSDP2 rows' extra memory is measured over FSDP2's own HSDP (the same sharded model, gradients
and optimizer), else over FSDP2 inside the node only."""


def _add_memory(rows: list[dict], rank_results: Sequence[dict]) -> None:
    """``peak_mb`` and ``extra_mb`` (over :data:`MEMORY_REFERENCES`, worst rank) from every rank's memory pass."""
    passes = [r.get("memory") for r in rank_results]
    if not passes or any(p is None for p in passes):
        return
    peaks: dict[tuple, list[float | None]] = {}
    for per_rank in passes:
        for m in per_rank:  # type: ignore[union-attr]
            peaks.setdefault((m["model"], m["bucket_mb"], m["schedule"]), []).append(m["peak_mb"])
    for row in rows:
        mine = peaks.get((row["model"], row["bucket_mb"], row["schedule"]))
        if not mine or any(x is None for x in mine):
            continue
        row["peak_mb"] = max(mine)  # type: ignore[type-var]
        refs = FSDP_MEMORY_REFERENCES if str(row["kind"]).startswith("fsdp_") else MEMORY_REFERENCES
        for reference in refs:
            ref = peaks.get((row["model"], row["bucket_mb"], reference))
            if ref and all(x is not None for x in ref):
                row["extra_mb"] = max(a - b for a, b in zip(mine, ref))  # type: ignore[operator]
                row["extra_over"] = reference
                break
        if row.get("shard_mb") and row.get("extra_mb") is not None:
            row["extra_per_shard"] = row["extra_mb"] / row["shard_mb"]


def _empty_row(run0: dict, runs: Sequence[dict]) -> dict[str, Any]:
    spec = run0["spec"]
    row: dict[str, Any] = {
        "model": run0["model"],
        "compute": run0.get("compute", "cpu"),
        "num_params": run0["num_params"],
        "grad_mb": run0["num_params"] * 4 / 1e6,
        "bucket_mb": run0["bucket_mb"],
        "schedule": run0["schedule"],
        "kind": spec["kind"],
        "period": spec["period"] if spec["period"] < NEVER else None,
        "overlap": spec["overlap"],
        "fragments": spec.get("fragments", 1),
        "compress": spec["compress"],
        "steps": run0["steps"],
        "unsupported": run0.get("unsupported"),
        "whole_sync_mb": run0["whole_sync_inter_bytes"] / 1e6 if run0.get("whole_sync_inter_bytes") else None,
        # FSDP2 rows: the fp32 bytes of a rank's own parameter shard (the largest rank's)
        "shard_mb": max(r.get("shard_bytes", 0) for r in runs) / 1e6 if run0.get("shard_bytes") else None,
    }
    row.update(dict.fromkeys(NUMBERS))
    row["inter_source"] = row["extra_over"] = row["extra_per_shard"] = None
    row["accel_asked_s"] = row["accel_slept_s"] = None
    row["step_durations_s"] = ""
    return row


def _numbers(runs: Sequence[dict], run0: dict, nodes: Sequence[Sequence[int]]) -> dict[str, Any]:
    phases = {p: 0.0 for p in PHASES}
    n = len(run0["attributed"])
    for s in range(n):
        per = [r["attributed"][s] for r in runs]
        bwd_interval = statistics.fmean(p["backward_interval"] for p in per)
        opt_interval = statistics.fmean(p["optimizer_interval"] for p in per)
        bwd = min(bwd_interval, max(p["backward_compute"] for p in per))
        optc = min(opt_interval, max(p["optimizer_compute"] for p in per))
        phases["data"] += statistics.fmean(p["data"] for p in per) / n
        phases["forward"] += statistics.fmean(p["forward"] for p in per) / n
        phases["backward"] += bwd / n
        phases["optimizer"] += optc / n
        phases["comm"] += (bwd_interval - bwd + opt_interval - optc) / n
    attributed_total = statistics.fmean(statistics.fmean(r["attributed"][s]["total"] for r in runs) for s in range(n))
    per_step = step_durations(runs)
    counted = node_bytes_per_step(runs, nodes)
    out: dict[str, Any] = {
        "step_s": max(r["unsync_elapsed"] for r in runs) / run0["steps"],
        # numpy's default (linear) rule, as every quantile of the bench and its intervals
        "step_p50_s": float(np.percentile(per_step, 50)),
        "step_p99_s": float(np.percentile(per_step, 99)),
        "step_std_s": statistics.pstdev(per_step) if len(per_step) > 1 else 0.0,
        "step_durations_s": ";".join(f"{d:.4f}" for d in per_step),
        # CPU seconds per timed step, mean over ranks (all threads: compute, gloo's transfers)
        "cpu_s_per_step": (
            statistics.fmean(r["unsync_cpu_s"] for r in runs) / run0["steps"]
            if all("unsync_cpu_s" in r for r in runs)
            else None
        ),
        "attributed_total_s": attributed_total,
        **{f"{p}_s": phases[p] for p in PHASES},
        "inter_mb_sent_per_step": (
            run0["bytes_sent_per_step"]["inter"] / 1e6 if run0.get("bytes_sent_per_step") else None
        ),
        "inter_mb_step_mean": counted[0] / 1e6 if counted else None,
        "inter_mb_step_peak": counted[1] / 1e6 if counted else None,
        "inter_source": counted[2] if counted else None,
    }
    sleeps = [r["accel_sleep_per_step"] for r in runs if r.get("accel_sleep_per_step")]
    if sleeps:  # the slowest rank's delivered compute per step
        out["accel_asked_s"] = max(x["asked"] for x in sleeps)
        out["accel_slept_s"] = max(x["slept"] for x in sleeps)
    return out


def _merge_repeats(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(row_key(r), []).append(r)
    out = []
    for rs in groups.values():
        row = dict(rs[0])
        for k in rs[0]:
            if k in ("bucket_mb", "grad_mb", "whole_sync_mb", "shard_mb"):
                continue
            vals = [r[k] for r in rs if isinstance(r[k], float)]
            if vals:
                row[k] = statistics.fmean(vals) if k == "step_s" else statistics.median(vals)
        row["repeats"] = len(rs)
        row["step_s_runs"] = ";".join(f"{r['step_s']:.4f}" for r in rs if r["step_s"] is not None)
        row["step_durations_s"] = ";".join(r["step_durations_s"] for r in rs if r.get("step_durations_s"))
        out.append(row)
    return out


def _add_ratios(rows: list[dict]) -> None:
    """Ratios against DDP, post-local SGD at the same k and FSDP2 HSDP, always within one compute model."""
    by = {row_key(r): r for r in rows}

    def ratio(r: dict, ref: dict | None) -> float | None:
        if ref is None or r["step_s"] is None or not ref["step_s"]:
            return None
        return r["step_s"] / ref["step_s"]

    for r in rows:
        r["vs_ddp"] = ratio(r, by.get(row_key(r, "ddp")))
        post = None
        if r["kind"] in ("hiersync", "postlocal", "torchft") and r["period"] and r["period"] > 1:
            post = by.get(row_key(r, f"postlocal_k{r['period']}"))
        r["vs_postlocal"] = ratio(r, post)
        # FSDP2 rows: against FSDP2's own HSDP
        r["vs_hsdp"] = ratio(r, by.get(row_key(r, "fsdp_hsdp"))) if str(r["kind"]).startswith("fsdp_") else None

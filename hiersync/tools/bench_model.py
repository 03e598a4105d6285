"""The cost model beside the bench: predicted vs measured exposed communication, row by row.

For each (model, bucket size, compute model) of a bench run that has a ``compute_only``
row, the cost model (:func:`hiersync.costmodel.step_time`) is given what that row
measured -- its step time as the compute per step, its backward phase as the backward
time -- the speed of a fresh copy as every rank measured it at the start of the run (the
launch copies), and the profile of the link (by default the ``emulated`` preset, when the
bench ran on the default shaped 800 Mbit testbed). For the period-k rows it is also given the
measured local step (``intra_only``'s) as the time a transfer in flight hides behind: the
model's own local step misses the CPU contention of this box (the ``intra_only`` row
shows by how much), and what is validated there is the sync, not the local step. It then
predicts every row the model knows:

* ``ddp``, ``hiersync_p1``, ``intra_only``: *exposed communication*, the row's step minus
  ``compute_only``'s;
* every hiersync row with a period k > 1 (blocking after ``optimizer.step()``,
  ``_overlap``, ``_stream``, ``_bf16``): *exposed sync*, the row's step minus
  ``intra_only``'s, the time the inter-node average adds to a local step.

The claim checked is that the model predicts every after-step mode's exposed sync within 20%
or 10 ms, whichever is larger (a few ms of predicted exposure cannot be judged in per cent),
judged on accelerator-like compute (with real CPU compute on a 2-core host gloo's transfers
take the compute's cores, which the model does not price; the table still shows those rows,
marked). The measured exposed time is a difference of two rows' means, each with its
step-to-step noise: its 95% interval (:mod:`.bench_noise`) decides the verdict, PASS where it
lies wholly within the tolerated band around the prediction, FAIL where wholly outside,
inconclusive otherwise (and where the row ran wholly faster than its reference, which does a
part of its work: the host's load changed between the two rows). Pure: no process group, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hiersync import costmodel as cm
from hiersync._table import render
from hiersync.costmodel.compression import compress_ratio
from hiersync.costmodel.planner import copy_speed

from . import bench_noise
from .netns import DEFAULT_RATE

__all__ = [
    "EXPOSED_TOLERANCE",
    "EXPOSED_FLOOR_S",
    "tolerated",
    "resolve_profile",
    "compare",
    "format_comparison",
    "model_targets",
    "format_model_targets",
]

EXPOSED_TOLERANCE = 0.20
"""The claim: predicted exposed sync time within 20% of the bench's ..."""
EXPOSED_FLOOR_S = 0.010
"""... or within 10 ms of it, whichever is larger: one step's scheduling jitter on the testbed."""
MiB = 2**20


def resolve_profile(spec: str | None, testbed: dict[str, Any]) -> tuple[cm.Profile | None, str]:
    """The profile to predict with, and where it came from (or why there is none).

    ``spec``: a preset name, a calibrated profile's path, ``"none"``, or None (the
    ``emulated`` preset when ``testbed`` is the default shaped link, else no model).
    """
    if spec is None:
        if testbed.get("mode") != "netns" or str(testbed.get("inter_rate")) != DEFAULT_RATE:
            return None, (
                f"no model table: the emulated preset describes the shaped {DEFAULT_RATE} link and this run used "
                f"{testbed.get('describe', 'another link')}; pass --profile P.json (python -m hiersync calibrate on it)"
            )
        return cm.get_preset("emulated"), "the emulated preset (the shaped 800 Mbit testbed)"
    if spec == "none":
        return None, "no model table (--profile none)"
    if spec in cm.PRESETS:
        return cm.get_preset(spec), f"the {spec} preset"
    try:
        return cm.Profile.load(spec), f"the profile {spec}"
    except OSError as e:
        raise ValueError(f"--profile={spec!r}: not a preset ({', '.join(cm.PRESETS)}) nor a readable file: {e}") from e


def _exposed_interval(row: dict, reference: dict, estimate: float) -> bench_noise.Interval | None:
    """The interval of the row's exposed time (its mean step minus the reference's): from both rows'
    runs in interleaved rounds where they have them, else from their per-step times (None: a row of
    under 2 windows)."""
    runs, ref_runs = bench_noise.runs_of(row), bench_noise.runs_of(reference)
    if runs and len(runs) == len(ref_runs):
        return bench_noise.paired_interval(runs, ref_runs, ratio=False, estimate=estimate)
    return bench_noise.difference_interval(
        bench_noise.steps_of(row),
        row.get("period") or 1,
        bench_noise.steps_of(reference),
        reference.get("period") or 1,
        estimate=estimate,
    )


def _placement(row: dict) -> str | None:
    if row["kind"] != "hiersync" or not row["period"] or row["period"] <= 1:
        return None
    return "overlap" if row["overlap"] else "optimizer"


def compare(
    rows: Sequence[dict],
    profile: cm.Profile,
    *,
    nodes: int,
    ranks_per_node: int,
    copy_s_per_byte: float | None = None,
) -> list[dict]:
    """One entry per predictable row: predicted and measured exposed seconds per step, and the error.

    ``copy_s_per_byte``: the launch copies' cost measured in the same run (the bench's copy
    probe), like the compute; None: the profile's ``copy_gbps``.
    """
    copy_beta = copy_speed(profile, None)[0] if copy_s_per_byte is None else copy_s_per_byte
    by = {(r["model"], r["bucket_mb"], r.get("compute", "cpu"), r["schedule"]): r for r in rows}
    out: list[dict] = []
    for (model, bucket, compute, name), row in by.items():
        floor = by.get((model, bucket, compute, "compute_only"))
        intra = by.get((model, bucket, compute, "intra_only"))
        if floor is None or not floor.get("step_s") or row.get("unsupported") or row.get("step_s") is None:
            continue
        kw: dict[str, Any] = dict(
            profile=profile,
            grad_bytes=row["num_params"] * 4.0,
            bucket_bytes=bucket * MiB,
            backward_s=floor["backward_s"],
            compute_s=floor["step_s"],
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            copy_s_per_byte=copy_beta,
        )
        placement = _placement(row)
        if name in ("ddp", "intra_only") or (row["kind"] == "hiersync" and row["period"] == 1):
            schedule = "hiersync" if row["kind"] == "hiersync" else name
            predicted = cm.step_time(schedule, **kw).exposed_s
            reference, measured = "compute_only", row["step_s"] - floor["step_s"]
        elif placement is not None and intra is not None and intra.get("step_s"):
            # The local step a transfer hides behind is the measured one: compute such that the
            # model's local step (compute + its own exposed intra comm) is intra_only's step.
            local_exposed = cm.step_time("intra_only", **kw).exposed_s
            kw["compute_s"] = max(floor["step_s"], intra["step_s"] - local_exposed)
            st = cm.step_time(
                "hiersync",
                period=row["period"],
                fragments=row.get("fragments", 1),
                overlap=row["overlap"],
                placement=placement,
                compress_ratio=compress_ratio(row.get("compress")),
                **kw,
            )
            predicted = st.step_s - cm.step_time("intra_only", **kw).step_s
            reference, measured = "intra_only", row["step_s"] - intra["step_s"]
        else:
            continue
        interval = _exposed_interval(row, by[(model, bucket, compute, reference)], measured)
        out.append(
            dict(
                model=model,
                bucket_mb=bucket,
                compute=compute,
                schedule=name,
                after_step=placement is not None,
                reference=reference,
                predicted_s=predicted,
                measured_s=measured,
                error=(predicted - measured) / measured if measured > 0 else None,
                measured_low_s=None if interval is None else interval.low,
                measured_high_s=None if interval is None else interval.high,
                step_s=row["step_s"],
            )
        )
    return out


def format_comparison(entries: Sequence[dict], source: str) -> str:
    """The model-vs-bench table: one line per row, ms per step."""
    if not entries:
        return ""
    lines = [
        f"cost model vs bench (exposed ms per step; model: {source}, given each compute model's measured "
        "compute_only step and backward)",
    ]
    table = []
    for e in entries:
        err = "-" if e["error"] is None else f"{e['error']:+.0%}"
        low, high = e.get("measured_low_s"), e.get("measured_high_s")
        noise = "-" if low is None or high is None else f"+-{(high - low) / 2 * 1e3:.0f}"
        table.append(
            [
                e["schedule"],
                e["compute"],
                e["reference"],
                f"{e['predicted_s'] * 1e3:.0f}",
                f"{e['measured_s'] * 1e3:.0f}",
                noise,
                err,
            ]
        )
    head = ["schedule", "compute", "exposed over", "model ms", "bench ms", "95% ms", "error"]
    lines.append(render(head, table, align="lllr"))
    lines.append(
        "95% ms: the half width of the 95% interval of the bench's exposed ms, from both rows' rounds where they ran "
        "in rounds, else from the batch means of their per-step times ('-': a row of under 2 windows)"
    )
    if any(e["compute"] == "cpu" for e in entries):
        lines.append(
            "cpu rows: gloo's transfers take the 2 cores that compute, which the model does not price (it assumes "
            "communication never slows compute); the claim below judges the accel rows"
        )
    return "\n".join(lines)


def tolerated(predicted: float, tolerance: float = EXPOSED_TOLERANCE, floor: float = EXPOSED_FLOOR_S):
    """The measured exposed times the prediction is within ``tolerance`` of, or within ``floor`` seconds
    of, whichever is larger: (low, high) seconds.

    |predicted - m| <= max(tolerance x m, floor): m within ``floor`` of the prediction, or (a positive
    prediction) m in [predicted / (1 + tolerance), predicted / (1 - tolerance)].
    """
    low, high = predicted - floor, predicted + floor
    if predicted > 0:
        low, high = min(low, predicted / (1 + tolerance)), max(high, predicted / (1 - tolerance))
    return low, high


def model_targets(
    entries: Sequence[dict],
    tolerance: float = EXPOSED_TOLERANCE,
    floor: float = EXPOSED_FLOOR_S,
    *,
    environment: dict | None = None,
) -> list[dict]:
    """The cost model's claim: each after-step hiersync mode's exposed sync within ``tolerance`` or ``floor``
    (whichever larger), on accel compute. ``verdict``: ``"pass"`` where the measured time's interval lies
    within :func:`tolerated`, ``"fail"`` where wholly outside, else ``"inconclusive"`` (also where a row has
    under 2 windows: the noise is not known; and where it would fail wholly below zero, ``below_reference``:
    the row, which does its reference's work and more, ran faster than it, so the host's load changed between
    them; and on a host loaded before the run, :func:`.bench_noise.loaded`, said in ``loaded``). ``met``:
    True on a pass, False on a fail, else None."""
    busy = bench_noise.loaded(environment)
    out = []
    for e in entries:
        if not e["after_step"] or e["compute"] != "accel":
            continue
        low, high = tolerated(e["predicted_s"], tolerance, floor)
        drift = False
        if e.get("measured_low_s") is None:
            verdict = "inconclusive"
        else:
            interval = bench_noise.Interval(e["measured_s"], e["measured_low_s"], e["measured_high_s"])
            verdict = bench_noise.verdict(interval, high, low)
            # The row does its reference's work and its sync: wholly faster than the reference, it ran
            # on a host whose load changed between the two rows, which no model predicts.
            drift = verdict == "fail" and interval.high < 0
            verdict = "inconclusive" if drift or busy else verdict
        out.append(
            {
                **e,
                "tolerance": tolerance,
                "floor_s": floor,
                "tolerated_s": [low, high],
                "verdict": verdict,
                "met": {"pass": True, "fail": False}.get(verdict),
                "below_reference": drift,
                "loaded": busy,
            }
        )
    return out


def format_model_targets(targets: Sequence[dict]) -> str:
    """One line per judged row: the measured exposed ms, its interval, the verdict, and the tolerated band."""
    lines = []
    for t in targets:
        what = (
            f"cost model predicts {t['schedule']}'s exposed sync within {t['tolerance']:.0%} or "
            f"{t['floor_s'] * 1e3:.0f} ms [{t['compute']}, {t['model']}, {t['bucket_mb']:g} MB buckets]"
        )
        meas = t["measured_s"] * 1e3
        word = {"pass": "PASS", "fail": "FAIL"}.get(t["verdict"], t["verdict"])
        if t.get("measured_low_s") is None:
            bench = f"{meas:.0f} ms {word} (noise unknown: a row of under 2 windows, more --min-seconds)"
        else:
            low, high = t["measured_low_s"] * 1e3, t["measured_high_s"] * 1e3
            why = f"noise +-{(high - low) / 2:.0f} ms"
            if t.get("below_reference"):
                why = f"faster than {t['reference']}: the load changed between the two rows; {why}"
            if t.get("loaded"):
                why = f"{t['loaded']}; {why}"
            bench = f"{meas:.0f} ms [{low:.0f}, {high:.0f}] {word} ({why})"
        band = ", ".join(f"{x * 1e3:.0f}" for x in t["tolerated_s"])
        lines.append(f"{what}: bench {bench}; model {t['predicted_s'] * 1e3:.0f} ms, tolerates [{band}] ms")
    return "\n".join(lines)

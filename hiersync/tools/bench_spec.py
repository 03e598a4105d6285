"""What a ``python -m hiersync bench`` schedule name means (see :mod:`hiersync.tools.bench`).

Grammar of the hiersync schedules::

    hiersync_p<k>[_overlap | _stream[<F>][_tau<t>]][_bf16 | _int8 | _int4 | _topk2][_outer]

* ``hiersync_p<k>``: period k, the inter-node average runs blocking after ``optimizer.step()``;
* ``_overlap``: the whole model's average is launched there and applied one step later
  (``overlap=True``, needs k >= 2);
* ``_stream``: streaming, ``fragments=F`` (default ``F = k``) staggered over the period, each
  applied ``t`` steps after its launch (``overlap=t``, default 1, ``1 <= t <= k - 1``);
* ``_bf16``: 16-bit deltas on the inter-node leg (``compress="bf16"``); ``_int8``, ``_int4``:
  block-quantized deltas with error feedback (``compress="int8"`` / ``"int4"``); ``_topk2``:
  each block's largest values, 2-bit, with error feedback (``compress="topk2"``; every coded row
  of the payload table is a suffix);
* ``_outer``: DiLoCo's outer Nesterov step on the averaged pseudo-gradient
  (``outer_lr=0.7, outer_momentum=0.9``, the values torchft's DiLoCo examples use).

``hiersync_p4_stream`` is ``HierState(period=4, fragments=4, overlap=1)``,
``hiersync_p8_stream4_tau2_bf16`` is ``HierState(period=8, fragments=4, overlap=2, compress="bf16")``.

torchft's algorithms (``--peers torchft``; :mod:`hiersync.tools.bench_torchft` builds them)::

    torchft_localsgd_k<k>                  LocalSGD(sync_every=k)
    torchft_diloco_k<k>[_d<d>]             DiLoCo, the whole model as one fragment
    torchft_streaming_k<k>_f<F>[_d<d>]     Streaming DiLoCo: DiLoCo with F >= 2 fragments

``_d<d>`` is torchft's ``fragment_sync_delay`` (default 0): a fragment's all-reduce starts d
steps before the step that applies it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hiersync.vocab import WIRE_FORMATS

__all__ = [
    "FSDP_KINDS",
    "FSDP_GRAMMAR",
    "parse_fsdp_schedule",
    "fsdp_schedules",
    "is_fsdp_name",
    "ScheduleSpec",
    "parse_schedule",
    "default_schedules",
    "full_schedules",
    "timed_steps",
    "run_steps",
    "attributed_steps",
    "memory_steps",
    "BURN_STEPS",
    "BURN_SECONDS",
    "PERIODIC",
    "parse_compute",
    "NEVER",
    "FULL_PERIODS",
    "COMPUTE_MODELS",
    "GRAMMAR",
    "TORCHFT_GRAMMAR",
    "OUTER",
    "PEERS",
    "torchft_accepts",
    "torchft_streaming_choice",
    "torchft_schedules",
    "with_peers",
]

FULL_PERIODS = (2, 4, 8)
NEVER = 10**9  # a period no run reaches: intra-node averaging only
COMPUTE_MODELS = ("cpu", "accel")
"""``cpu``: real CPU compute; ``accel``: layers that sleep a set time with the CPU idle (a device's kernels)."""
_CODECS = tuple(n for n, f in WIRE_FORMATS.items() if f.delta and n != "fp16")
"""The payloads a row may name (every coded row of :data:`hiersync.vocab.WIRE_FORMATS`, and bf16)."""
GRAMMAR = f"hiersync_p<k>[_overlap|_stream[<F>][_tau<t>]][{'|'.join('_' + c for c in _CODECS)}][_outer]"
TORCHFT_GRAMMAR = "torchft_localsgd_k<k>, torchft_diloco_k<k>[_d<d>], torchft_streaming_k<k>_f<F>[_d<d>]"
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}
"""The outer optimizer of ``_outer`` rows and of torchft's DiLoCo rows (torchft's examples: SGD lr 0.7,
momentum 0.9, Nesterov)."""

_SCHEDULE_RE = re.compile(
    rf"^hiersync_p(\d+)(?:(_overlap)|(_stream)(\d*)(?:_tau(\d+))?)?(?:_({'|'.join(_CODECS)}))?(_outer)?$"
)
_TORCHFT_RE = re.compile(
    r"^torchft_(?:(localsgd)_k(\d+)|(diloco)_k(\d+)(?:_d(\d+))?|(streaming)_k(\d+)_f(\d+)(?:_d(\d+))?)$"
)


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name means."""

    name: str
    kind: str
    """``ddp``, ``postlocal``, ``bf16_hook``, ``hiersync``, ``torchft``, ``intra_only`` or ``compute_only``."""
    period: int = 1
    overlap: int = 0
    """Steps after its launch that an inter-node average is applied (0: blocking)."""
    compress: str | None = None
    fragments: int = 1
    """Streaming fragments (1: the whole model at once)."""
    stream: bool = False
    """Built with the streaming API (``fragments=F, overlap=tau``), not the ``overlap=True`` flag."""
    outer: bool = False
    """An outer optimizer (:data:`OUTER`) on the averaged pseudo-gradient."""
    algorithm: str | None = None
    """torchft rows: ``localsgd`` or ``diloco`` (Streaming DiLoCo is ``diloco`` with fragments > 1)."""

    def hiersync_options(self) -> dict[str, Any]:
        """The keyword arguments of ``hiersync.register`` / ``HierState`` this schedule uses."""
        opts: dict[str, Any] = {"period": self.period, "compress": self.compress}
        if self.stream:
            opts.update(fragments=self.fragments, overlap=self.overlap)
        else:
            opts["overlap"] = bool(self.overlap)
        if self.outer:
            opts.update(OUTER)
        return opts


def parse_schedule(name: str) -> ScheduleSpec:
    """Parse ``"hiersync_p4_stream_bf16"``, ``"postlocal_k4"``, ``"ddp"``, ``"fsdp_hsdp"``, ... into a spec."""
    if name.startswith("fsdp_"):
        return parse_fsdp_schedule(name)
    if name in ("ddp", "bf16_hook", "intra_only", "compute_only"):
        return ScheduleSpec(name, name, period=NEVER if name == "intra_only" else 1)
    m = re.match(r"^postlocal_k(\d+)$", name)
    if m and int(m.group(1)) >= 1:
        return ScheduleSpec(name, "postlocal", period=int(m.group(1)))
    m = _TORCHFT_RE.match(name)
    if m:
        return _torchft_spec(name, m)
    m = _SCHEDULE_RE.match(name)
    if m and int(m.group(1)) >= 1:
        period = int(m.group(1))
        overlap_flag, stream, frag, tau, compress, outer_flag = m.group(2, 3, 4, 5, 6, 7)
        outer = bool(outer_flag)
        if overlap_flag:
            if period < 2:
                raise ValueError(f"schedule {name!r}: overlap needs period >= 2")
            return ScheduleSpec(name, "hiersync", period=period, overlap=1, compress=compress, outer=outer)
        if stream:
            fragments = int(frag) if frag else period
            overlap = int(tau) if tau else 1
            if period < 2:
                raise ValueError(f"schedule {name!r}: streaming needs period >= 2")
            if fragments < 1:
                raise ValueError(f"schedule {name!r}: fragments must be >= 1")
            if not 1 <= overlap <= period - 1:
                raise ValueError(f"schedule {name!r}: tau must be in 1..{period - 1} (period {period})")
            return ScheduleSpec(
                name,
                "hiersync",
                period=period,
                overlap=overlap,
                compress=compress,
                fragments=fragments,
                stream=True,
                outer=outer,
            )
        return ScheduleSpec(name, "hiersync", period=period, compress=compress, outer=outer)
    raise ValueError(
        f"schedule {name!r} is not known; use ddp, bf16_hook, intra_only, compute_only, postlocal_k<k>, {GRAMMAR}, "
        f"{TORCHFT_GRAMMAR}"
    )


def _torchft_spec(name: str, m: re.Match) -> ScheduleSpec:
    """A torchft row; the limits torchft itself sets are checked where it is built (it says why)."""
    local_k, diloco_k, diloco_d, stream_k, stream_f, stream_d = m.group(2, 4, 5, 7, 8, 9)
    if local_k is not None:
        period, fragments, delay, algorithm = int(local_k), 1, 0, "localsgd"
    elif diloco_k is not None:
        period, fragments, delay, algorithm = int(diloco_k), 1, int(diloco_d or 0), "diloco"
    else:
        period, fragments, delay, algorithm = int(stream_k), int(stream_f), int(stream_d or 0), "diloco"
        if fragments < 2:
            raise ValueError(f"schedule {name!r}: streaming needs fragments >= 2 (torchft_diloco_k<k> is one fragment)")
    if period < 1:
        raise ValueError(f"schedule {name!r}: sync_every must be >= 1")
    return ScheduleSpec(
        name,
        "torchft",
        period=period,
        overlap=delay,
        fragments=fragments,
        outer=algorithm == "diloco",
        algorithm=algorithm,
    )


def parse_compute(text: str) -> list[str]:
    """``"cpu,accel"`` -> ``["cpu", "accel"]`` (validated, order kept, duplicates dropped)."""
    out = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    bad = [c for c in out if c not in COMPUTE_MODELS]
    if bad or not out:
        raise ValueError(f"--compute={text!r}: use one or both of {', '.join(COMPUTE_MODELS)}")
    return out


def default_schedules() -> list[str]:
    """What the claims compare, at k=4, plus the two references (x2 compute models: 16 runs).

    PyTorch's ``bf16_hook`` and hiersync's whole-model ``_overlap`` rows (which streaming
    supersedes) are in :func:`full_schedules`, left out here to keep the default run near three
    minutes.
    """
    return [
        "ddp",
        "postlocal_k4",
        "hiersync_p1",
        "hiersync_p4",
        "hiersync_p4_stream",
        "hiersync_p4_stream_bf16",
        "intra_only",
        "compute_only",
    ]


def full_schedules(periods: Sequence[int] = FULL_PERIODS) -> list[str]:
    """Every schedule at every period in ``periods``, plus the references."""
    out = ["ddp", "bf16_hook", "hiersync_p1"]
    for k in periods:
        out += [
            f"postlocal_k{k}",
            f"hiersync_p{k}",
            f"hiersync_p{k}_overlap",
            f"hiersync_p{k}_bf16",
            f"hiersync_p{k}_overlap_bf16",
        ]
        if k >= 2:
            out += [f"hiersync_p{k}_stream", f"hiersync_p{k}_stream_bf16"]
    return out + ["intra_only", "compute_only"]


def torchft_accepts(period: int, fragments: int, delay: int) -> str | None:
    """Why torchft 0.2.0's ``DiLoCo`` refuses ``(sync_every, fragments, fragment_sync_delay)``, or None.

    Its constructor's own rules (``torchft/local_sgd.py``): every fragment syncs once per
    ``sync_every`` steps, one fragment per ``sync_every / fragments`` steps, and its step hook
    keeps at most one fragment in flight, so a fragment's all-reduce must finish before the
    next one starts. :func:`hiersync.tools.bench_torchft.refusal` asks torchft itself.
    """
    if period < fragments:
        return f"sync_every={period} < fragments={fragments}: only 1 fragment can be synchronized at a time"
    if period % fragments:
        return f"fragments={fragments} does not divide sync_every={period}"
    if delay >= period // fragments:
        return (
            f"fragment_sync_delay={delay} >= sync_every / fragments = {period // fragments}: "
            "a fragment must be synced before the next one is reduced (one fragment in flight)"
        )
    return None


def torchft_streaming_choice(period: int) -> tuple[int, int] | None:
    """The Streaming DiLoCo ``(fragments, fragment_sync_delay)`` the bench runs at ``sync_every=period``.

    The most fragments that torchft still lets overlap a step (delay >= 1 needs
    ``sync_every / fragments >= 2``), with delay 1 as hiersync's ``tau=1``: at k=4 that is 2
    fragments (4 fragments are accepted with delay 0 only: a blocking quarter every step).
    Where none overlaps (k < 4), the most fragments with delay 0; None at k = 1.
    """
    for delay in (1, 0):
        fits = [f for f in range(2, period + 1) if torchft_accepts(period, f, delay) is None]
        if fits:
            return max(fits), delay
    return None


def torchft_schedules(period: int, every: bool = False) -> list[str]:
    """torchft's rows at ``sync_every=period`` (``every``: each configuration torchft accepts there).

    LocalSGD; DiLoCo; DiLoCo with the most overlap torchft accepts (one fragment, delay k-1:
    the whole model's all-reduce starts k-1 steps before the step that applies it, the
    fastest of its 7 configurations at k=4 in ``--peers torchft-all``); and Streaming DiLoCo
    with the most fragments that still overlap a step (:func:`torchft_streaming_choice`).
    """
    out = [f"torchft_localsgd_k{period}"]
    if every:
        out += [f"torchft_diloco_k{period}" + (f"_d{d}" if d else "") for d in range(period)]
        for f in range(2, period + 1):
            out += [
                f"torchft_streaming_k{period}_f{f}_d{d}" for d in range(period) if torchft_accepts(period, f, d) is None
            ]
        return out
    out.append(f"torchft_diloco_k{period}")
    if period > 1:
        out.append(f"torchft_diloco_k{period}_d{period - 1}")
    choice = torchft_streaming_choice(period)
    if choice is not None:
        out.append(f"torchft_streaming_k{period}_f{choice[0]}_d{choice[1]}")
    return out


def with_peers(schedules: Sequence[str], peers: Sequence[str], period: int = 4) -> list[str]:
    """``schedules`` with the peers' rows (``"torchft"`` or ``"torchft-all"``) before the references.

    With torchft comes ``hiersync_p<k>_stream_outer`` too: hiersync's streaming with the outer
    optimizer torchft's DiLoCo rows use, so each DiLoCo row has a like-for-like hiersync row.
    """
    extra: list[str] = []
    for peer in peers:
        if peer not in PEERS:
            raise ValueError(f"--peers: {peer!r} is not known; use {', '.join(PEERS)}")
        extra += [f"hiersync_p{period}_stream_outer", *torchft_schedules(period, every=peer == "torchft-all")]
    refs = [s for s in schedules if s in ("intra_only", "compute_only")]
    rest = [s for s in schedules if s not in refs]
    return list(dict.fromkeys(rest + extra + refs))


PEERS = ("torchft", "torchft-all")
"""``--peers``: torchft's LocalSGD, DiLoCo and chosen Streaming DiLoCo; or every configuration it accepts."""


def timed_steps(spec: ScheduleSpec, steps: int) -> int:
    """``steps`` rounded up to a multiple of the period, so every window holds the same syncs."""
    k = spec.period if spec.kind in PERIODIC and spec.period < NEVER else 1
    return max(k, int(math.ceil(steps / k)) * k)


PERIODIC = ("hiersync", "postlocal", "torchft", "fsdp_hiersync")
"""The kinds whose rows sync across nodes every k steps."""

BURN_STEPS = 1
"""Untimed free-running steps between the attributed and the timed ones, at least (bench_steps)."""

BURN_SECONDS = 2.0
"""... and at least this long (at the attributed steps' pace): the first free-running seconds are noisy."""

STEADY_ROUNDS = 3
"""The rows whose noise a claim needs (``bench_claims.steady_rows``: two nearly equal means, a
period-k row's windows, the cost model's rows) run this many times, in interleaved rounds
(A B ... A B ...), each ``--min-seconds`` long: two rows' ratio then has one sample per round,
each round's pair timed under that round's load (:func:`.bench_noise.paired_interval`)."""


def attributed_steps(spec: ScheduleSpec) -> int:
    """Steps timed phase by phase, with barriers between the phases: one window (two steps at k = 1).

    The barriers cost real time (on the testbed they queue behind a transfer on the shaped
    link), so these steps give the breakdown only; the step times come from the timed steps.
    """
    return timed_steps(spec, 2)


def run_steps(spec: ScheduleSpec, warmup: int, steps: int) -> int:
    """Every step one bench run of ``spec`` takes: warmup, attributed, burnt and timed steps."""
    return warmup + attributed_steps(spec) + BURN_STEPS + timed_steps(spec, steps)


def memory_steps(spec: ScheduleSpec, warmup: int) -> int:
    """Steps of ``spec``'s run in the memory pass: warmup and two periods (every fragment launched and applied)."""
    return warmup + 2 * timed_steps(spec, 1)


# ---------------------------------------------------------------- FSDP2 rows (--fsdp)
# Every FSDP2 row shards the same MLP with ``fully_shard`` (one FSDP unit per layer, plus the
# root) and trains it with the same optimizer; they differ in what crosses nodes:
#
# ==============================  ==============================================================
# ``fsdp_hsdp``                   FSDP2's own HSDP: ``fully_shard`` over a 2-D (node, local) mesh,
#                                 every step's gradients reduce-scattered in the node and
#                                 all-reduced across nodes (torch's reference)
# ``fsdp_hiersync_p<k>...``       ``fully_shard`` over :func:`hiersync.node_mesh` and
#                                 ``hiersync.register(model, opt, ...)``: the options of the DDP
#                                 rows' grammar (``fsdp_hiersync_p4_stream`` is ``period=4,
#                                 fragments=4, overlap=1``)
# ``fsdp_intra_only``             ``fully_shard`` over the node only, nothing across nodes
#                                 (reference: the step without inter-node traffic)
# ==============================  ==============================================================

FSDP_KINDS = ("fsdp_hsdp", "fsdp_hiersync", "fsdp_intra_only")
FSDP_GRAMMAR = "fsdp_hsdp, fsdp_intra_only, fsdp_hiersync_p<k>[...] (the hiersync grammar)"
_PREFIX = "fsdp_"


def is_fsdp_name(name: str) -> bool:
    return name.startswith(_PREFIX)


def parse_fsdp_schedule(name: str) -> ScheduleSpec:
    """``"fsdp_hsdp"``, ``"fsdp_intra_only"`` or ``"fsdp_"`` + a hiersync schedule name."""
    if name == "fsdp_hsdp":
        return ScheduleSpec(name, "fsdp_hsdp", period=1)
    if name == "fsdp_intra_only":
        return ScheduleSpec(name, "fsdp_intra_only", period=NEVER)
    rest = name[len(_PREFIX) :]
    if rest.startswith("hiersync_"):
        try:
            spec = parse_schedule(rest)
        except ValueError as e:
            raise ValueError(f"schedule {name!r}: {e}") from None
        return replace(spec, name=name, kind="fsdp_hiersync")
    raise ValueError(f"schedule {name!r} is not known; the FSDP2 rows are {FSDP_GRAMMAR}")


def fsdp_schedules(period: int = 4) -> list[str]:
    """The rows of ``--fsdp``: HSDP, hiersync blocking and streaming at ``period``, the intra-only reference."""
    return ["fsdp_hsdp", f"fsdp_hiersync_p{period}", f"fsdp_hiersync_p{period}_stream", "fsdp_intra_only"]

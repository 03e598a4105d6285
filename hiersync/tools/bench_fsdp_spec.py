"""What an FSDP2 schedule name of ``python -m hiersync bench --fsdp`` means. Pure.

Every FSDP2 row shards the same MLP with ``fully_shard`` (one FSDP unit per layer, plus the
root) and trains it with the same optimizer; they differ in what crosses nodes:

==============================  ==============================================================
``fsdp_hsdp``                   FSDP2's own HSDP: ``fully_shard`` over a 2-D (node, local) mesh,
                                every step's gradients reduce-scattered in the node and
                                all-reduced across nodes (torch's reference)
``fsdp_hiersync_p<k>...``       ``fully_shard`` over :func:`hiersync.node_mesh` and
                                ``hiersync.register(model, opt, ...)``: the options of the DDP
                                rows' grammar (``fsdp_hiersync_p4_stream`` is ``period=4,
                                fragments=4, overlap=1``)
``fsdp_intra_only``             ``fully_shard`` over the node only, nothing across nodes
                                (reference: the step without inter-node traffic)
==============================  ==============================================================
"""

from __future__ import annotations

from dataclasses import replace

from .bench_spec import NEVER, ScheduleSpec, parse_schedule

__all__ = ["FSDP_KINDS", "FSDP_GRAMMAR", "parse_fsdp_schedule", "fsdp_schedules", "is_fsdp_name"]

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

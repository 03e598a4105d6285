"""FSDP2 inside the node, hiersync across nodes: memory per GPU and step time.

``python -m hiersync plan --fsdp`` plans a model sharded with FSDP2 over each node's L ranks
(``fully_shard(..., mesh=hiersync.node_mesh())``, DESIGN "FSDP2 front-end"):

* **Memory** (:func:`fsdp_memory`): parameters, gradients and optimizer state sharded 1/L; the
  unsharded working set of FSDP's units (two units' parameters all-gathered, the one computing
  and the one prefetched, plus one unit's unsharded gradient before its reduce-scatter; every
  unit's parameters stay gathered from forward to backward with ``reshard_after_forward=False``);
  and hiersync's state for the rank's own shard: the fp32 anchor (with compression or an outer
  optimizer), the outer momentum (outer optimizer) and the snapshots of the fragments in flight.
  Activations are the model's and not modelled (``activations_bytes`` adds a figure).
* **Step** (:func:`fsdp_step_time`): FSDP2's per-unit all-gather before each unit's forward, and
  again before its backward unless ``reshard_after_forward=False``, and the reduce-scatter of each
  unit's gradient after its backward, all inside the node on one FIFO channel, overlapped with the
  units' compute as FSDP2 prefetches them (:func:`~.steptime.simulate`). Across nodes: ``"hsdp"``
  (hiersync period 1 = FSDP2 HSDP: each unit's gradient shard all-reduced on the rail right after
  its reduce-scatter, every step), period k (the rank's parameter shard averaged on its rail after
  ``optimizer.step()`` every k steps, in F fragments made of whole units, each applied tau steps
  after its launch, :func:`~.streaming.sync_stalls`), or ``"intra_only"`` (never across nodes).
  Every collective is priced by :func:`~.predict.predict_allreduce` and its ring reduce-scatter /
  all-gather. Pure: no torch.

Example::

    >>> from hiersync.costmodel import PRESETS
    >>> m = fsdp_memory(params=7e9, ranks_per_node=8, units=32, period=8, fragments=8, overlap=1)
    >>> round(m.total / 1e9, 1), round(m.sharded / 1e9, 1)
    (17.5, 14.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import compression
from .links import check_count, check_number
from .memory import FP32_BYTES, residual_bytes
from .predict import (
    node_profile,
    predict_all_gather,
    predict_allreduce,
    predict_reduce_scatter,
    quantized_average_seconds,
    rail_profile,
)
from .steptime import StepTime, simulate
from .streaming import check_streaming, fragments_per_step, inter_bytes_per_rank, sync_stalls

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["FP32_BYTES", "ADAMW_STATE_BYTES", "FSDP_SCHEDULES", "FsdpMemory", "fsdp_memory", "fsdp_step_time"]

ADAMW_STATE_BYTES = 8
"""AdamW keeps two fp32 tensors per parameter (exp_avg, exp_avg_sq)."""
FSDP_SCHEDULES = ("hsdp", "hiersync", "intra_only")


@dataclass(frozen=True, kw_only=True)
class FsdpMemory:
    """Bytes per GPU of an FSDP2 model sharded over the node, by what holds them."""

    params: float
    """The rank's parameter shard (1/L)."""
    grads: float
    """The rank's gradient shard (1/L)."""
    optimizer: float
    """The optimizer state of the rank's shard (1/L)."""
    unsharded: float
    """FSDP's working set: all-gathered units' parameters and one unit's unsharded gradient."""
    anchor: float
    """hiersync's fp32 anchor for the rank's shard (with compression or an outer optimizer)."""
    momentum: float
    """hiersync's fp32 outer momentum for the rank's shard (outer optimizer)."""
    in_flight: float
    """Snapshots (and payloads) of the rank's shard of the fragments in flight."""
    residual: float = 0.0
    """bf16 error-feedback residuals (int8/int4 compression): the rank's shard and the 1/N of it it re-encodes."""
    activations: float = 0.0
    """As given: the model's activations are not modelled."""

    @property
    def sharded(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def hiersync(self) -> float:
        return self.anchor + self.momentum + self.in_flight + self.residual

    @property
    def total(self) -> float:
        return self.sharded + self.unsharded + self.hiersync + self.activations


def fsdp_memory(
    *,
    params: float,
    ranks_per_node: int,
    units: int,
    period: int = 1,
    fragments: int = 1,
    overlap: int = 0,
    param_bytes: int = FP32_BYTES,
    grad_bytes: int = FP32_BYTES,
    optimizer_bytes: float = ADAMW_STATE_BYTES,
    reshard_after_forward: bool = True,
    anchor: bool = False,
    outer: bool = False,
    error_feedback: bool | str = False,
    activations_bytes: float = 0.0,
    nodes: int = 2,
) -> FsdpMemory:
    """Memory per GPU of ``params`` parameters in ``units`` FSDP units sharded over ``ranks_per_node``.

    ``param_bytes`` / ``grad_bytes``: per parameter (fp32: 4); ``optimizer_bytes``: optimizer
    state per parameter (AdamW: 8); ``anchor``: hiersync keeps an fp32 anchor (compression or an
    outer optimizer); ``outer``: an outer optimizer (its momentum); ``error_feedback``: int8/int4's bf16
    residuals, the shard's and 1/``nodes`` of it (the piece the rank re-encodes; ``nodes=2``: the
    largest). Period 1 (HSDP) keeps no hiersync state.
    """
    p = check_number("params", params, strict=True)
    lpn, u = check_count("ranks_per_node", ranks_per_node), check_count("units", units)
    k = check_count("period", period)
    f, tau = check_streaming(k, fragments, overlap) if k > 1 else (1, 0)
    unit_params, unit_grads = p * param_bytes / u, p * grad_bytes / u
    gathered = p * param_bytes if not reshard_after_forward else min(2, u) * unit_params
    shard_state = p * FP32_BYTES / lpn
    frag_shard = p * param_bytes / f / lpn
    in_flight = 0.0 if k == 1 else (2 * tau * frag_shard if tau else frag_shard)
    return FsdpMemory(
        params=p * param_bytes / lpn,
        grads=p * grad_bytes / lpn,
        optimizer=p * check_number("optimizer_bytes", optimizer_bytes) / lpn,
        unsharded=gathered + unit_grads,
        anchor=shard_state if k > 1 and (anchor or outer) else 0.0,
        momentum=shard_state if k > 1 and outer else 0.0,
        in_flight=in_flight,
        residual=residual_bytes(shard_state, nodes, "int8" if error_feedback is True else error_feedback)
        if k > 1 and error_feedback
        else 0.0,
        activations=check_number("activations_bytes", activations_bytes),
    )


def _pass(units: int, compute_s: float, gather_s: float, scatter: tuple[tuple[str, float], ...]) -> tuple[float, float]:
    """(busy, exposed) of one pass over the units: all-gather (if any) -> compute -> ``scatter`` stages.

    All-gathers are issued as early as FSDP2 prefetches (in unit order, ready at once), the units
    compute in order on one stream, each unit's trailing collectives follow its compute.
    """
    per_unit = compute_s / units
    chain: list[tuple[str, float]] = [("intra", gather_s)] if gather_s > 0 else []
    chain += [("compute", per_unit), *scatter]
    end = simulate([0.0] * units, [chain] * units)
    busy = units * (gather_s + sum(d for _, d in scatter))
    return busy, max(0.0, end - compute_s)


def fsdp_step_time(
    schedule: str,
    *,
    profile: Profile,
    params: float,
    units: int,
    forward_s: float,
    backward_s: float,
    period: int = 1,
    fragments: int = 1,
    overlap: int = 0,
    param_bytes: int = FP32_BYTES,
    grad_bytes: int = FP32_BYTES,
    compress_ratio: float = 1.0,
    reshard_after_forward: bool = True,
    copy_s_per_byte: float = 0.0,
    compress: str | None = None,
) -> StepTime:
    """Per-step communication of an FSDP2 model on ``profile`` (``schedule`` in :data:`FSDP_SCHEDULES`).

    ``forward_s`` (forward + optimizer) and ``backward_s`` are the step's compute; ``units``
    FSDP units of equal bytes; ``compress`` (:mod:`.compression`: 16-bit values all-reduced,
    int8/int4 through the quantized rail average) or ``compress_ratio`` (bytes sent per byte,
    all-reduced): the period-k rail average's bits. Period-k transfers hide behind whole local
    steps (compute + the local step's exposed intra-node communication), as for DDP.
    """
    if schedule not in FSDP_SCHEDULES:
        raise ValueError(f"unknown FSDP schedule {schedule!r}; valid: {', '.join(FSDP_SCHEDULES)}")
    p = check_number("params", params, strict=True)
    u = check_count("units", units)
    fwd, bwd = check_number("forward_s", forward_s), check_number("backward_s", backward_s)
    k = check_count("period", period)
    n_frag, tau = check_streaming(k, fragments, overlap) if schedule == "hiersync" else (1, 0)
    ratio = check_number("compress_ratio", compress_ratio, strict=True)
    if compress is not None:
        if ratio != 1.0:
            raise ValueError(f"give compress={compress!r} or compress_ratio={ratio!r}, not both")
        ratio = compression.compress_ratio(compress, param_bytes)
    copy_beta = check_number("copy_s_per_byte", copy_s_per_byte)
    n_nodes, lpn = profile.nodes, profile.ranks_per_node
    node = node_profile(profile)
    unit_params, unit_grads = p * param_bytes / u, p * grad_bytes / u
    ag = predict_all_gather(unit_params, node)
    rs = predict_reduce_scatter(unit_grads, node)
    exact = schedule == "hsdp" or (schedule == "hiersync" and k == 1)
    rail_leg: tuple[tuple[str, float], ...] = ()
    if exact and n_nodes > 1:  # HSDP: each unit's gradient shard all-reduced on the rail after its reduce-scatter
        rail_leg = (("rail", predict_allreduce(unit_grads / lpn, rail_profile(profile))),)
    f_busy, f_exposed = _pass(u, fwd, ag, ())
    b_busy, b_exposed = _pass(u, bwd, ag if reshard_after_forward else 0.0, (("intra", rs), *rail_leg))
    comm, exposed = f_busy + b_busy, f_exposed + b_exposed
    compute = fwd + bwd
    label = "fsdp2 hsdp" if schedule == "hsdp" else "intra-only" if schedule == "intra_only" else f"hiersync k={k}"
    peak = mean = inter_bytes_per_rank("rail", p * grad_bytes, n_nodes, lpn) if exact else 0.0
    peak_exposed = exposed
    if schedule == "hiersync" and k > 1 and n_nodes > 1:
        label += f" F={n_frag} tau={tau}"
        shard = p * param_bytes / n_frag / lpn  # the rank's shard of one fragment
        if compress is not None and compression.is_quantized(compress):
            transfer = quantized_average_seconds(shard, profile, compress, param_bytes)
        else:
            transfer = predict_allreduce(shard * ratio, rail_profile(profile))
        # snapshot + payload when overlapped; payload + the average written back when blocking
        copies = 2 * shard + (ratio * shard if ratio < 1 else 0.0)
        counts = fragments_per_step(k, n_frag)
        stalls = sync_stalls(
            k, n_frag, tau, transfer_s=transfer, compute_s=compute + exposed, copy_s=copies * copy_beta
        )
        carrying = sum(1 for c in counts if c)
        comm = ((k - carrying) * comm + sum(c * transfer + comm for c in counts if c)) / k
        peak_exposed = exposed + max(stalls)
        exposed += sum(stalls) / k
        per_fragment = inter_bytes_per_rank("rail", p * param_bytes / n_frag * ratio, n_nodes, lpn)
        peak, mean = max(counts) * per_fragment, n_frag * per_fragment / k
    return StepTime(
        label=label,
        comm_s=comm,
        exposed_s=exposed,
        compute_s=compute,
        step_s=compute + exposed,
        num_buckets=u,
        exposed_peak_s=peak_exposed,
        inter_bytes_peak=peak,
        inter_bytes_mean=mean,
        fragments=n_frag,
        overlap=tau,
    )

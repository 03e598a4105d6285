"""Alpha-beta cost models of collectives, of hiersync's schedules, and of real hardware.

Pure maths (numpy at most, never ``torch``): every formula is unit-tested in
microseconds, and the planner, the projection and the hook's ``algorithm="auto"`` share it.
One idea per module:

* :mod:`.links`: a :class:`Link` (alpha, beta, gamma) and the single-level collectives;
* :mod:`.hierarchy`: flat vs two-level all-reduce on N nodes of L ranks, the period-k
  parameter average, and which exact path is faster;
* :mod:`.profile`: cluster :class:`Profile` (JSON) and the published :data:`PRESETS`;
* :mod:`.steptime`: the schedule simulator (:func:`step_time`);
* :mod:`.streaming`: the period-k sync in F staggered fragments, each applied tau steps
  after its launch (:func:`sync_stalls`), and inter-node bytes per step;
* :mod:`.nccl`: NCCL's tuning model (which algorithm and protocol it runs, and the time);
* :mod:`.predict`: :func:`predict_allreduce`, the entry point everything that prices a
  collective goes through (NCCL's model under NCCL, the alpha-beta ring on gloo);
* :mod:`.fit`: fitting alpha and beta, and the fabric latency, to measurements (:func:`fit_link`);
* :mod:`.memory`: the extra GPU memory per rank of a mode (:func:`~.memory.sync_memory`);
* :mod:`.planner` (with :mod:`.planner_report`, :mod:`.planner_sweeps` and :mod:`.planner_cli`) and
  :mod:`.projection`: ``python -m hiersync plan`` and ``project``;
* :mod:`.fsdp` and :mod:`.fsdp_plan`: FSDP2 inside the node (``plan --fsdp``): memory per GPU
  and the step with per-unit all-gathers and reduce-scatters;
* :mod:`.compression`: bits per element of ``compress`` and the quantized rail average (int8/int4);
* :mod:`.failures`: interruptions at a size, Daly's checkpoint interval, and the goodput of
  restarting from checkpoints against surviving in place.

Every public name of the first six is re-exported here, so ``from hiersync import
costmodel as cm; cm.allreduce_time(...)`` is the way to use them.

Example::

    >>> link = Link(alpha=1e-5, beta=1e-9)
    >>> round(allreduce_time("ring", 8, 1e6, link), 6)
    0.00189
    >>> choose_exact_algorithm(100e6, 2, 2, PRESETS["emulated"])
    'two_level'
"""

from __future__ import annotations

from . import compression, nccl, validation
from .fit import LinkFit, fit_link, fit_nccl_profile, fit_net_latency, fit_switch_tiers
from .hierarchy import (
    FLAT_ALGORITHMS,
    INTRA_ALGORITHMS,
    flat_allreduce_time,
    flat_crossover_bytes,
    hierarchical_allreduce_time,
    intra_algorithm_for_backend,
    param_sync_time,
    rail_link,
    two_level_stages,
)
from .links import (
    ALLREDUCE_ALGORITHMS,
    DEFAULT_TREE_EFFICIENCY,
    Link,
    all_gather_time,
    allreduce_time,
    broadcast_time,
    crossover_bytes,
    reduce_scatter_time,
    reduce_time,
)
from .predict import (
    PREDICT_ALGORITHMS,
    choose_exact_algorithm,
    explain_allreduce,
    node_profile,
    predict_all_gather,
    predict_allreduce,
    predict_param_sync,
    predict_reduce_scatter,
    predict_two_level,
    rail_profile,
)
from .profile import PRESETS, PROFILE_FORMAT, Profile, default_copy_gbps, get_preset, preset_for_backend
from .steptime import PLACEMENTS, SCHEDULES, StepTime, simulate, step_time
from .streaming import (
    APPLY_PASSES,
    DEFAULT_COPY_S_PER_BYTE,
    SYNC_COPIES,
    fragments_per_step,
    inter_bytes_per_rank,
    launch_copy_bytes,
    sync_stalls,
)

__all__ = [
    "compression",
    "nccl",
    "validation",
    "predict_allreduce",
    "explain_allreduce",
    "predict_reduce_scatter",
    "predict_all_gather",
    "predict_two_level",
    "predict_param_sync",
    "node_profile",
    "rail_profile",
    "PREDICT_ALGORITHMS",
    "Link",
    "Profile",
    "StepTime",
    "LinkFit",
    "ALLREDUCE_ALGORITHMS",
    "FLAT_ALGORITHMS",
    "SCHEDULES",
    "PLACEMENTS",
    "PROFILE_FORMAT",
    "DEFAULT_TREE_EFFICIENCY",
    "PRESETS",
    "allreduce_time",
    "reduce_scatter_time",
    "all_gather_time",
    "broadcast_time",
    "reduce_time",
    "rail_link",
    "flat_allreduce_time",
    "hierarchical_allreduce_time",
    "two_level_stages",
    "param_sync_time",
    "crossover_bytes",
    "flat_crossover_bytes",
    "simulate",
    "step_time",
    "fit_link",
    "fit_net_latency",
    "fit_nccl_profile",
    "fit_switch_tiers",
    "get_preset",
    "preset_for_backend",
    "default_copy_gbps",
    "choose_exact_algorithm",
    "INTRA_ALGORITHMS",
    "intra_algorithm_for_backend",
    "APPLY_PASSES",
    "SYNC_COPIES",
    "launch_copy_bytes",
    "DEFAULT_COPY_S_PER_BYTE",
    "fragments_per_step",
    "sync_stalls",
    "inter_bytes_per_rank",
]

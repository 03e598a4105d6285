"""Checkpointing of a front-end's state (DDP or FSDP2): what resumes the schedule bit for bit.

The local-SGD state (fp32 anchor, outer momentum, corrections in flight) is kept by
*registry position*: the order in which the hook first sees parameters (DDP's initial
bucket order). To map it back before the hook has seen anything (a ``load_state_dict``
right after a restart, then ``synchronize()`` or a shape check), the checkpoint also
records each position's index in ``model.parameters()`` when the state knows the model
(:func:`hiersync.register`, or after ``synchronize(model)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .localsgd import follows_shard

if TYPE_CHECKING:
    from .averagers import ChunkState, ChunkStore
    from .frontend import SyncState

__all__ = [
    "save",
    "load",
    "bootstrap_registry",
    "check_loaded_shapes",
    "model_positions",
    "shard_state",
    "load_shards",
    "bind_loaded",
    "backup",
    "FORMAT",
]

logger = logging.getLogger(__name__)

FORMAT = "hiersync.HierState/2"
_REQUIRED = ("step", "period", "warmup_steps", "world_size", "averager", "in_flight")
_COUNTERS = ("steps", "exact_steps", "local_steps", "sync_steps", "nonfinite_skips", "nonfinite_sync_skips")


def save(state: SyncState) -> dict[str, Any]:
    """Everything needed to continue the schedule exactly: save it with the model and optimizer.

    Syncs in flight are finished first (their completion updates the anchor and
    momentum saved here) and saved as corrections still to apply. Collective when a
    sync step's average is still owed (it is launched here, as on every other node).
    """
    for lv in state.levels:
        lv.engine.launch_due()
    windows = state.windows
    if windows is not None and state.engine.in_flight and state.step != windows.start:
        raise RuntimeError(
            f"hiersync: a checkpoint at step {state.step}, inside window {windows.window}, with syncs in flight under "
            "pace='adaptive': the nodes stand at different steps of the window, and a node's syncs in flight end only "
            "when every node launched them; save when a window opens (state.window just changed), or use overlap=0"
        )
    engine = state.engine.state()
    lower = {lv.level.name: lv.engine.state() for lv in state.levels[:-1]}
    return {
        "format": FORMAT,
        "frontend": state.FRONTEND,
        "step": state.step,
        "period": state.period,
        "warmup_steps": state.warmup_steps,
        "world_size": state.world_size,
        "nodes": [list(n) for n in state.topology.nodes],
        "param_shapes": [tuple(p.shape) for p in state.registry.params],
        "model_positions": model_positions(state),
        **engine,
        "levels": lower,
        "stats": state.stats.as_dict(),
    }


def load(state: SyncState, state_dict: dict[str, Any]) -> None:
    """Restore from :meth:`state_dict`. Call before the first backward after a restart.

    A checkpoint from another model raises ``ValueError`` here when the state knows the
    model (:func:`hiersync.register`), else at the end of the first backward.
    """
    if isinstance(state_dict, dict) and state_dict.get("format") == "hiersync.HierState/1":
        raise ValueError(
            "this hiersync state_dict was saved by an older hiersync (format 'hiersync.HierState/1'), whose "
            "local-SGD state this version does not read: resume it with that version, or call "
            "state.synchronize(model) there, save the model and optimizer, and start a fresh HierState"
        )
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        raise ValueError(
            "not a hiersync HierState state_dict (missing or wrong 'format' key, expected "
            f"{FORMAT!r}); pass what state.state_dict() returned"
        )
    missing = [k for k in _REQUIRED if k not in state_dict]
    if missing:
        raise ValueError(f"corrupt hiersync state_dict: missing keys {missing}")
    frontend = state_dict.get("frontend", state.FRONTEND)
    if frontend != state.FRONTEND:
        raise ValueError(
            f"this hiersync state_dict was saved by the {frontend!r} front-end, but this state is the "
            f"{state.FRONTEND!r} one: its local-SGD state is laid out differently; call state.synchronize(model) "
            "before saving and start a fresh state instead"
        )
    if state_dict["world_size"] != state.world_size:
        raise ValueError(
            f"hiersync state_dict was saved with world size {state_dict['world_size']} but this job has "
            f"{state.world_size}; local-SGD state (anchor, pending corrections) cannot be remapped: call "
            "state.synchronize(model) before saving and start a fresh HierState instead"
        )
    step = state_dict["step"]
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"corrupt hiersync state_dict: step={step!r}")
    if (state_dict["period"], state_dict["warmup_steps"]) != (state.period, state.warmup_steps):
        logger.warning(
            "hiersync: checkpoint had period=%s warmup=%s, continuing with period=%s warmup=%s",
            state_dict["period"],
            state_dict["warmup_steps"],
            state.period,
            state.warmup_steps,
        )
    loaded = {
        "shapes": [tuple(s) for s in state_dict.get("param_shapes") or []],
        "positions": state_dict.get("model_positions"),
    }
    # Check before anything is changed: a failed load leaves the state as it was.
    if state.registry.params:
        _check_shapes(loaded, state.registry.params)
    elif state._model is not None and loaded["positions"]:
        _params_in_saved_order(loaded, state._model)
    # unchecked facts wait for the model (synchronize) or the first backward
    state._loaded = None if state.registry.params else loaded
    state.engine.load(state_dict["averager"], state_dict["in_flight"], state_dict.get("tally"))
    saved_levels = state_dict.get("levels") or {}
    for lv in state.levels[:-1]:
        got = saved_levels.get(lv.level.name)
        lv.engine.load(got["averager"], got["in_flight"]) if got else lv.engine.load({}, [])
    state.step = step
    state.resume_windows(step, saved_tally=state_dict.get("tally"))
    state._kind = None
    state._stepped_for = step
    saved = state_dict.get("stats") or {}
    for k in _COUNTERS:
        if k in saved:
            setattr(state.stats, k, saved[k])
    if state._model is not None:
        bootstrap_registry(state, state._model)


def bootstrap_registry(state: SyncState, model: torch.nn.Module) -> None:
    """Before the first backward: register ``model``'s parameters in the checkpoint's order."""
    loaded = state._loaded
    if loaded is None or state.registry.params or not loaded["positions"]:
        return
    state.registry.register(_params_in_saved_order(loaded, model))  # binds anchor and momentum
    state._loaded = None


def check_loaded_shapes(state: SyncState) -> None:
    loaded, state._loaded = state._loaded, None
    if loaded:
        _check_shapes(loaded, state.registry.params)


def _params_in_saved_order(loaded: dict[str, Any], model: torch.nn.Module) -> list[torch.Tensor]:
    params = list(model.parameters())
    positions = loaded["positions"] or []
    if len(set(positions)) != len(positions) or not all(0 <= j < len(params) for j in positions):
        raise ValueError(
            f"hiersync state_dict refers to parameter {max(positions, default=0)} of a model with "
            f"{len(params)} parameters: the checkpoint is from a different model"
        )
    ordered = [params[j] for j in positions]
    _check_shapes(loaded, ordered)
    return ordered


def _check_shapes(loaded: dict[str, Any], params: list[torch.Tensor]) -> None:
    mine = [tuple(p.shape) for p in params]
    if loaded["shapes"] and loaded["shapes"] != mine:
        raise ValueError(
            f"hiersync state_dict parameter shapes {loaded['shapes'][:4]}... do not match this model's "
            f"{mine[:4]}...: the checkpoint is from a different model"
        )


def model_positions(state: SyncState) -> list[int] | None:
    """Each registry position's index in ``model.parameters()``, or None without a model."""
    if state._model is None or not state.registry.params:
        return None
    where = {id(p): j for j, p in enumerate(state._model.parameters())}
    positions = [where.get(id(p)) for p in state.registry.params]
    if any(j is None for j in positions):
        return None
    return [int(j) for j in positions if j is not None]


# ---------------------------------------------------------------- a rank's shards (averagers.ChunkStore)
KEPT = ("anchor", "momentum", "residual", "reduced_residual")
"""What a chunk keeps between syncs (and checkpoints)."""


def shard_state(store: ChunkStore) -> dict[str, Any]:
    """This rank's shards of each chunk's kept state, copied: they are updated in place by later
    syncs, and a host-resident (``state_device="cpu"``) copy may still be in flight from the device."""
    if store.state_device is not None and store.state_device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies into pinned memory have landed

    def saved(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to("cpu", copy=True)

    def outer(c: ChunkState) -> dict[str, Any]:  # an outer_optimizer's state: its tensors copied, counts as they are
        if c.outer is None:
            return {}
        return {"outer": {k: saved(v) if isinstance(v, torch.Tensor) else v for k, v in c.outer.items()}}

    return {
        "kind": type(store).__name__,
        "split": store.split,
        "index": store.index,
        "chunks": [
            {"indices": list(c.indices)} | {key: saved(getattr(c, key)) for key in KEPT} | outer(c)
            for c in store.by_key.values()
            if any(getattr(c, key) is not None for key in KEPT) or c.outer is not None
        ],
    }


def load_shards(store: ChunkStore, state: dict[str, Any]) -> None:
    """Hold ``state``'s shards until their chunks appear (:func:`bind_loaded`); checked first."""
    mine = (type(store).__name__, store.split, store.index)
    theirs = (state.get("kind", mine[0]), state.get("split", store.split), state.get("index", store.index))
    if state.get("chunks") and theirs != mine:  # checked before anything changes
        raise ValueError(
            f"this hiersync state_dict holds the shards of local rank {theirs[2]} ({theirs[0]}, chunks split "
            f"{theirs[1]} ways), but this is local rank {store.index} ({mine[0]}, split {store.split} ways): every "
            "rank must save and load its own state.state_dict() (or call state.synchronize(model) and start a "
            "fresh state)"
        )
    store.by_key.clear()
    store.loaded = list(state.get("chunks") or [])


def backup(c: ChunkState) -> Callable[[], None]:
    """Copy the state ``c`` keeps between syncs; the callable puts it back (a dropped window)."""
    saved = {key: getattr(c, key).clone() for key in KEPT if getattr(c, key) is not None}
    outer = (
        None if c.outer is None else {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.outer.items()}
    )

    def restore() -> None:  # into the persistent (possibly pinned) buffers where they exist
        for key in KEPT:
            now, old = getattr(c, key), saved.get(key)
            if old is None or now is None or now.shape != old.shape:
                setattr(c, key, old)
            else:
                now.copy_(old)
        c.outer = outer  # the outer optimizer's state as the window found it

    return restore


def _loaded_outer(store: ChunkStore, v: Any, device: torch.device) -> Any:
    """A saved value of an outer optimizer's state, as the chunk keeps it (a buffer where the anchor is)."""
    if follows_shard(v):
        return store.stored(v.to(device=device, copy=True))
    return v.clone() if isinstance(v, torch.Tensor) else v


def bind_loaded(store: ChunkStore, c: ChunkState) -> None:
    """A chunk appears: take its saved shards."""
    device = store.device_of(c)
    for saved in store.loaded:
        if tuple(saved["indices"]) == c.indices:
            for key in KEPT:
                t = saved.get(key)
                if t is not None:
                    if t.numel() != c.s and key != "reduced_residual":
                        raise ValueError(
                            f"hiersync state_dict {key} shard of parameters {list(c.indices)[:4]} has "
                            f"{t.numel()} values, this model needs {c.s}: the checkpoint is from a different model"
                        )
                    dtype = t.dtype if key.endswith("residual") else torch.float32  # a codec keeps its own
                    setattr(c, key, store.stored(t.to(device=device, dtype=dtype, copy=True)))
            if saved.get("outer") is not None:  # a shard's buffers to its device; a step count stays on the host
                c.outer = {k: _loaded_outer(store, v, device) for k, v in saved["outer"].items()}
            break

"""Optimizer-state averaging across nodes (``average_optimizer_state=("exp_avg",)``).

At each sync the named tensors of the optimizer's state (AdamW's ``exp_avg``, ...) are
averaged across nodes with the parameters they belong to: the same chunks, the same rail
sharding, blocking or as corrections in flight, in the same checkpoints. Between syncs
every node's optimizer follows its own gradients, as its parameters do; without this the
nodes' moments stay apart forever, and a node's next steps after a sync are driven by its
own history only (docs/local-sgd.md, "Optimizer state").

The state tensors are averaged plainly (no anchor, no outer step): in fp32, or in bf16
when ``compress`` is set (block codes are for the parameters' deltas; the state is sent
as values, and its own rounding error does not accumulate across windows).

:class:`WithOptimizerState` wraps the parameters' averager and implements the same
:class:`~hiersync.sync.Averager` interface, so the engine does not know the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .averagers import RailAverager, ReplicatedNodeAverager, ShardedNodeAverager
from .futures import when_all
from .sync import Launched

__all__ = ["WithOptimizerState", "with_optimizer_state"]


class _StateTensors:
    """Position ``i`` holds ``optimizer.state[param_i][name]`` (looked up at every use: loading
    an optimizer's state_dict replaces its tensors)."""

    registry: Any

    def _bind(self, optimizer: torch.optim.Optimizer, name: str) -> None:
        self.optimizer, self.name = optimizer, name
        self._absent: dict[int, torch.Tensor] = {}  # a parameter not stepped yet: zeros, writes dropped

    def local(self, i: int) -> torch.Tensor:
        p = self.registry.params[i]
        state = self.optimizer.state.get(p)
        if not state:
            shape = (p.to_local() if hasattr(p, "to_local") else p).shape
            t = self._absent.get(i)
            if t is None or t.shape != shape:
                t = self._absent[i] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            return t
        t = state.get(self.name)
        if not isinstance(t, torch.Tensor) or t.numel() != p.numel():
            keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == p.numel())
            raise ValueError(
                f"average_optimizer_state={self.name!r}: {type(self.optimizer).__name__}'s state has no tensor "
                f"{self.name!r} per parameter (it has {keys}); name one of those"
            )
        return t.to_local() if hasattr(t, "to_local") else t


class _ReplicatedState(_StateTensors, ReplicatedNodeAverager):
    pass


class _ShardedState(_StateTensors, ShardedNodeAverager):
    pass


@dataclass
class _Launches(Launched):
    parts: list[Launched] | None = None


class WithOptimizerState:
    """The parameters' averager, plus one averager per optimizer-state name on the same chunks.

    A chunk's shard (its target, its correction) is the parameters' shard followed by each
    state tensor's, concatenated in that order.
    """

    def __init__(self, params: RailAverager, states: list[RailAverager]) -> None:
        self.base = params
        self.states = states
        self.all = [params, *states]

    def chunk_bytes(self, indices: Sequence[int]) -> list[int]:
        return self.base.chunk_bytes(indices)

    def capture(self, chunks: Callable[[], Sequence[Sequence[int]]]) -> None:
        self.base.capture(chunks)

    def backup(self, indices: Sequence[int]) -> Callable[[], None]:
        return self.base.backup(indices)  # the state tensors' averages keep nothing between syncs

    def shard_numel(self, indices: Sequence[int]) -> int:
        return sum(a.shard_numel(indices) for a in self.all)

    def _split(self, indices: Sequence[int], flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, [a.shard_numel(indices) for a in self.all]))

    def launch(self, indices: Sequence[int]) -> Launched:
        parts = [a.launch(indices) for a in self.all]
        return _Launches(tuple(indices), parts[0].future, parts=parts)

    def complete(self, launched: Launched) -> torch.Tensor:
        assert isinstance(launched, _Launches) and launched.parts is not None
        return torch.cat([a.complete(p) for a, p in zip(self.all, launched.parts)])

    def write(self, indices: Sequence[int], shard: torch.Tensor, add: bool = False) -> None:
        for a, part in zip(self.all, self._split(indices, shard)):
            a.write(indices, part, add)

    def launch_correction(self, indices: Sequence[int]) -> torch.futures.Future:
        futures = [a.launch_correction(indices) for a in self.all]
        return when_all(futures, self.base.local(indices[0]).device, "the cross-node correction and its state")

    def add_correction(self, indices: Sequence[int], correction: Any) -> None:
        for a, part in zip(self.all, correction):
            a.add_correction(indices, part)

    def own_shard(self, indices: Sequence[int], correction: Any) -> torch.Tensor:
        return torch.cat([a.own_shard(indices, part) for a, part in zip(self.all, correction)])

    def state(self) -> dict[str, Any]:
        return self.base.state()  # the state tensors' averages keep nothing between syncs

    def load(self, state: dict[str, Any]) -> None:
        self.base.load(state)

    def trim(self) -> None:
        for a in self.all:
            a.trim()

    def release(self) -> None:
        for a in self.all:
            a.release()


def with_optimizer_state(
    params: RailAverager, optimizer: torch.optim.Optimizer, names: Sequence[str], comm: Any, compress: Any
) -> WithOptimizerState:
    """Wrap ``params`` (a node of replicas or a sharded node) to average ``names`` of ``optimizer``'s state too."""
    kind = _ShardedState if isinstance(params, ShardedNodeAverager) else _ReplicatedState
    raw = torch.bfloat16 if compress is not None else None
    states: list[RailAverager] = []
    for name in names:
        state = kind(comm, params.registry, raw_dtype=raw, state_device=None)
        state._bind(optimizer, name)
        states.append(state)
    return WithOptimizerState(params, states)

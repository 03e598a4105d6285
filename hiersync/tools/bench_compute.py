"""The two compute models of ``python -m hiersync bench``: the models every rank trains.

* ``cpu``: the MLP (or the small transformer) computes on the CPU;
* ``accel``: accelerator-like. Each layer has ``torch.nn.Linear``'s parameters, but its forward
  sleeps a set time and its backward twice that with the CPU idle, as a host is while its GPU
  runs the kernels, and then produces exact gradients of a cheap function with O(width^2)
  memory-bound work (:func:`accel_linear`), so DDP, hiersync and torchft move exactly the
  bytes they move for the CPU model.

:func:`build_model` returns ``(model, data_fn, loss_fn)``; :data:`SLEPT` counts what the
accel layers asked to sleep and what they slept.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

__all__ = ["accel_linear", "build_model", "SLEPT"]


def _accel_function():
    """The autograd function of :class:`AccelLinear` (built lazily: this module imports torch lazily)."""
    global _ACCEL_FN
    if _ACCEL_FN is not None:
        return _ACCEL_FN
    import torch

    class _SleepLinear(torch.autograd.Function):
        """``y = x + b + (W @ mean_n x) / sqrt(width)``: sleeps, then does O(width^2) memory-bound work.

        The weight term uses the batch mean of ``x`` treated as a constant, so the exact
        gradients are cheap: ``dW = outer(sum_n g, mean_n x) / sqrt(width)`` (a full
        width x width tensor, like a linear layer's), ``db = sum_n g``, ``dx = g``.
        """

        @staticmethod
        def forward(ctx: Any, x: Any, weight: Any, bias: Any, fwd_s: float, bwd_s: float) -> Any:
            _sleep(fwd_s)  # the device computes; the host is idle
            xbar = x.detach().mean(0)
            scale = 1.0 / math.sqrt(weight.shape[1])
            ctx.save_for_backward(xbar)
            ctx.scale, ctx.bwd_s = scale, bwd_s
            return x + bias + torch.mv(weight, xbar).mul_(scale)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            (g,) = grads
            _sleep(ctx.bwd_s)
            (xbar,) = ctx.saved_tensors
            gsum = g.sum(0)
            return g, torch.outer(gsum, xbar).mul_(ctx.scale), gsum, None, None

    _ACCEL_FN = _SleepLinear
    return _SleepLinear


_ACCEL_FN: Any = None
SLEPT = {"asked": 0.0, "slept": 0.0}
"""Seconds the accel layers asked to sleep and actually slept (wake-up latency on a busy machine)."""


def _sleep(seconds: float) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    SLEPT["asked"] += seconds
    SLEPT["slept"] += time.perf_counter() - t0


def accel_linear(width: int, fwd_ms: float, bwd_ms: float) -> Any:
    """A layer with ``torch.nn.Linear(width, width)``'s parameters whose compute is a sleep.

    Forward sleeps ``fwd_ms`` and backward ``bwd_ms`` with the CPU idle, as a host does
    while its accelerator runs the kernels; the gradients are real (exact for the cheap
    function the layer computes, see ``_SleepLinear``) and have the shapes and bytes of a
    linear layer's, so DDP and hiersync move exactly what they move for the CPU model.
    """
    import torch

    fn = _accel_function()

    class AccelLinear(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn.apply(x, self.weight, self.bias, fwd_ms / 1e3, bwd_ms / 1e3)

    return AccelLinear(width, width)


def build_model(name: str, config: dict, compute: str = "cpu"):
    import torch

    if compute not in ("cpu", "accel"):
        raise ValueError(f"compute={compute!r} is not known; use 'cpu' or 'accel'")
    if compute == "accel" and name != "mlp":
        raise ValueError(f"the accel compute model is built for the mlp only, not {name!r}")
    if name == "mlp":
        depth = int(config["mlp_depth"])
        width = max(8, int(round(math.sqrt(float(config["mlp_params"]) / depth))))
        layers: list[torch.nn.Module] = []
        # a slow testbed node (testbed --slow NODE=FACTOR) runs its layers 1 / FACTOR as long
        fwd_ms = float(config.get("accel_layer_ms", 25.0)) / float(os.environ.get("HIERSYNC_TESTBED_SPEED", 1.0))
        for i in range(depth):
            if compute == "accel":
                layers.append(accel_linear(width, fwd_ms, 2 * fwd_ms))
                continue
            layers.append(torch.nn.Linear(width, width))
            if i < depth - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        batch = int(config["batch_size"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(out, y)

        return model, data, loss_fn
    if name == "transformer":
        t = config["transformer"]
        vocab, dim, seq = int(t["vocab"]), int(t["dim"]), int(t["seq"])

        class TinyLM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(vocab, dim)
                self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
                layer = torch.nn.TransformerEncoderLayer(dim, int(t["heads"]), 4 * dim, dropout=0.0, batch_first=True)
                self.blocks = torch.nn.TransformerEncoder(layer, int(t["layers"]), enable_nested_tensor=False)
                self.head = torch.nn.Linear(dim, vocab)

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(self.embed(tokens) + self.pos))

        batch = int(t["batch"])

        def data(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
            return tokens[:, :-1], tokens[:, 1:]

        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))

        return TinyLM(), data, loss_fn
    raise ValueError(f"model={name!r} is not known; use 'mlp' or 'transformer'")

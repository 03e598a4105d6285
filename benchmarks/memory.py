"""Peak extra memory per rank of hiersync's local-SGD modes.

Each mode runs in fresh processes on 2 emulated nodes x 2 ranks (gloo, loopback): an MLP
of 8 layers of 1024 x 1024 (8.4M parameters, 32 MiB of fp32), DDP, 12 steps. A rank's peak resident memory
(``ru_maxrss``) minus that of the same run at ``period=1`` is the memory the mode adds;
it is printed in units of the fp32 parameter bytes (P). SGD everywhere but in the
``*_adamw*`` modes (AdamW, against ``p1_adamw``), which price ``average_optimizer_state``.

The budget of docs/design.md, judged on the streaming modes of :data:`BUDGETED` (the worst
rank): extra peak <= 3/L x P (L = 2 here, so 1.5 P). A FAIL line and exit status 1 when a
mode is over it. The int8/int4 modes carry their error-feedback residuals (bf16: a 1/L shard
per rank and the 1/(L N) piece it re-encodes) within it.

    python benchmarks/memory.py            # every mode: about 4 minutes on 2 cores (14 modes x 2 runs)
    python benchmarks/memory.py --check    # the budgeted modes and p1 only: about 2 minutes

Allocations of 64 KiB or more are mmap'd (mallopt), so freed tensors leave the
resident set and the peak measures live memory; differences below ~0.1 P are noise.
"""

from __future__ import annotations

import argparse
import resource
import sys

MODES = {
    "ddp": dict(),
    "p1": dict(period=1),
    "p4": dict(period=4),
    "p4_bf16": dict(period=4, compress="bf16"),
    "p4_overlap_bf16_outer": dict(period=4, overlap=True, compress="bf16", outer_lr=0.7, outer_momentum=0.9),
    "p4_stream_bf16_outer": dict(period=4, fragments=4, overlap=1, compress="bf16", outer_lr=0.7, outer_momentum=0.9),
    "p4_stream_bf16": dict(period=4, fragments=4, overlap=1, compress="bf16"),
    "p4_stream_int8": dict(period=4, fragments=4, overlap=1, compress="int8"),
    "p4_stream_int4": dict(period=4, fragments=4, overlap=1, compress="int4"),
    "p4_stream_int4_no_ef": dict(period=4, fragments=4, overlap=1, compress="int4", error_feedback=False),
    "p4_stream_int4_outer": dict(period=4, fragments=4, overlap=1, compress="int4", outer_lr=0.7, outer_momentum=0.9),
    # AdamW modes: the baseline is p1 with AdamW (its own moments, 2 P, are not the mode's)
    "p1_adamw": dict(period=1),
    "p4_stream_adamw": dict(period=4, fragments=4, overlap=1),
    "p4_stream_adamw_exp_avg": dict(period=4, fragments=4, overlap=1, average_optimizer_state=("exp_avg",)),
}
ADAMW = {m for m in MODES if "adamw" in m}
"""Modes trained with AdamW (lr 1e-3) instead of SGD, measured against ``p1_adamw``."""
BUDGETED = ("p4_stream_bf16_outer", "p4_stream_int8", "p4_stream_int4", "p4_stream_int4_outer")
"""Modes judged against the budget of 3/L x P."""
NODE_IDS = [0, 0, 1, 1]
L = 2  # ranks per node of NODE_IDS


def _exact_rss() -> None:
    """Make freed tensors leave the resident set: every allocation >= 64 KiB is its own mmap.

    glibc's default raises its mmap threshold as large blocks are freed, after which
    freed tensors stay in the heap and peak RSS measures the allocator, not the program.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixed: no dynamic adjustment)
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD


def _rank(mode: str, width: int, layers: int, steps: int) -> dict:
    _exact_rss()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hiersync

    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())]
    model = torch.nn.Sequential(*blocks)
    ddp = DDP(model)
    if mode in ADAMW:
        opt: torch.optim.Optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if MODES[mode]:
        hiersync.register(ddp, opt, **MODES[mode])
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, width, generator=g)
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    return {"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "param_bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    from hiersync._table import render
    from hiersync.tools.launch import run

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    ap.add_argument("--layers", type=int, default=8, help="MLP layers (default 8: 8.4M parameters)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode; the lowest peak counts")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--check", action="store_true", help="run p1 and the budgeted modes only: " + ", ".join(BUDGETED))
    args = ap.parse_args(argv)
    modes = ["p1", *BUDGETED] if args.check else [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "p1" not in modes or (ADAMW & set(modes) and "p1_adamw" not in modes):
        ap.error(
            f"--modes must include p1 (and p1_adamw with AdamW modes: the baselines) and only known modes; "
            f"unknown: {unknown}"
        )
    peaks: dict[str, list[float]] = {}
    P = 0
    for _ in range(args.repeats):
        for mode in modes:
            res = run(_rank, len(NODE_IDS), (mode, args.width, args.layers, args.steps), node_ids=NODE_IDS, timeout=300)
            P = res[0]["param_bytes"]
            best = [min(a, r["peak"]) for a, r in zip(peaks.get(mode, [float("inf")] * 4), res)]
            peaks[mode] = best
    print(
        f"fp32 parameter bytes P = {P / 2**20:.1f} MiB; 2 nodes x 2 ranks; extra peak RSS per rank vs period=1 "
        "with the same optimizer (SGD; AdamW for the *_adamw* modes)"
    )
    extra = {  # per rank, in units of P, over the baseline with the same optimizer
        mode: [(a - b) / P for a, b in zip(pk, peaks["p1_adamw" if mode in ADAMW else "p1"])]
        for mode, pk in peaks.items()
    }
    head, *body = render(
        ["mode", "worst rank", "mean"], [[mode, f"{max(e):.2f}", f"{sum(e) / len(e):.2f}"] for mode, e in extra.items()]
    ).splitlines()
    print("\n".join([f"{head}  (units of P)", *body]))
    budget, failed = 3 / L, []
    for mode in BUDGETED:
        if mode in extra:
            worst = max(extra[mode])
            if worst > budget:
                failed.append(mode)
            print(f"{'PASS' if worst <= budget else 'FAIL'}: {mode} <= 3/L = {budget:.2f} P ({worst:.2f} P)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    raise SystemExit(main())

"""The path of one blocking period-k sync through hiersync's modules, traced.

Two emulated nodes of two ranks (gloo, loopback), DDP (or FSDP2 inside the node),
``hiersync.register(model, opt, period=2)``: the second sync step's ``optimizer.step()`` is
traced (the first also builds the fragment layout) with ``sys.setprofile`` on rank 0 from the
update on (the guard's verdict before it is every step's, not the sync's), and every
call of a hiersync function is recorded. Printed: the modules the sync enters
(in order of first entry), the number of module-to-module hops (a call from a function of
one module into another's, and the return), and the calls per module. The walk of a sync a
newcomer has to follow is the list of modules that call into others (the walk); the others
are leaves (a counter, a flag, a predicate) read in passing; the hops say how often the
reader jumps.

    python benchmarks/sync_path.py [--compress bf16] [--outer] [--fragments 1] [--fsdp]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.distributed as dist

import hiersync
from hiersync.tools.launch import run


def _trace(options: dict, fsdp: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if fsdp:  # FSDP2 inside the node: every rank holds its shard of each parameter
        from torch.distributed.fsdp import fully_shard

        mesh = hiersync.node_mesh()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    state = hiersync.register(ddp, opt, period=2, **options)
    x = torch.randn(4, 8) + dist.get_rank()
    enters: list[str] = []
    hops = 0
    where: list[str] = []
    functions: dict[str, set[str]] = collections.defaultdict(set)
    calls_out: set[str] = set()  # modules that call into another hiersync module

    def profile(frame, event, arg):
        nonlocal hops
        if event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("hiersync"):
            return
        if event == "call":
            if where and where[-1] != module:
                hops += 1
                calls_out.add(where[-1])
            where.append(module)
            enters.append(module)
            functions[module].add(frame.f_code.co_name)
        elif where:
            left = where.pop()
            if where and where[-1] != left:
                hops += 1

    tracing = [False]
    # Registered after hiersync's own pre-hook (the non-finite guard's verdict, read before every
    # update, sync step or not): the trace starts once the update begins and holds the sync.
    opt.register_step_pre_hook(lambda *_: sys.setprofile(profile) if tracing[0] else None)
    for step in range(4):
        ddp(x).sum().backward()
        tracing[0] = step == 3  # the second sync step (period 2, no warm-up): the first binds the layout
        opt.step()
        sys.setprofile(None)
        opt.zero_grad()
    state.close()
    order = list(dict.fromkeys(enters))
    return {
        "modules": order,
        "hops": hops,
        "calls": dict(collections.Counter(enters)),
        "functions": {m: sorted(f) for m, f in functions.items()},
        "spine": [m for m in order if m in calls_out],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compress", default=None, help="bf16, fp16, int8 or int4 (default: fp32)")
    parser.add_argument("--outer", action="store_true", help="with the outer Nesterov step (lr 0.7, momentum 0.9)")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 inside each node (default: DDP)")
    args = parser.parse_args(argv)
    options: dict = {"compress": args.compress, "fragments": args.fragments}
    if args.outer:
        options.update(outer_lr=0.7, outer_momentum=0.9)
    result = run(_trace, 4, (options, args.fsdp), node_ids=[0, 0, 1, 1], timeout=120)[0]
    front = "FSDP2" if args.fsdp else "DDP"
    print(
        f"one blocking sync after optimizer.step() ({front}, {options}): "
        f"{len(result['modules'])} modules, {result['hops']} hops"
    )
    spine = result["spine"]
    print(
        f"the walk (modules that call into another): {len(spine)}; "
        f"leaves (only called: a counter, a flag, a predicate): {len(result['modules']) - len(spine)}"
    )
    for module in result["modules"]:
        kind = "walk" if module in spine else "leaf"
        print(f"  {module:<22} {kind}  {result['calls'][module]:>4} calls  {', '.join(result['functions'][module])}")


if __name__ == "__main__":
    main()

"""``python -m hiersync <command>``: one entry point, each command in its own module.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is
imported only when its command runs, so ``python -m hiersync plan`` never imports
``torch.distributed`` and the benchmark's plotting libraries load only for ``bench``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

__all__ = ["main"]

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "hiersync.tools.bench",
        "benchmark schedules x bucket sizes side by side (default: emulated 2x2 cluster)",
    ),
    "collbench": ("hiersync.tools.collbench", "nccl-tests-like collective microbenchmark per level"),
    "testbed": ("hiersync.tools.testbed", "run a script on an emulated multi-node cluster (netns + shaped link)"),
    "ft-testbed": (
        "hiersync.tools.ft_testbed",
        "torchft manager mode: kill (and restart) a node of a running job, print every node's loss curve",
    ),
    "chaos": (
        "hiersync.tools.chaos",
        "torchft manager mode on many emulated nodes, a fault every few seconds: goodput and invariants",
    ),
    "check": (
        "hiersync.tools.check",
        "day-one cluster check under torchrun: topology, parity with DDP, bandwidth, memory, profile",
    ),
    "calibrate": ("hiersync.tools.calibrate", "measure alpha/beta per level and write a JSON profile"),
    "plan": ("hiersync.costmodel.planner_cli", "predict step communication time and recommend bucket size and k"),
    "project": ("hiersync.costmodel.projection", "tabulate and plot predicted times for 8..1024 GPUs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m hiersync", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    # Parse only the command name here; the module parses the rest with its own parser.
    head = []
    for a in argv:
        head.append(a)
        if a in COMMANDS:
            break
    ns = parser.parse_args(head)
    if ns.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module_name, help_ = COMMANDS[ns.command]
    module = importlib.import_module(module_name)
    cmd_parser = argparse.ArgumentParser(prog=f"python -m hiersync {ns.command}", description=help_)
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[len(head) :])
    try:
        return int(module.run(args) or 0)
    except (ValueError, TypeError, ImportError) as err:  # a user's error names its fix: no traceback
        if ns.verbose:
            raise
        print(f"{cmd_parser.prog}: error: {err} (-v for the traceback)", file=sys.stderr)
        return 2

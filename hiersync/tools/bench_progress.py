"""The launcher's side of ``python -m hiersync bench``: the progress bar and what the run ran on."""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["ProgressFile", "environment"]

logger = logging.getLogger(__name__)


class ProgressFile:
    """Feeds rank 0's per-step lines into a tqdm bar (or the log when tqdm is missing)."""

    def __init__(self, path: Path, total: int) -> None:
        self.path = path
        self.pos = 0
        self.done = 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, unit="step", desc="bench", file=sys.stderr, dynamic_ncols=True, mininterval=0.5
            )
        except ImportError:
            self.bar = None
        self.total = total
        self.last_log = 0.0

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return
        lines = chunk.split("\n")
        complete = lines[:-1]
        self.pos += sum(len(x) + 1 for x in complete)
        if not complete:
            return
        self.done += len(complete)
        label = complete[-1].split("\t")[0]
        if self.done > self.total:  # rows time more steps than --steps when theirs are fast (--min-seconds)
            self.total = self.done
            if self.bar is not None:
                self.bar.total = self.total
        if self.bar is not None:
            self.bar.update(len(complete))
            self.bar.set_postfix_str(label)
        elif time.monotonic() - self.last_log > 10:
            self.last_log = time.monotonic()
            logger.info("bench: %d/%d steps (%s)", self.done, self.total, label)

    def close(self) -> None:
        self.poll()
        if self.bar is not None:
            self.bar.close()


def environment() -> dict:
    """What the run ran on: torch, Python, the platform, the CPUs."""
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "hostname": platform.node(),
    }

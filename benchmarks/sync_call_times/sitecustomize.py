"""Host time of hiersync's after-step sync calls, inside every rank of a bench run.

With this folder on ``PYTHONPATH`` every Python process imports this file at start-up
(as ``sitecustomize``); when ``HIERSYNC_CALL_TIMES`` names a folder it wraps, with
``time.perf_counter`` timers, the calls that make up what a sync costs the host after
``optimizer.step()``:

* ``CrossNodeSync.apply_corrections``: applying the corrections that are due (all of it);
* ``CrossNodeSync.launch_overlapped``: launching the next overlapped or streaming sync;
* ``ReplicatedNodeAverager.write``: the node gather (blocking) and the copy or add into the
  parameters (the apply path of blocking syncs);
* ``ReplicatedNodeAverager.add_correction``: the add of a correction the node gathered early.

Each process writes ``<pid>.json`` there after every ``apply_corrections``. Run the bench with
it, then summarize (per rank process: calls that did any work, i.e. took over 0.1 ms, and
their median and max in ms)::

    HIERSYNC_CALL_TIMES=/tmp/calls PYTHONPATH=benchmarks/sync_call_times \\
        python -m hiersync bench --compute accel --steps 8 --schedules hiersync_p4_stream,intra_only \\
        --profile none --no-plots
    python benchmarks/sync_call_times/sitecustomize.py /tmp/calls

A measurement helper, not part of the library: it patches classes at import time.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

_OUT = os.environ.get("HIERSYNC_CALL_TIMES")
_TIMES: dict[str, list[float]] = {}


def _dump() -> None:
    assert _OUT is not None
    with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as f:
        json.dump(_TIMES, f)


def _timed(cls: type, name: str) -> None:
    orig = getattr(cls, name, None)
    if orig is None:  # an older hiersync without this call
        return
    key = f"{cls.__name__}.{name}"

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            _TIMES.setdefault(key, []).append(time.perf_counter() - t0)
            if name == "apply_corrections":
                _dump()  # ranks may end with os._exit: no atexit

    setattr(cls, name, wrapper)


def _install() -> None:
    os.makedirs(_OUT, exist_ok=True)  # type: ignore[arg-type]
    from hiersync.averagers import ReplicatedNodeAverager
    from hiersync.sync import CrossNodeSync

    for cls, name in (
        (CrossNodeSync, "apply_corrections"),
        (CrossNodeSync, "launch_overlapped"),
        (ReplicatedNodeAverager, "write"),
        (ReplicatedNodeAverager, "add_correction"),
    ):
        _timed(cls, name)


def summarize(folder: str) -> None:
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".json"):
            continue
        with open(os.path.join(folder, fname)) as f:
            times = json.load(f)
        parts = []
        for key, values in sorted(times.items()):
            work = sorted(v * 1000 for v in values if v > 1e-4)
            if work:
                parts.append(f"{key} {len(work)} calls, median {statistics.median(work):.1f} max {work[-1]:.1f} ms")
        print(f"pid {fname[:-5]}: " + ("; ".join(parts) or "no calls"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} FOLDER (the HIERSYNC_CALL_TIMES of a bench run)")
    summarize(sys.argv[1])
elif _OUT:
    _install()

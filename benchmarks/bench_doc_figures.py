"""The figures docs/architecture.md quotes from a measurement, measured again and compared with the doc.

* The path of one blocking period-k sync (``benchmarks/sync_path.py``): the modules it enters,
  in order, and its module-to-module hops, for DDP and the variants the doc names (FSDP2,
  streaming, a codec, the outer step, int8 with the outer step). Every configuration is traced
  5 times, all in one launch of 2 emulated nodes x 2 ranks (gloo, loopback): a few seconds.
* The number of in-process cases of the sync engine's test (``tests/test_sync_engine.py``),
  counted by pytest's collection.

The numbers are read from the doc's prose: a change that moves one fails here until the doc
says the new figure (and a rewording that loses one fails too, naming what is missing).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import sync_path

from hiersync.tools.launch import run

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}  # sync_path.py --outer
# sync_path.py's options per configuration the doc quotes (its command-line flags in the comment)
CONFIGS = {
    "ddp": ({"compress": None, "fragments": 1}, False),  # (no flags)
    "fsdp": ({"compress": None, "fragments": 1}, True),  # --fsdp
    "streaming": ({"compress": None, "fragments": 2}, False),  # --fragments 2
    "bf16": ({"compress": "bf16", "fragments": 1}, False),  # --compress bf16
    "outer": ({"compress": None, "fragments": 1, **OUTER}, False),  # --outer
    "int8_outer": ({"compress": "int8", "fragments": 1, **OUTER}, False),  # --compress int8 --outer
}
# The doc's "about N hops (a few more or fewer from run to run)": a callback chained on a future
# that is already complete runs on the calling thread, the only one traced, or on another; each
# such callback moves the count by 2 (its call and its return), and only ever adds hops. Measured
# on a loaded 2-core box: the fewest hops of a configuration are the same in every launch, and a
# trace adds 2-6 to them (DDP) or 18 (int8 with the outer step, in 1 to 3 traces of 5 under load).
# So each configuration is traced REPEATS times and the fewest hops, the walk without callbacks
# that happened to run on the traced thread, are compared with the doc's, within HOP_SLACK.
REPEATS = 5
HOP_SLACK = 4


def _prose(path: Path) -> str:
    return " ".join(path.read_text().split())


def _find(pattern: str, text: str) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"{ARCHITECTURE.relative_to(ROOT)} no longer says /{pattern}/"
    return m


def _trace_all(repeats: int) -> dict:
    """Every rank traces each configuration ``repeats`` times in turn (rank 0's traces are returned)."""
    return {
        name: [sync_path._trace(options, fsdp) for _ in range(repeats)] for name, (options, fsdp) in CONFIGS.items()
    }


@pytest.fixture(scope="module")
def traced() -> dict:
    """Per configuration: the modules the sync enters (the same in every trace) and the fewest hops."""
    result = run(_trace_all, 4, (REPEATS,), node_ids=[0, 0, 1, 1], timeout=180)[0]
    out = {}
    for name, traces in result.items():
        modules = [[m.removeprefix("hiersync.") for m in t["modules"]] for t in traces]
        assert all(sorted(m) == sorted(modules[0]) for m in modules), (name, modules)
        out[name] = (modules[0], min(t["hops"] for t in traces))
    return out


def test_the_sync_walk_is_the_docs(traced):
    text = _prose(ARCHITECTURE)
    m = _find(r"the sync enters (\d+) modules with about (\d+) module-to-module hops", text)
    doc = {"ddp": (int(m[1]), int(m[2]))}
    names = re.findall(r"`(\w+)`", _find(r"only that thread is traced\): ((?:`\w+`, )*`\w+`)\.", text)[1])
    m = _find(r"FSDP2 inside the node \(`--fsdp`\): the same (\d+), about (\d+) hops", text)
    doc["fsdp"] = (int(m[1]), int(m[2]))
    m = _find(r"streaming \(`--fragments 2`\): (\d+), (\d+)\.", text)
    doc["streaming"] = (int(m[1]), int(m[2]))
    codec = _find(r"A codec adds `(\w+)` \(bf16: (\d+) modules\)", text)
    outer = _find(r"the outer step `(\w+)\.outer_step` \((\d+)\)", text)
    m = _find(r"int8 with the outer step: (\d+) modules, (\d+) hops", text)
    doc["int8_outer"] = (int(m[1]), int(m[2]))

    modules, _ = traced["ddp"]
    assert modules == names, "the modules the sync enters, in order of first entry"
    assert len(names) == doc["ddp"][0]
    for name, (count, hops) in doc.items():
        got_modules, got_hops = traced[name]
        assert len(got_modules) == count, (name, got_modules)
        assert abs(got_hops - hops) <= HOP_SLACK, f"{name}: {got_hops} hops traced, the doc says about {hops}"
    assert traced["fsdp"][0] == traced["streaming"][0] == names  # "the same" modules
    # a codec adds its module, the outer step its own, each once beside the DDP walk
    assert sorted(traced["bf16"][0]) == sorted([*names, codec[1]]) and len(traced["bf16"][0]) == int(codec[2])
    assert sorted(traced["outer"][0]) == sorted([*names, outer[1]]) and len(traced["outer"][0]) == int(outer[2])
    assert sorted(traced["int8_outer"][0]) == sorted([*names, codec[1], outer[1]])


def test_the_engines_case_count_is_the_docs():
    doc = int(_find(r"`tests/test_sync_engine\.py`: (\d+) cases", _prose(ARCHITECTURE))[1])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "",
         "tests/test_sync_engine.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    collected = int(re.search(r"^(\d+) tests? collected", out.stdout, re.MULTILINE)[1])
    assert collected == doc, f"tests/test_sync_engine.py has {collected} cases; docs/architecture.md says {doc}"

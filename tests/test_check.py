"""``python -m hiersync check``: the memory model (pure), and one quick run on an emulated 2x2 cluster.

The run goes through ``python -m hiersync testbed`` (network namespaces and a shaped link
as root, plain loopback otherwise) with ``HIERSYNC_NODE_KEY`` naming the testbed's node
variable, the way a Slurm or Kubernetes job would name its nodes. About 15 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from hiersync import costmodel as cm
from hiersync.tools import check


def test_memory_model_follows_the_docs():
    rows = {r["mode"]: r for r in check.memory_rows(8, 7e9)}
    assert rows["period=1 (exact)"]["bytes"] == 0
    assert rows["k>1, compress=bf16"]["fraction_of_P"] == pytest.approx(1 / 8)
    assert rows["k>1, bf16 + outer Nesterov"]["bytes"] == pytest.approx(2 / 8 * 4 * 7e9)
    # overlap: the node's fp32 buffer of the whole model in flight, and the rank's bf16 payload of its shard
    assert rows["k>1, overlap, bf16 + outer"]["fraction_of_P"] == pytest.approx(2 / 8 + 1 + 1 / 16)
    # streaming k=4 F=4 tau=1: one fragment in flight, over the design's 3/L budget at L = 8 > F
    stream = rows["k=4 F=4 tau=1, bf16 + outer"]["fraction_of_P"]
    assert stream == pytest.approx(2 / 8 + 1 / 4 + 1 / 16 / 4) and stream > 3 / 8
    F16 = {r["mode"]: r for r in check.memory_rows(8, 7e9, period=16, fragments=16)}["k=16 F=16 tau=1, bf16 + outer"]
    assert F16["fraction_of_P"] == pytest.approx(2 / 8 + 1 / 16 + 1 / 16 / 16) and F16["fraction_of_P"] <= 3 / 8
    assert all(r["bytes"] is None for r in check.memory_rows(2))


def test_check_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    with pytest.raises(ValueError, match="torchrun"):
        check.run(parser.parse_args(["--quick"]))


def test_quick_check_on_the_emulated_cluster(tmp_path):
    out, prof = tmp_path / "check.json", tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "hiersync", "testbed", "--nodes", "2", "--procs-per-node", "2", "--timeout", "90"]
    cmd += ["--", "-m", "hiersync", "check", "--quick", "--rails", "1", "--params", "7e9"]
    cmd += ["--out", str(out), "--profile", str(prof)]
    env = dict(os.environ, HIERSYNC_NODE_KEY="HIERSYNC_TESTBED_NODE")
    env.pop("HIERSYNC_NODE_IDS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    assert "topology: 2x2 (2 nodes, 2 ranks per node at most, 2 rails, world 4" in text
    assert "detected from HIERSYNC_NODE_KEY=HIERSYNC_TESTBED_NODE" in text
    assert "layout warnings: none" in text
    assert "PASS  period=1 vs DDP all-reduce" in text
    assert "PASS  period=2 local SGD invariants" in text
    assert "algbw GB/s" in text and "busbw GB/s" in text
    for op in ("intra", "rails", "rail0 alone", "rail1 alone"):
        assert any(line.strip().startswith(op) and "1 MiB" in line for line in text.splitlines()), op
    assert "26.1 GiB" in text  # anchor + momentum shards, 2/L of 7e9 fp32 parameters
    assert text.rstrip().endswith(f"wrote {out}")
    report = json.loads(out.read_text())
    assert report["ok"] and report["topology"]["node_ranks"] == [[0, 1], [2, 3]]
    assert {r["op"] for r in report["bandwidth"]} == {"intra", "rails", "rail0 alone", "rail1 alone"}
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in report["bandwidth"])  # p = 2: factor 1
    profile = cm.Profile.load(prof)  # what `python -m hiersync plan --profile` reads
    assert (profile.nodes, profile.ranks_per_node, profile.rails, profile.backend) == (2, 2, 1, "gloo")
    assert profile.inter.beta > 0  # 1 MiB takes far longer than 4 KiB through the shaped link

"""The emulated cluster: namespaces built and always removed, failures and Ctrl-C, loopback fallback.

Tests that build namespaces need root and iproute2 and are skipped elsewhere. Scripts
launched here do not import torch (only the torchrun agents do), to stay quick.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hiersync.tools import netns, testbed
from hiersync.tools.testbed import IFNAME, Testbed, TestbedError, parse_rate

needs_netns = pytest.mark.skipif(not testbed.emulation_available()[0], reason=testbed.emulation_available()[1])


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _procs_running(marker: str) -> list[int]:
    """Pids whose command line mentions ``marker`` (a path unique to one test)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                pids.append(int(entry))
    return pids


def test_bad_arguments_name_the_value():
    assert parse_rate("800mbit") == 800e6
    assert parse_rate("100mbps") == 800e6  # tc's bps is bytes per second
    with pytest.raises(ValueError, match="'fast'"):
        Testbed(inter_rate="fast")
    with pytest.raises(ValueError, match="nodes=0"):
        Testbed(nodes=0)
    with pytest.raises(ValueError, match="procs_per_node=-1"):
        Testbed(procs_per_node=-1)
    with pytest.raises(ValueError, match="'soon'"):
        Testbed(latency="soon")


@needs_netns
def test_namespaces_are_built_shaped_and_removed():
    with Testbed(nodes=2, procs_per_node=1, inter_rate="800mbit") as tb:
        assert tb.emulated and tb.ifname == IFNAME
        names = list(tb.namespaces) + [tb.switch_namespace]
        assert set(names) <= _netns()
        qdisc = subprocess.run(
            ["tc", "-n", tb.namespaces[1], "qdisc", "show", "dev", IFNAME], capture_output=True, text=True, timeout=20
        ).stdout
        assert "tbf" in qdisc and "800Mbit" in qdisc
        addr = subprocess.run(
            ["ip", "-n", tb.namespaces[0], "addr", "show", IFNAME], capture_output=True, text=True, timeout=20
        ).stdout
        assert "198.18.0.1/" in addr and tb.node_addr(1) == "198.18.0.2"
        # The host's own namespace is untouched: the veths live in the testbed's namespaces only.
        host = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20).stdout
        assert IFNAME not in host
    assert not set(names) & _netns()
    assert not any((Path("/etc/netns") / n).exists() for n in names)


@needs_netns
def test_failing_node_kills_the_others_and_cleans_up(tmp_path):
    script = tmp_path / "fail_on_node1.py"
    script.write_text(
        "import os, sys, time\nif os.environ['HIERSYNC_TESTBED_NODE'] == '1':\n    sys.exit(3)\ntime.sleep(3600)\n"
    )
    with Testbed(nodes=2, procs_per_node=1) as tb:
        # node 0 would sleep an hour: only the failure of node 1 ends the launch
        with pytest.raises(TestbedError, match="node 1"):
            tb.launch([str(script)], timeout=3600, log_dir=tmp_path)
        assert all(not netns.ns_pids(ns) for ns in tb.namespaces)
        names = list(tb.namespaces)
    assert not set(names) & _netns()
    assert not _procs_running(str(script))


@needs_netns
def test_sigint_removes_namespaces_and_processes(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'started-' + os.environ['RANK']).touch()\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "hiersync", "testbed", "--nodes", "2", "--procs-per-node", "1", "--", str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("started-*"))) < 2:
            assert proc.poll() is None, f"testbed exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        ours = {n for n in _netns() if n.startswith(f"{testbed.NS_PREFIX}{proc.pid}-")}
        assert len(ours) == 3  # two nodes and the switch
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        # generous: on 2 loaded cores torchrun's agents can take a while to stop
        assert proc.wait(timeout=90) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        # Never leave anything behind, even when an assertion here fails: the torchrun
        # agents (their --rdzv-id names this testbed) and the namespaces.
        stray = _procs_running(f"{testbed.NS_PREFIX}{proc.pid}-") + _procs_running(str(script))
        for pid in stray:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        leaked = {n for n in _netns() if n.startswith(f"{testbed.NS_PREFIX}{proc.pid}-")}
        for n in leaked:
            subprocess.run(["ip", "netns", "del", n], check=False)
    assert not leaked
    assert not stray
    assert not _procs_running(str(script))


def test_falls_back_to_loopback_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(testbed, "emulation_available", lambda: (False, "no root in this test"))
    script = tmp_path / "env.py"
    script.write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(tmp_path)!r}, 'rank-' + os.environ['RANK']).write_text("
        "os.environ['GROUP_RANK'] + ' ' + os.environ['GLOO_SOCKET_IFNAME'] + ' ' + os.environ['MASTER_ADDR'])\n"
    )
    with caplog.at_level(logging.WARNING, logger="hiersync.tools.testbed"), Testbed(nodes=2, procs_per_node=1) as tb:
        assert not tb.emulated and tb.ifname == "lo" and tb.node_addr(1) == "127.0.0.1"
        assert "NOT shaped" in tb.describe()
        tb.launch([str(script)], timeout=90, log_dir=tmp_path)
    assert "NOT shaped" in caplog.text and "no root in this test" in caplog.text
    seen = sorted((tmp_path / f"rank-{r}").read_text() for r in range(2))
    # One torchrun agent per emulated node: distinct GROUP_RANKs, so Topology.detect() sees two nodes.
    assert seen == ["0 lo 127.0.0.1", "1 lo 127.0.0.1"]


def test_slow_nodes_are_checked_and_parsed():
    assert testbed.parse_slow(["1=0.5", "0=0.25,2=1"], 3) == {1: 0.5, 0: 0.25, 2: 1.0}
    assert testbed.parse_slow(None, 2) == {}
    for bad in ("1=0", "2=0.5", "1", "x=0.5", "1=1.5"):
        with pytest.raises(ValueError, match="NODE=FACTOR"):
            testbed.parse_slow(bad, 2)
    with pytest.raises(ValueError, match="0 < factor <= 1"):
        Testbed(nodes=2, slow={1: 2.0})
    tb = Testbed(nodes=2, procs_per_node=1, slow={1: 0.5})
    assert tb.node_env(1)["HIERSYNC_TESTBED_SPEED"] == "0.5" and "HIERSYNC_TESTBED_SPEED" not in tb.node_env(0)
    assert "node 1 at 0.5x speed" in tb.describe()


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/cpu", os.W_OK), reason="needs a writable cgroup v1 cpu controller")
def test_a_slow_node_computes_at_its_factor(tmp_path):
    # each node spins for 1.5 s of wall time and counts its loops: a node capped at 0.25 of its
    # share of the CPUs counts well under half of what the uncapped node does
    script = tmp_path / "spin.py"
    script.write_text(
        "import os, time\n"
        "t0, n = time.perf_counter(), 0\n"
        "while time.perf_counter() - t0 < 1.5:\n"
        "    n += 1\n"
        f"open(os.path.join({str(tmp_path)!r}, 'node' + os.environ['HIERSYNC_TESTBED_NODE'] + '.count'), 'w')"
        ".write(f\"{n} {os.environ.get('HIERSYNC_TESTBED_SPEED', '1')}\")\n"
    )
    with Testbed(nodes=2, procs_per_node=1, loopback=True, slow={1: 0.25}) as tb:
        tb.launch([str(script)], timeout=120, log_dir=tmp_path / "logs")
        groups = list(Path("/sys/fs/cgroup/cpu").glob(f"{tb.tag}-node*"))
    fast, fast_speed = (tmp_path / "node0.count").read_text().split()
    slow, slow_speed = (tmp_path / "node1.count").read_text().split()
    assert (fast_speed, slow_speed) == ("1", "0.25")
    assert int(slow) < 0.5 * int(fast), (slow, fast)
    assert not groups, groups  # removed when the launch ended

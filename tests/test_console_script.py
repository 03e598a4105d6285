"""The installed ``hiersync`` command, run as a user runs it (a subprocess, the console script pip wrote)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_console_script_names_a_function_that_exists():
    """pyproject's [project.scripts] entry resolves (a module that moved breaks it here, not for a user)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["hiersync"]
    module, _, name = target.partition(":")
    assert callable(getattr(import_module(module), name)), target


def _command() -> str:
    found = shutil.which("hiersync", path=os.path.dirname(sys.executable)) or shutil.which("hiersync")
    if found is None:
        pytest.skip("no hiersync command on PATH (install with pip install -e .)")
    return found


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--help"], "plan"),
        (
            [
                "plan",
                "--preset",
                "a100-1nic",
                "--params",
                "1e9",
                "--nodes",
                "4",
                "--forward-ms",
                "50",
                "--backward-ms",
                "100",
            ],
            "register(",
        ),
    ],
    ids=["help", "plan"],
)
def test_the_installed_command_runs(args, expect):
    out = subprocess.run([_command(), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expect in out.stdout, out.stdout[-2000:]

from __future__ import annotations

import subprocess
import sys

import autoscale


def test_module_entry_prints_version() -> None:
    out = subprocess.run([sys.executable, "-m", "autoscale", "--version"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == autoscale.__version__


def test_usage_error_exits_2() -> None:
    out = subprocess.run([sys.executable, "-m", "autoscale", "--bogus"], capture_output=True, text=True, check=False)
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr

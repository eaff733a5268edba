"""`tiered demo --protocol`, the one-agent protocol tour, keeps passing its own checks."""

from __future__ import annotations

import subprocess
import sys


def test_the_demo_passes_every_check():
    result = subprocess.run([sys.executable, "-m", "tiered", "demo", "--protocol"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Demo passed: 6/6 checks" in result.stdout
    assert "mJ per inference above idle (" in result.stdout

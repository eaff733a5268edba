"""One `tiered up` per state directory: a second one says the system is
already running (naming its pid) before it starts anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiered.errors import ConfigError
from tiered.local.supervisor import LocalSystem, LocalUp


def test_a_second_up_on_a_state_directory_in_use_says_so_and_starts_nothing(tmp_path):
    first = LocalUp(LocalSystem(state_dir=str(tmp_path)), tmp_path)
    first.layout.create()
    first._take_lock()
    try:
        second = LocalUp(LocalSystem(state_dir=str(tmp_path)), tmp_path)
        with pytest.raises(ConfigError, match=f"already running on {tmp_path} "
                           f"\\(tiered up, pid {os.getpid()}\\)"):
            second.start()
        assert not second.agents and second.router is None and second.controller is None
        second.stop()  # nothing of its own to stop; the first keeps its lock
        # From the command line: one line, exit code 1, nothing started.
        (tmp_path / "system.yaml").write_text(f"state_dir: {tmp_path}\n")
        done = subprocess.run([sys.executable, "-m", "tiered", "up", "-f",
                               str(tmp_path / "system.yaml")], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 1 and "already running" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / "logs").exists()
    finally:
        first.stop()
    third = LocalUp(LocalSystem(state_dir=str(tmp_path)), tmp_path)
    third._take_lock()  # let go once the first stopped
    third.stop()

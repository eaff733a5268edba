"""A child `tiered` command started with `interruptible()` stops on SIGINT even
when its parent ignores SIGINT (as a shell's background job does); one
started without it inherits the ignored signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tiered.local.processes import interruptible

WAITS = ("import sys, time; from tiered.local.processes import take_sigint; take_sigint(); "
         "print('ready', flush=True); time.sleep(30)")


def started_ignoring_sigint(env=None) -> subprocess.Popen:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
    try:
        child = subprocess.Popen([sys.executable, "-c", WAITS], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_an_interruptible_child_stops_on_sigint_though_started_ignoring_it():
    child = started_ignoring_sigint(interruptible())
    child.send_signal(signal.SIGINT)
    assert child.wait(10) != 0
    assert "KeyboardInterrupt" in child.stderr.read()


def test_without_it_the_ignored_sigint_is_inherited():
    child = started_ignoring_sigint()
    try:
        child.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()

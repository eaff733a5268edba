"""What every --watch loop shares: it ends quietly when its reader goes away
(`| head`) or on Ctrl-C, and notices a closed pipe while it waits, not only
when it next writes.

A pipe's write end polls POLLERR once its reader has closed it (a terminal
that hung up, POLLHUP), so `wait` sleeps in poll(2) on stdout asking for
nothing else: a watch with nothing new to print ends within a look of the
reader going, and never has to write to find out.
"""

from __future__ import annotations

import errno
import os
import select
import sys
import time
from collections.abc import Callable
from typing import TextIO

EXIT_INTERRUPTED = 130  # Ctrl-C ended a --watch, as a shell reports SIGINT


def until_closed(follow: Callable[[], int]) -> int:
    """Run a --watch loop; a closed pipe (`| head`) ends it quietly with 0, Ctrl-C
    with EXIT_INTERRUPTED, neither with a traceback."""
    try:
        return follow()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that
        # flush neither fails nor prints an 'Exception ignored' note.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def closed(out: TextIO | None = None, timeout_s: float = 0.0) -> bool:
    """Whether `out`'s reader has gone (a pipe closed, a terminal hung up),
    waiting up to `timeout_s` for it. False where it cannot be told: no file
    descriptor, no poll(2) (Windows), a regular file or /dev/null."""
    out = sys.stdout if out is None else out
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is None or not hasattr(select, "poll"):
        if timeout_s > 0:
            time.sleep(timeout_s)
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR, POLLHUP and POLLNVAL come whatever is asked
    return bool(poller.poll(max(timeout_s, 0.0) * 1000.0))


def wait(seconds: float, out: TextIO | None = None) -> None:
    """Sleep `seconds` between a watch's looks; BrokenPipeError (which
    `until_closed` ends quietly) as soon as stdout's reader has gone."""
    if closed(out, seconds):
        raise BrokenPipeError(errno.EPIPE, "stdout's reader has gone")

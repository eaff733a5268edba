"""Output with lines that stay and lines that change in place.

On a terminal the live lines (one a key: a rollout's current stage, say) sit
under the output and are redrawn where they are; a line that stays is
written above them. Piped, a live line is printed as a plain line, and only
when what it says changes (its `key`), so a log holds one line per change,
not one per poll. Several threads may write: one lock orders them."""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Hashable
from typing import TextIO


class LiveLines:
    def __init__(self, out: TextIO | None = None, in_place: bool | None = None) -> None:
        self._out = out or sys.stdout
        self._in_place = self._out.isatty() if in_place is None else in_place
        self._live: dict[str, str] = {}
        self._said: dict[str, Hashable] = {}  # piped: what each live line said last
        self._drawn = 0  # live lines on the screen now
        self._lock = threading.Lock()

    @property
    def in_place(self) -> bool:
        """Whether live lines are redrawn where they are (a terminal)."""
        return self._in_place

    def say(self, line: str) -> None:
        """A line that stays."""
        with self._lock:
            self._erase()
            self._out.write(line + "\n")
            self._draw()

    def live(self, name: str, line: str, key: Hashable | None = None) -> None:
        """Set `name`'s live line; piped, print it when `key` (default: the
        line) differs from the last one printed for `name`."""
        with self._lock:
            if not self._in_place:
                key = line if key is None else key
                if self._said.get(name) != key:
                    self._said[name] = key
                    self._out.write(line + "\n")
                    self._out.flush()
                return
            self._erase()
            self._live[name] = line
            self._draw()

    def end(self, name: str) -> None:
        """`name` has no live line any more."""
        with self._lock:
            self._said.pop(name, None)
            if name in self._live:
                self._erase()
                del self._live[name]
                self._draw()

    def _erase(self) -> None:
        if self._drawn:  # to the start of the first live line, and clear below
            self._out.write(f"\033[{self._drawn}F\033[J")
            self._drawn = 0

    def _draw(self) -> None:
        width = shutil.get_terminal_size().columns - 1  # a wrapped line would miscount
        for line in self._live.values():
            self._out.write((line if len(line) <= width else line[:width - 1] + "…") + "\n")
        self._drawn = len(self._live)
        self._out.flush()

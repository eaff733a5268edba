"""The work queue: names due at a time, each queued once, failures backing off."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class WorkQueue:
    """Names due at a time, each queued once; failures back off per name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._failures: dict[str, int] = {}
        self._wake = threading.Condition()

    def add(self, name: str, after_s: float = 0.0) -> None:
        with self._wake:
            due = self._clock() + max(0.0, after_s)
            if name in self._due and self._due[name] <= due:
                return
            self._due[name] = due
            heapq.heappush(self._heap, (due, name))
            self._wake.notify()

    def get(self, stop: threading.Event, poll_s: float = 0.5) -> str | None:
        with self._wake:
            while not stop.is_set():
                while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
                    heapq.heappop(self._heap)  # superseded by an earlier due time
                if self._heap and self._heap[0][0] <= self._clock():
                    _, name = heapq.heappop(self._heap)
                    del self._due[name]
                    return name
                wait = self._heap[0][0] - self._clock() if self._heap else poll_s
                self._wake.wait(min(poll_s, max(0.0, wait)))
        return None

    def done(self, name: str, requeue_after_s: float | None, failed: bool) -> float | None:
        """Requeue as asked, or after the name's next backoff step when it failed."""
        if failed:
            count = self._failures.get(name, 0)
            self._failures[name] = count + 1
            requeue_after_s = BACKOFF_S[min(count, len(BACKOFF_S) - 1)]
        else:
            self._failures.pop(name, None)
        if requeue_after_s is not None:
            self.add(name, requeue_after_s)
        return requeue_after_s

"""What a server learned by asking another, remembered and renewed in the
background: the router's answer to whether a model is decoupled, a front
end's facts of a model from the engine's ModelConfig.

`get` gives what is known of a key. Only a key never asked about waits for
the answer, one question for all its callers; once the answer is older
than `ttl_s` it is asked again in the background, callers meanwhile going
by what was known. A question that fails with a TieredError is not
remembered: its callers get `unknown`. At most `max_keys` answers are
kept, the oldest going first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

from tiered import errors

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Remembered(Generic[K, V]):
    def __init__(self, ask: Callable[[K], Awaitable[V]], clock: Callable[[], float],
                 ttl_s: float, max_keys: int, unknown: V) -> None:
        self.ask = ask
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.unknown = unknown
        self._known: dict[K, tuple[V, float]] = {}  # key -> (answer, when learned)
        self._asking: dict[K, asyncio.Task[V]] = {}

    async def get(self, key: K) -> V:
        known = self._known.get(key)
        if known is None:  # one question for every caller that waits on it
            return await asyncio.shield(self._question(key))
        if self.clock() - known[1] >= self.ttl_s:
            self._question(key)  # asked again; this caller goes by what was known
        return known[0]

    def _question(self, key: K) -> asyncio.Task[V]:
        task = self._asking.get(key)
        if task is None:
            task = self._asking[key] = asyncio.create_task(self._learn(key))
            task.add_done_callback(lambda _: self._asking.pop(key, None))
        return task

    async def _learn(self, key: K) -> V:
        try:
            answer = await self.ask(key)
        except errors.TieredError as error:  # nobody could say: not remembered
            log.debug("%r is not known: %s", key, error)
            return self.unknown
        self._known.pop(key, None)
        if len(self._known) >= self.max_keys:
            del self._known[next(iter(self._known))]
        self._known[key] = (answer, self.clock())
        return answer

    def forget(self, keep: Iterable[K]) -> None:
        """Drop the keys not in `keep` (bounded memory)."""
        kept = set(keep)
        for key in [k for k in self._known if k not in kept]:
            del self._known[key]

    def cancel(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()

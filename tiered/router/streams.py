"""A decoupled model's streamed requests through the router.

`DecoupledModels` says which models answer a streamed request with a stream
of responses: what an agent's ModelConfig says
(`model_transaction_policy.decoupled`), remembered for `DECOUPLED_TTL_S` and
asked again in the background once older (requests meanwhile go by what was
known). Only a model never asked about waits for the answer; one that no
agent can describe is treated as not decoupled and not remembered.

`open_stream` sends one request on a stream of its own to the first
candidate whose stream gives a first response (or ends well with none: a
decoupled model may answer with no response), with `forward`'s failover
rules (down agents passed over, retryable codes fail over within the
deadline); `relay` then gives that agent's responses in order until the
final one (`triton_final_response`). Once a response has gone out, the
request stays on its agent: an agent that fails then ends the request with
UNAVAILABLE (DEADLINE_EXCEEDED when its deadline passed), nothing is
retried. Closing the relay (the client went away) cancels the agent's
stream, which frees the sequence there. Never imports agent code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from tiered import errors
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import routing
from tiered.protocol.messages import FINAL_RESPONSE
from tiered.router import forward, policies

log = logging.getLogger(__name__)

DECOUPLED_TTL_S = 10.0  # how long what an agent said of a model is trusted
MAX_MODELS = 1024  # models remembered at most; the oldest answer goes first
_READY = grpc.ChannelConnectivity.READY


class DecoupledModels:
    """Which models are decoupled, learned with `ask` (model -> decoupled)."""

    def __init__(self, ask: Callable[[str], Awaitable[bool]], clock: Callable[[], float],
                 ttl_s: float = DECOUPLED_TTL_S, max_models: int = MAX_MODELS) -> None:
        self.ask = ask
        self.clock = clock
        self.ttl_s = ttl_s
        self.max_models = max_models
        self._known: dict[str, tuple[bool, float]] = {}  # model -> (decoupled, when learned)
        self._asking: dict[str, asyncio.Task[bool]] = {}

    async def decoupled(self, model: str) -> bool:
        known = self._known.get(model)
        if known is None:  # one question for every request that waits on it
            return await asyncio.shield(self._question(model))
        if self.clock() - known[1] >= self.ttl_s:
            self._question(model)  # asked again; this request goes by what was known
        return known[0]

    def _question(self, model: str) -> asyncio.Task[bool]:
        task = self._asking.get(model)
        if task is None:
            task = self._asking[model] = asyncio.create_task(self._learn(model))
            task.add_done_callback(lambda _: self._asking.pop(model, None))
        return task

    async def _learn(self, model: str) -> bool:
        try:
            decoupled = await self.ask(model)
        except errors.TieredError as error:  # no agent could say: not remembered
            log.debug("whether model %r is decoupled is not known: %s", model, error)
            return False
        self._known.pop(model, None)
        if len(self._known) >= self.max_models:
            del self._known[next(iter(self._known))]
        self._known[model] = (decoupled, self.clock())
        return decoupled

    def forget(self, keep: Iterable[str]) -> None:
        """Drop models that left the routing table (bounded memory)."""
        kept = set(keep)
        for model in [m for m in self._known if m not in kept]:
            del self._known[model]

    def cancel(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()


@dataclass
class Opened:
    """A request's stream to the agent that gave its first response."""

    call: grpc.aio.StreamStreamCall
    first: pb.ModelStreamInferResponse | None  # None: a decoupled model sent none
    candidate: policies.Candidate


async def open_stream(forwarder: forward.Forwarder, request: pb.ModelInferRequest, raw: bytes,
                      candidates: Sequence[policies.Candidate], route: routing.ModelRoute,
                      deadline: float) -> Opened:
    """The request on a stream to the first candidate that answers it; that
    agent's in-flight slot stays taken until `relay` ends."""

    async def attempt(candidate: policies.Candidate, remaining: float) -> Opened:
        call = forwarder.pool.stream(candidate.agent)(
            iter((forward.with_version(request, raw, candidate.version),)),
            timeout=remaining, wait_for_ready=False)
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            if await call.code() != grpc.StatusCode.OK:
                raise errors.Unavailable(f"agent {candidate.agent} ended the stream without "
                                         f"answering the request")
            return Opened(call, None, candidate)  # answered with no response
        return Opened(call, first, candidate)

    return await forwarder.first_to_answer(request.model_name, candidates, route, deadline,
                                           attempt, hold=True)


async def relay(opened: Opened, forwarder: forward.Forwarder
                ) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """The agent's responses in order, in the stream messages they came in
    (passed on as they are, not copied), each naming the tier that served
    it, until the final one; an error the agent sent for the request is
    raised as it is. Closing this early cancels the agent's stream."""
    candidate = opened.candidate
    agent = candidate.agent
    message, relayed, decoupled = opened.first, 0, False
    try:
        while message is not None:
            if message.error_message:
                raise errors.TieredError(f"{message.error_message} (agent {agent})")
            response = message.infer_response
            final = response.parameters.get(FINAL_RESPONSE)
            decoupled = decoupled or final is not None
            response.parameters[forward.SERVED_TIER].string_param = candidate.tier
            yield message
            relayed += 1
            if final is not None and final.bool_param:
                return
            try:
                message = await opened.call.read()
            except grpc.aio.AioRpcError as error:
                raise _failed_midway(forwarder, agent, relayed, error) from None
            if message is grpc.aio.EOF:
                if decoupled:  # its responses say a final one was to come
                    raise errors.Unavailable(
                        f"unavailable: agent {agent} ended the stream after {relayed} "
                        f"response(s) without the final one")
                return
    finally:
        opened.call.cancel()  # after the final response: a no-op; else it frees the sequence
        forwarder.observer.release(agent)


def _failed_midway(forwarder: forward.Forwarder, agent: str, relayed: int,
                   error: grpc.aio.AioRpcError) -> errors.TieredError:
    if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExceeded(f"the request's deadline passed after {relayed} "
                                       f"response(s) (agent {agent})")
    if forwarder.pool.channel(agent).get_state() is not _READY:  # no connection
        forwarder.health.mark_down(agent, f"{error.code().name}: {error.details()}")
    return errors.Unavailable(
        f"unavailable: agent {agent} failed after {relayed} response(s) of the request "
        f"({error.code().name}: {error.details()}); a stream stays on the agent that "
        f"answered it first and is not retried once responses have gone out")

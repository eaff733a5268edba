"""A decoupled model's streamed requests through the router.

`decoupled_models` says which models answer a streamed request with a
stream of responses: what an agent's ModelConfig says
(`model_transaction_policy.decoupled`), remembered for `DECOUPLED_TTL_S`
(`remembered.Remembered`: asked again in the background once older); one
that no agent can describe is treated as not decoupled and not remembered.

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

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from tiered import errors
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import routing
from tiered.protocol.messages import FINAL_RESPONSE
from tiered.protocol.remembered import Remembered
from tiered.router import forward, policies

_READY = grpc.ChannelConnectivity.READY
DECOUPLED_TTL_S = 10.0  # how long what an agent said of a model is trusted
MAX_MODELS = 1024  # models remembered at most; the oldest answer goes first


def decoupled_models(ask: Callable[[str], Awaitable[bool]], clock: Callable[[], float]
                     ) -> Remembered[str, bool]:
    """Whether each model is decoupled, as `ask` learns it (model -> decoupled)."""
    return Remembered(ask, clock, DECOUPLED_TTL_S, MAX_MODELS, unknown=False)


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

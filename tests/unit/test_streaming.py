"""ModelStreamInfer's bounds (tiered.protocol.streaming.answer_stream), on
asyncio alone: an idle stream is ended saying why, a request being answered
keeps it open, and answers a client does not read hold its requests back."""

from __future__ import annotations

import asyncio

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import streaming


async def requests_then_silence(*names: str, closed: asyncio.Event | None = None):
    """These requests, then none: a client that keeps its stream open."""
    for name in names:
        yield pb.ModelInferRequest(model_name=name)
    await (closed or asyncio.Event()).wait()


async def answered(request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    if request.model_name == "slow":
        await asyncio.sleep(0.6)
    return pb.ModelInferResponse(model_name=request.model_name)


async def collect(stream, timeout: float = 5.0) -> list[pb.ModelStreamInferResponse]:
    async def everything():
        return [message async for message in stream]
    return await asyncio.wait_for(everything(), timeout)


def test_an_idle_stream_is_ended_saying_why_after_its_answers():
    async def scenario():
        started = asyncio.get_running_loop().time()
        stream = streaming.answer_stream(requests_then_silence("a", "b"), answered, idle_s=0.3)
        messages = await collect(stream)
        assert [m.infer_response.model_name for m in messages[:2]] == ["a", "b"]
        assert messages[2].error_message == "stream closed: no request for 0.3 s"
        assert len(messages) == 3
        assert asyncio.get_running_loop().time() - started >= 0.3
    asyncio.run(scenario())


def test_a_request_being_answered_keeps_its_stream_open_past_the_idle_time():
    async def scenario():
        loop = asyncio.get_running_loop()
        started = loop.time()
        stream = streaming.answer_stream(requests_then_silence("slow"), answered, idle_s=0.3)
        messages = await collect(stream)
        assert messages[0].infer_response.model_name == "slow"  # answered after 0.6 s
        assert messages[1].error_message.startswith("stream closed")
        assert loop.time() - started >= 0.6 + 0.3  # idle counts from the answer's end
    asyncio.run(scenario())


def test_answers_a_client_does_not_read_hold_back_the_responses_behind_them():
    produced = 0

    async def decoupled(request: pb.ModelInferRequest):
        async def responses():
            nonlocal produced
            for _ in range(10 * streaming.MAX_UNREAD):
                produced += 1
                yield pb.ModelInferResponse(model_name=request.model_name)
        return responses()

    async def scenario():
        closed = asyncio.Event()
        stream = streaming.answer_stream(requests_then_silence("m", closed=closed), decoupled)
        first = await anext(stream)
        assert first.infer_response.model_name == "m"
        await asyncio.sleep(0.2)  # the client reads nothing meanwhile
        assert produced <= streaming.MAX_UNREAD + 2, produced
        closed.set()
        rest = await collect(stream)
        assert 1 + len(rest) == produced == 10 * streaming.MAX_UNREAD  # nothing lost
    asyncio.run(scenario())

"""ModelStreamInfer for any v2 server: answer streamed requests concurrently.

Each request of a stream is answered on its own task, at most `limit` at
once; every answer or error goes back as its own stream message, in the order
answers finish, so one bad request never ends the stream. Used by the agent
and the router alike; `infer` is their unary path, or, for a decoupled
model, gives an async iterator of the request's responses, relayed in order.
When the stream ends early (the client went away), the requests still being
answered are cancelled. Bounded: `limit` requests answered at once, MAX_UNREAD
answers held for a client that does not read them, and a stream idle for
`idle_s` (no request, none being answered) ended with a message saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.status import describe

# A decoupled model's responses may come wrapped already (a generative
# model's are built inside their stream message, saving a copy each).
Infer = Callable[[pb.ModelInferRequest],
                 Awaitable[pb.ModelInferResponse | AsyncIterator[pb.ModelInferResponse]
                           | AsyncIterator[pb.ModelStreamInferResponse]]]

MAX_IN_FLIGHT = 256  # requests of one stream answered at once; more wait to be read
# Answers waiting for a client that does not read them: beyond this, the
# stream's requests wait (and a decoupled model's responses with them).
MAX_UNREAD = 64
# A stream with no request for this long and none being answered is ended,
# saying why: an idle stream holds one of the server's concurrent calls.
IDLE_S = 300.0


async def answer_stream(
    requests: AsyncIterator[pb.ModelInferRequest], infer: Infer, limit: int = MAX_IN_FLIGHT,
    idle_s: float = IDLE_S,
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(MAX_UNREAD)
    slots = asyncio.Semaphore(limit)
    quiet_since = time.monotonic()  # the last request, or the last answer's end

    async def answer(request: pb.ModelInferRequest) -> None:
        try:
            answered = await infer(request)
            if isinstance(answered, pb.ModelInferResponse):
                await answers.put(pb.ModelStreamInferResponse(infer_response=answered))
            else:
                async with contextlib.aclosing(answered):
                    async for response in answered:
                        await answers.put(
                            response if isinstance(response, pb.ModelStreamInferResponse)
                            else pb.ModelStreamInferResponse(infer_response=response))
        except Exception as error:  # reported in the stream; the stream goes on
            await answers.put(pb.ModelStreamInferResponse(
                error_message=describe(error),
                infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                     id=request.id),
            ))
        finally:
            slots.release()
            nonlocal quiet_since
            quiet_since = time.monotonic()

    tasks: set[asyncio.Task] = set()

    async def read() -> None:
        pending = aiter(requests)
        waiting: asyncio.Task | None = None  # the read of the next request, never cut short
        nonlocal quiet_since
        try:
            while True:
                waiting = waiting or asyncio.ensure_future(_next(pending))
                quiet = time.monotonic() - quiet_since
                done, _ = await asyncio.wait({waiting}, timeout=idle_s if tasks
                                             else max(idle_s - quiet, 0.0))
                if not done:
                    if tasks or time.monotonic() - quiet_since < idle_s:
                        continue  # answers still coming, or one just ended
                    await answers.put(pb.ModelStreamInferResponse(
                        error_message=f"stream closed: no request for {idle_s:g} s"))
                    break
                request, waiting = waiting.result(), None
                if request is None:
                    break
                quiet_since = time.monotonic()
                await slots.acquire()
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            if waiting is not None:
                waiting.cancel()
            await answers.put(None)

    reader = asyncio.create_task(read())
    try:
        while (response := await answers.get()) is not None:
            yield response
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()


async def _next(requests: AsyncIterator[pb.ModelInferRequest]) -> pb.ModelInferRequest | None:
    try:
        return await anext(requests)
    except StopAsyncIteration:
        return None

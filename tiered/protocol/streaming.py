"""ModelStreamInfer for any v2 server: answer streamed requests concurrently.

Each request of a stream is answered on its own task, at most `limit` at
once; every answer or error goes back as its own stream message, in the order
answers finish, so one bad request never ends the stream. Used by the agent
and the router alike; `infer` is their unary path, or, for a decoupled
model, gives an async iterator of the request's responses, relayed in order.
When the stream ends early (the client went away), the requests still being
answered are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.status import describe

Infer = Callable[[pb.ModelInferRequest],
                 Awaitable[pb.ModelInferResponse | AsyncIterator[pb.ModelInferResponse]]]


async def answer_stream(
    requests: AsyncIterator[pb.ModelInferRequest], infer: Infer, limit: int
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
    slots = asyncio.Semaphore(limit)

    async def answer(request: pb.ModelInferRequest) -> None:
        try:
            answered = await infer(request)
            if isinstance(answered, pb.ModelInferResponse):
                answers.put_nowait(pb.ModelStreamInferResponse(infer_response=answered))
            else:
                async with contextlib.aclosing(answered):
                    async for response in answered:
                        answers.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
        except Exception as error:  # reported in the stream; the stream goes on
            answers.put_nowait(pb.ModelStreamInferResponse(
                error_message=describe(error),
                infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                     id=request.id),
            ))
        finally:
            slots.release()

    tasks: set[asyncio.Task] = set()

    async def read() -> None:
        try:
            async for request in requests:
                await slots.acquire()
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            answers.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (response := await answers.get()) is not None:
            yield response
    finally:
        reader.cancel()
        for task in list(tasks):
            task.cancel()

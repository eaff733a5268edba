"""ModelStreamInfer for any v2 server: answer streamed requests concurrently.

Each request of a stream is answered on its own task, at most `limit` at
once; every answer or error goes back as its own stream message, in the order
answers finish, so one bad request never ends the stream. Used by the agent
and the router alike; `infer` is their unary path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.status import describe

Infer = Callable[[pb.ModelInferRequest], Awaitable[pb.ModelInferResponse]]


async def answer_stream(
    requests: AsyncIterator[pb.ModelInferRequest], infer: Infer, limit: int
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
    slots = asyncio.Semaphore(limit)

    async def answer(request: pb.ModelInferRequest) -> None:
        try:
            response = pb.ModelStreamInferResponse(infer_response=await infer(request))
        except Exception as error:  # reported in the stream; the stream goes on
            response = pb.ModelStreamInferResponse(
                error_message=describe(error),
                infer_response=pb.ModelInferResponse(model_name=request.model_name,
                                                     id=request.id),
            )
        finally:
            slots.release()
        answers.put_nowait(response)

    async def read() -> None:
        tasks: set[asyncio.Task] = set()
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

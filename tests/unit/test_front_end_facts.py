"""What a front end knows of a model (its ModelConfig, asked of the engine
process): the requests that wait for it share one question, and once what
was learned is stale it is asked again in the background while requests go
by what was known, so that no request waits a round trip for it."""

from __future__ import annotations

import asyncio

from tiered.agent import front_end
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import model_config_pb2 as mc
from tiered.protocol.security import Authorizer


class Engine:
    """The engine process's channel: ModelConfig answers when let through."""

    def __init__(self) -> None:
        self.asked = 0
        self.decoupled = False
        self.answer = asyncio.Event()

    def unary_unary(self, path: str, request_serializer=None, response_deserializer=None):
        async def model_config(request: pb.ModelConfigRequest, timeout: float):
            self.asked += 1
            decoupled = self.decoupled
            await self.answer.wait()
            return pb.ModelConfigResponse(config=mc.ModelConfig(
                name=request.name,
                model_transaction_policy=mc.ModelTransactionPolicy(decoupled=decoupled)))
        return model_config

    def unary_stream(self, path: str):
        return None

    stream_stream = unary_stream


async def settle() -> None:
    for _ in range(10):  # the tasks started run as far as they can
        await asyncio.sleep(0)


def test_a_model_is_asked_about_once_and_stale_facts_are_renewed_in_the_background():
    async def scenario() -> None:
        engine = Engine()
        handlers = front_end._Handlers(None, engine, Authorizer(), None)
        request = pb.ModelInferRequest(model_name="m")
        waiting = [asyncio.ensure_future(handlers._facts(request)) for _ in range(5)]
        await settle()
        assert engine.asked == 1 and not any(w.done() for w in waiting)
        engine.answer.set()
        assert [facts.decoupled for facts in await asyncio.gather(*waiting)] == [False] * 5

        handlers._models.ttl_s = 0.0  # stale from now on
        engine.decoupled, engine.answer = True, asyncio.Event()
        stale = await asyncio.wait_for(handlers._facts(request), 1)  # not waiting
        assert not stale.decoupled and engine.asked == 2
        await handlers._facts(request)  # the question under way is not asked twice
        assert engine.asked == 2
        engine.answer.set()
        await settle()
        handlers._models.ttl_s = 60.0
        assert (await handlers._facts(request)).decoupled and engine.asked == 2

    asyncio.run(scenario())

"""Shadow comparisons of generations, whole or streamed: the canary answers
the same greedy request, and its token ids must be the client's."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.routing import ModelRoute, TierRoute
from tiered.router import counters, forward
from tiered.router.policies import Candidate

ROUTE = ModelRoute(tiers={"edge": TierRoute(agents=("e:1", "e:2"), stable=1, canary=2)})
STABLE = Candidate("edge", "e:1", 1)


class Canary:
    """A pool whose every agent answers with `tokens` and keeps what it was asked."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.asked = tokens, []

    def infer(self, agent: str):
        async def call(request: bytes, timeout: float) -> bytes:
            self.asked.append((agent, pb.ModelInferRequest.FromString(request)))
            response = pb.ModelInferResponse(model_name="m", model_version="2")
            response.outputs.add(name="token_ids", datatype="INT64", shape=[len(self.tokens)])
            response.raw_output_contents.append(np.array(self.tokens, np.int64).tobytes())
            return response.SerializeToString()
        return call


def request(temperature: float | None = None) -> tuple[pb.ModelInferRequest, bytes]:
    message = pb.ModelInferRequest(model_name="m", model_version="1")
    if temperature is not None:
        message.parameters["temperature"].double_param = temperature
    return message, message.SerializeToString()


def shadow(canary_tokens: list[int], client_tokens: tuple[int, ...],
           temperature: float | None = None) -> tuple[dict[str, int], Canary]:
    pool, agreement = Canary(canary_tokens), counters.ShadowAgreement()

    async def run() -> None:
        shadows = forward.Shadows(pool, agreement, random.Random(0))
        message, raw = request(temperature)
        shadows.send_generation(message, raw, lambda: client_tokens, STABLE, ROUTE, 5.0)
        await asyncio.gather(*list(shadows._tasks))

    asyncio.run(run())
    counts = {sample.labels["result"]: sample.value for family in agreement.collect()
              for sample in family.samples if sample.value}
    return counts, pool


@pytest.mark.parametrize(("canary", "client", "result"), [
    ([5, 6, 7], (5, 6, 7), counters.AGREE),
    ([5, 6, 8], (5, 6, 7), counters.DISAGREE),  # one token differs
    ([5, 6], (5, 6, 7), counters.DISAGREE),  # ended sooner
    ([], (5, 6, 7), counters.INCOMPARABLE),  # no tokens: never an agreement
    ([5, 6, 7], (), counters.INCOMPARABLE),
])
def test_a_generation_agrees_only_when_every_token_id_does(canary, client, result):
    counts, pool = shadow(canary, client)
    assert counts == {result: 1}
    ((agent, asked),) = pool.asked
    assert agent == "e:1" and asked.model_version == "2"  # the canary, on the same agent


def test_a_sampled_generation_is_counted_incomparable_and_not_sent():
    counts, pool = shadow([5, 6, 7], (5, 6, 7), temperature=0.8)
    assert counts == {counters.INCOMPARABLE: 1} and pool.asked == []

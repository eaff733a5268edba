"""Sequences through a real router in front of two agents of one tier: each
sequence's requests reach the agent its START reached, where its state is.
Without the pin the router spreads requests by load, and a request that
lands on the other agent is refused there (its sequence never started)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.integration.test_sequences import IDLE_US, send, write_model
from tiered.local.processes import AgentProcess, RouterProcess

SEQUENCES = 16  # side by side: both agents take some (all on one: odds 2 in 65,536)
STEPS = (4, 1, 2, 3, 5)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root = tmp_path_factory.mktemp("router-sequences")
    write_model(root)
    config = root / "accumulate" / "config.pbtxt"
    text = config.read_text().replace("max_candidate_sequences: 3",
                                      f"max_candidate_sequences: {SEQUENCES}")
    config.write_text(text.replace(f"max_sequence_idle_microseconds: {IDLE_US}",
                                   "max_sequence_idle_microseconds: 60000000"))
    agents = [AgentProcess("edge", root).start() for _ in range(2)]
    table = root.parent / "routing.json"
    table.write_text(json.dumps({"version": 1, "models": {"accumulate": {"tiers": {
        "edge": {"agents": [agent.address for agent in agents]}}}}}))
    try:
        with RouterProcess(table) as process:
            yield process, agents
    finally:
        for agent in agents:
            agent.stop()


def run_sequence(address: str, sequence_id: int) -> list[int]:
    with grpcclient.InferenceServerClient(address) as client:
        return [send(client, value, sequence_id, start=i == 0, end=i == len(STEPS) - 1)[0]
                for i, value in enumerate(STEPS)]


def test_each_sequence_stays_on_the_agent_its_start_reached(router):
    process, agents = router
    with ThreadPoolExecutor(SEQUENCES) as pool:
        answers = list(pool.map(lambda i: run_sequence(process.address, 100 + i),
                                range(SEQUENCES)))
    sums = [sum(STEPS[:n + 1]) for n in range(len(STEPS))]
    expected = [*sums[:-1], sums[-1] + 1000]  # the END adds 1000
    assert answers == [expected] * SEQUENCES
    served = []
    for agent in agents:
        with grpcclient.InferenceServerClient(agent.address) as client:
            stats = client.get_inference_statistics("accumulate").model_stats[0]
            served.append(stats.inference_stats.success.count)
    assert sum(served) == SEQUENCES * len(STEPS) and min(served) > 0, served


def test_after_its_end_a_sequence_needs_a_start_again(router):
    process, _ = router
    with grpcclient.InferenceServerClient(process.address) as client:
        assert send(client, 2, 77, start=True)[0] == 2
        assert send(client, 3, 77, end=True)[0] == 1005
        with pytest.raises(InferenceServerException, match="START flag"):
            send(client, 1, 77)

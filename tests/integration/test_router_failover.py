"""Failover the client never sees: a real router in front of one real agent
per tier on loopback, driven by the unmodified tritonclient.

A `tiered-tier` hint is a preference: when its tier's only agent is SIGKILLed
the next tier answers (and says so in the response's `tiered-tier`
parameter); `tiered-tier-strict` gets UNAVAILABLE naming the tier. An agent
found without a connection is held down, so later requests do not wait on
it, and is probed back once it serves again on its address. /metrics shows
both. Latency bounds are generous (a busy 2-core machine): what they rule out
is waiting on a dead address until a deadline or a connect timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentProcess, RouterProcess
from tiered.models import zoo
from tiered.router.forward import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S

TIERS = ("edge", "regional", "datacenter")
DEADLINE_S = 20.0  # each request's own; an answer that waited on a dead address nears it
QUICK_S = 5.0  # what "at once" means here: well under the deadline, on a loaded machine


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("failover-repository")
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})
    return root


@pytest.fixture(scope="module")
def agents(repository):
    started = {tier: AgentProcess(tier, repository).start() for tier in TIERS}
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture(scope="module")
def table_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("failover") / "routing.json"


@pytest.fixture(scope="module")
def router(agents, table_path):
    write_table(table_path, 1, {tier: agents[tier].address for tier in TIERS})
    with RouterProcess(table_path) as process:
        process.table_version = 1
        yield process
        assert process.alive(), process.log_tail()


def write_table(path: Path, version: int, addresses: dict[str, str], **model) -> None:
    document = {"version": version, "models": {"mlp": {"tiers": {
        tier: {"agents": [address]} for tier, address in addresses.items()}, **model}}}
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(document))
    os.replace(staging, path)


def use_table(router, path: Path, addresses: dict[str, str], **model) -> None:
    router.table_version += 1
    write_table(path, router.table_version, addresses, **model)
    wait_for(lambda: metrics(router).get("tiered_router_table_version") == router.table_version,
             router, "the router to load the table")


def metrics(router) -> dict[str, float]:
    text = urllib.request.urlopen(router.metrics_url, timeout=5).read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def agent_up(router, address: str, tier: str) -> float | None:
    return metrics(router).get(f'tiered_router_agent_up{{agent="{address}",tier="{tier}"}}')


def failovers(router, tier: str, reason: str) -> float:
    return metrics(router).get(
        f'tiered_router_failovers_total{{model="mlp",reason="{reason}",tier="{tier}"}}', 0.0)


def wait_for(condition, router, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}\n" \
                                            f"{router.log_tail()}"
        time.sleep(0.1)


def inputs() -> list[grpcclient.InferInput]:
    item = grpcclient.InferInput("input", [1, 16], "FP32")
    item.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [item]


def ask(client, **headers) -> tuple[str, float]:
    """The tier that answered (the response's parameter) and the seconds it took."""
    started = time.monotonic()
    result = client.infer("mlp", inputs(), headers=headers, client_timeout=DEADLINE_S)
    return result.get_response().parameters["tiered-tier"].string_param, \
        time.monotonic() - started


def test_an_agent_that_never_answers_costs_one_connect_budget_then_nothing(router, agents,
                                                                           table_path):
    # A listener that never accepts: TCP connects, gRPC's handshake never
    # completes, so its channel stays CONNECTING (gRPC's connect timeout is 20 s).
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        use_table(router, table_path, {"edge": address, "regional": agents["regional"].address})
        with grpcclient.InferenceServerClient(router.address) as client:
            answers = [ask(client, **{"tiered-tier": "edge"}) for _ in range(10)]
        assert {tier for tier, _ in answers} == {"regional"}
        assert max(seconds for _, seconds in answers) < QUICK_S, answers
        # Held down after the first: the other nine went straight to regional.
        assert sum(seconds for _, seconds in answers[1:]) < QUICK_S, answers
        assert agent_up(router, address, "edge") == 0.0
        assert agent_up(router, agents["regional"].address, "regional") == 1.0
        assert failovers(router, "edge", "down") >= 10
    use_table(router, table_path, {tier: agents[tier].address for tier in TIERS})
    assert agent_up(router, address, "edge") is None  # it left the table, and /metrics


def test_a_cascade_starts_at_the_first_tier_that_can_answer(router, agents, table_path):
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        use_table(router, table_path, {"edge": address, "regional": agents["regional"].address,
                                       "datacenter": agents["datacenter"].address},
                  policy="cascade", cascade={"threshold": 0.0})  # the first answer stands
        with grpcclient.InferenceServerClient(router.address) as client:
            answers = [ask(client) for _ in range(10)]
        assert {tier for tier, _ in answers} == {"regional"}
        assert sum(seconds for _, seconds in answers) < QUICK_S + 1.0, answers
        assert agent_up(router, address, "edge") == 0.0
    use_table(router, table_path, {tier: agents[tier].address for tier in TIERS})


def test_a_hung_agent_is_found_by_keepalive_and_its_requests_fail_over(router, agents):
    """SIGSTOP: the agent's socket stays open and its connection READY, and
    nothing answers, not even HTTP/2 pings. The router's keepalive closes the
    connection within seconds: the request waiting on it and those after go
    to the next tier, none waits for its deadline; SIGCONT, and it is probed back."""
    edge = agents["edge"]
    with grpcclient.InferenceServerClient(router.address) as client:
        assert ask(client, **{"tiered-tier": "edge"})[0] == "edge"  # connected
        os.kill(edge.pid, signal.SIGSTOP)
        try:
            answers = [ask(client, **{"tiered-tier": "edge"}) for _ in range(5)]
            assert {tier for tier, _ in answers} == {"regional"}, answers
            # The one waiting on the hung agent: about the keepalive's interval and timeout.
            assert answers[0][1] < KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + QUICK_S, answers
            assert sum(seconds for _, seconds in answers[1:]) < QUICK_S, answers
            assert agent_up(router, edge.address, "edge") == 0.0
        finally:
            os.kill(edge.pid, signal.SIGCONT)
    wait_for(lambda: agent_up(router, edge.address, "edge") == 1.0, router,
             "the router to probe the agent back")
    with grpcclient.InferenceServerClient(router.address) as client:
        assert ask(client, **{"tiered-tier": "edge"})[0] == "edge"


def test_a_killed_hinted_tier_fails_over_and_its_agent_is_probed_back(router, agents,
                                                                      repository):
    edge = agents["edge"]
    with grpcclient.InferenceServerClient(router.address) as client:
        assert ask(client, **{"tiered-tier": "edge"})[0] == "edge"
        assert ask(client, **{"tiered-tier": "edge", "tiered-tier-strict": "true"})[0] == "edge"
    assert agent_up(router, edge.address, "edge") == 1.0

    # Traffic hinted at edge, from four clients, while the edge agent is SIGKILLed.
    answered: list[tuple[str, float]] = []
    failures: list[Exception] = []
    stop = threading.Event()

    def traffic() -> None:
        with grpcclient.InferenceServerClient(router.address) as c:
            while not stop.is_set():
                try:
                    answered.append(ask(c, **{"tiered-tier": "edge"}))
                except InferenceServerException as error:
                    failures.append(error)

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    before_kill = len(answered)
    edge.kill()
    time.sleep(2.0)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not failures, failures[:3]
    after_kill = answered[before_kill:]
    assert len(after_kill) > 10
    assert after_kill[-1][0] == "regional"  # the next tier in the route's order
    assert max(seconds for _, seconds in after_kill) < QUICK_S
    assert agent_up(router, edge.address, "edge") == 0.0
    assert failovers(router, "edge", "down") > 0

    with grpcclient.InferenceServerClient(router.address) as client:
        tiers = [ask(client, **{"tiered-tier": "edge"}) for _ in range(5)]
        assert {tier for tier, _ in tiers} == {"regional"}
        assert sum(seconds for _, seconds in tiers) < QUICK_S, tiers
        # Kept to its tier: a clear UNAVAILABLE naming the tier and why, at once.
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as caught:
            client.infer("mlp", inputs(), client_timeout=DEADLINE_S,
                         headers={"tiered-tier": "edge", "tiered-tier-strict": "true"})
        assert time.monotonic() - started < QUICK_S
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    message = caught.value.message()
    assert "tiered-tier-strict: tier 'edge' cannot take the request" in message
    assert f"agent {edge.address} is down for" in message

    # Back on the same port: probed back, then it takes traffic again.
    restarted = AgentProcess("edge", repository, port=edge.port).start()
    agents["edge"] = restarted  # the fixture stops it
    wait_for(lambda: agent_up(router, edge.address, "edge") == 1.0, router,
             "the router to probe the restarted agent back")
    with grpcclient.InferenceServerClient(router.address) as client:
        assert [ask(client, **{"tiered-tier": "edge"})[0] for _ in range(5)] == ["edge"] * 5
    assert "is up again" in router.log()

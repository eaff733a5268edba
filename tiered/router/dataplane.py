"""The router's data plane: for each request, hints, a policy's ranking, the
calls to agents, and the counts.

It owns the routing table in use and what the router knows and counts
(observer, agents' health and their prober, channel pool, statistics,
metrics, shadow agreement). The choice itself is `policies`' (pure, given
which agents are down); the calls are `forward`'s. The clock and the
rng are injected. Never imports agent or controller code.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import numpy as np

from tiered import errors, names
from tiered.protocol import error_text, messages, routing, security
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol.messages import IMAGE, VISUAL_TOKENS
from tiered.router import (
    counters,
    demand,
    forward,
    health,
    hints,
    observations,
    policies,
    statistics,
    streams,
)
from tiered.router.sequences import SequencePins, sequence_step


class Router:
    """The table in use, what the router knows of its agents, and the routing."""

    def __init__(self, table: routing.RoutingTable, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 transport: security.TransportSecurity = security.PLAINTEXT,
                 agent_token: str | None = None,
                 max_message_bytes: int = forward.MAX_MESSAGE_BYTES,
                 agent_connections: int = forward.AGENT_CONNECTIONS) -> None:
        """`agent_token`: what the router presents to its agents (else nothing
        but its client certificate, under mTLS); `max_message_bytes`: the
        largest message it sends them or takes from them; `agent_connections`:
        the connections to each agent its calls take turns over."""
        self.table = table
        self.rng = rng or random.Random()
        self.clock = clock
        self.observer = observations.Observer(clock)
        self.pool = forward.ChannelPool(transport, agent_token, max_message_bytes,
                                        agent_connections)
        self.agreement = counters.ShadowAgreement()
        self.demand = demand.Demand(clock)  # for tiers scaled to zero
        self.metrics = counters.RouterMetrics(self.agreement)
        self.metrics.table_version.set(table.version)
        self.statistics = statistics.RouterStatistics()
        self.health = health.AgentHealth(clock)
        self.prober = health.Prober(self.health, self.pool.channel)  # run by the server
        self.metrics.agents.watch(agents_by_tier(table), self.health.down)
        self.forwarder = forward.Forwarder(self.pool, self.observer, self.metrics, clock,
                                           self.health)
        self.shadows = forward.Shadows(self.pool, self.agreement, self.rng)
        self.decoupled = streams.decoupled_models(self._ask_decoupled, clock)
        self.pins = SequencePins()  # the agent of each live sequence
        # Candidates per (model, version of each tier): built once per table.
        self._candidates: dict[tuple[str, tuple[int, ...]], list[policies.Candidate]] = {}

    async def use_table(self, table: routing.RoutingTable) -> None:
        self.table = table  # one assignment: a request sees the old table or the new one
        self._candidates = {}
        self.metrics.table_version.set(table.version)
        self.statistics.keep_only(table.models)
        agents = table.agents()
        self.observer.forget(agents)
        self.health.forget(agents)
        self.decoupled.forget(table.models)
        self.observer.keep_models(table.models)
        self.metrics.agents.watch(agents_by_tier(table), self.health.down)
        await self.pool.keep_only(agents)

    def route_of(self, model: str) -> routing.ModelRoute:
        route = self.table.models.get(model)
        if route is None:
            raise errors.NotFound(error_text.unknown_model(model, ": not in the routing table"))
        return route

    async def infer(self, request: pb.ModelInferRequest, raw: bytes,
                    metadata: Sequence[tuple[str, str]] | None, time_remaining: float | None
                    ) -> forward.Answer:
        """Route, forward, count; a model outside the table is NOT_FOUND and
        counted nowhere, any other failure counts in the model's statistics.
        `raw` is `request` as it came: what goes to the agent."""
        started = self.clock()
        model = request.model_name
        table = self.table  # the whole request sees one table
        route = self.route_of(model)
        try:
            hints.refuse_shared_memory(request)
            deadline = hints.deadline(request.parameters, time_remaining, table.timeout_s,
                                      started)
            step = sequence_step(request)
            pinned = step and self.pins.pinned(step)
            if pinned:  # where the sequence's state is: no other agent would do
                answer = await self.forwarder.forward(request, raw, (pinned,), route, deadline)
                choice = None
            else:
                route = await self._awake(request, route, metadata, deadline)
                answer, choice = await self._route(request, raw, route, metadata, deadline)
            if step:
                self.pins.answered(step, answer.candidate)
        except Exception:
            now = self.clock()
            self.statistics.failed(model, now - started, now)
            raise
        now = self.clock()
        version = answer.response.model_version
        tier = answer.candidate.tier
        self.statistics.succeeded(model, version, now - started, now)
        self.metrics.answered(model, tier, version, now - started)
        if route.asleep:
            self._missed_slo(request, route, metadata, tier, now - started)
        # A sequence's requests are never shadowed: the canary holds no state of it.
        if not step and policies.should_shadow(route.tiers[tier], choice, self.rng):
            self.shadows.send(request, raw, answer, route, table.timeout_s)
        return answer

    async def stream(self, request: pb.ModelInferRequest, raw: bytes,
                     metadata: Sequence[tuple[str, str]] | None, time_remaining: float | None
                     ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """A decoupled model's streamed request: ranked as `infer` ranks it,
        sent on a stream to one agent (failover before its first response
        only, `streams`), every response relayed in order. Counted once, when
        its last response has gone; the first one's time is its TTFT. Never
        cascaded (its first agent answers); a generation is shadowed as a whole
        generation is, with the token ids it relayed, once it has ended (other
        decoupled models' streams are not: nothing compares them)."""
        started = self.clock()
        model = request.model_name
        table = self.table
        route = self.route_of(model)
        first: pb.ModelInferResponse | None = None
        relayed: list[pb.ModelInferResponse] = []  # kept when shadowed, read by the shadow
        try:
            hints.refuse_shared_memory(request)
            deadline = hints.deadline(request.parameters, time_remaining, table.timeout_s,
                                      started)
            route = await self._awake(request, route, metadata, deadline)
            wanted, choices, _, ranking, seen = self._rank(request, route, metadata)
            candidates, sent, sent_raw = ranking.candidates, request, raw
            path, vision_s = None, None
            # A live stage's floor put its tier first: unless hinted, whole there.
            if splits(route, request, wanted) and (wanted.split is not None
                                                   or not ranking.floored):
                path, candidates = self._image_path(model, route, wanted, ranking, seen)
                if path.split:
                    encoders = split_encoders(route, choices[path.decoder].version)
                    if encoders:
                        sent, sent_raw, vision_s = await self._split(request, raw, route,
                                                                     encoders, deadline)
                    else:  # the vision tier lacks that version: whole on the decoder's
                        path = policies.ImagePath(path.decoder, path.decoder)
            sending = self.clock()
            try:
                opened = await streams.open_stream(self.forwarder, sent, sent_raw,
                                                   candidates, route, deadline)
            except (errors.Unavailable, errors.ResourceExhausted, errors.DeadlineExceeded) \
                    as error:
                if wanted.strict:
                    raise self._strict_error(error, wanted.tier) from None
                raise
            tier = opened.candidate.tier
            if path is not None and tier == path.decoder:  # not after failing over elsewhere
                self.observer.record_image_path(model, path, self.clock() - sending, vision_s)
            shadowed = policies.should_shadow(route.tiers[tier], choices[tier], self.rng)
            async with contextlib.aclosing(streams.relay(opened, self.forwarder)) as answers:
                async for message in answers:
                    if first is None:
                        first = message.infer_response
                        self.metrics.first_response(model, tier, first.model_version,
                                                    self.clock() - started)
                    if shadowed:
                        relayed.append(message.infer_response)
                    yield message
        except Exception:  # a client that went away is counted nowhere
            now = self.clock()
            self.statistics.failed(model, now - started, now)
            raise
        now = self.clock()
        version = first.model_version if first is not None else ""
        self.statistics.succeeded(model, version, now - started, now)
        self.metrics.answered(model, tier, version, now - started)
        if shadowed and relayed and messages.PROMPT_TOKENS in relayed[0].parameters:
            self.shadows.send_generation(
                request, raw, lambda: tuple(t for r in relayed for t in forward.token_ids(r)),
                opened.candidate, route, table.timeout_s)

    def _image_path(self, model: str, route: routing.ModelRoute,
                    wanted: policies.RouteRequest, ranking: policies.Ranking,
                    seen: policies.Observations
                    ) -> tuple[policies.ImagePath, Sequence[policies.Candidate]]:
        """Split or whole for an image request (`policies.image_path_for`),
        counted, and the candidates to stream to: a split's decoder tier's
        agents (the request will carry visual tokens); else the chosen tier's
        agents that are up, then the ranking's others, for failover."""
        choice = policies.image_path_for(route, ranking.candidates, wanted, seen,
                                         self.observer.image_paths(model))
        self.metrics.chose_path(model, choice.path.split, choice.reason)
        if choice.energy_incomparable and not ranking.energy_incomparable:  # once a request
            self.metrics.ranked_without_energy(model)
        tier = choice.path.decoder
        if choice.path.split:
            return choice.path, [c for c in ranking.candidates if c.tier == tier]
        down = self.health.down
        first = [c for c in ranking.candidates if c.tier == tier and c.agent not in down]
        return choice.path, [*first, *(c for c in ranking.candidates if c not in first)]

    async def _split(self, request: pb.ModelInferRequest, raw: bytes,
                     route: routing.ModelRoute, encoders: Sequence[policies.Candidate],
                     deadline: float) -> tuple[pb.ModelInferRequest, bytes, float]:
        """The request to send the decoder tier: the vision tier's agents
        (`encoders`) encode its image (their vision stage alone, a unary call
        asking for `visual_tokens`), which it then carries in place of the
        image; and the seconds the vision call took."""
        assert route.split is not None
        started = self.clock()
        answer = await self.forwarder.forward(
            request, asking_visual_tokens(request, raw), encoders, route, deadline)
        tokens, token_bytes = answer.response.outputs[0], answer.response.raw_output_contents[0]
        decoder, image_bytes = with_visual_tokens(request, tokens, token_bytes)
        seconds = self.clock() - started
        self.metrics.split(request.model_name, (route.split.vision, route.split.decoder),
                           seconds, image_bytes, len(token_bytes))
        return decoder, decoder.SerializeToString(), seconds

    async def _ask_decoupled(self, model: str) -> bool:
        """Whether the model is decoupled, as the first of its agents to answer
        ModelConfig says."""
        answer = await self.forwarder.first_answer(self.route_of(model), "ModelConfig",
                                                   pb.ModelConfigRequest(name=model))
        return answer.config.model_transaction_policy.decoupled

    async def is_decoupled(self, model: str) -> bool:
        """Whether streamed requests of `model` are answered as a stream
        (False for a model outside the table: `infer` says NOT_FOUND)."""
        return model in self.table.models and await self.decoupled.get(model)

    def _rank(self, request: pb.ModelInferRequest, route: routing.ModelRoute,
              metadata: Sequence[tuple[str, str]] | None
              ) -> tuple[policies.RouteRequest, dict[str, policies.VersionChoice],
                         policies.Policy, policies.Ranking, policies.Observations]:
        """The request's hints, each tier's version, the policy, its ranking
        and what it was ranked on."""
        model = request.model_name
        wanted = hints.read_hints(model, request.parameters, metadata)
        choices = {tier: policies.pick_version(tier_route, wanted.key, self.rng)
                   for tier, tier_route in route.tiers.items()}
        candidates = self.candidates(model, route, choices)
        policy = policies.policy_for(route, wanted)
        # One candidate leaves nothing to rank: no policy's answer can depend on
        # what is known of it, so nothing is read.
        seen = self.observer.snapshot((c.agent for c in candidates), model) \
            if len(candidates) > 1 else {}
        ranking = policies.rank(policy, candidates, wanted, seen, self.rng, self.health.down)
        if ranking.energy_incomparable:
            self.metrics.ranked_without_energy(model)
        if ranking.floored:
            self.metrics.floored(model, ranking.floored)
        for passed in ranking.passed_over:
            self.metrics.failed_over(model, passed.tier, counters.DOWN)
        return wanted, choices, policy, ranking, seen

    async def _awake(self, request: pb.ModelInferRequest, route: routing.ModelRoute,
                     metadata: Sequence[tuple[str, str]] | None, deadline: float
                     ) -> routing.ModelRoute:
        """The route to rank on, after counting the demand for tiers scaled
        to zero (`demand`): a request kept to such a tier, or for a model
        asleep everywhere, waits for it to wake."""
        if not route.asleep:
            return route
        model = request.model_name
        wanted = hints.read_hints(model, request.parameters, metadata)
        if wanted.tier in route.asleep:
            self.demand.wanted(model, wanted.tier)
            if wanted.strict:
                return await self.demand.until_awake(model, wanted.tier, lambda: self.table,
                                                     deadline)
        if not route.tiers:
            if wanted.tier not in route.asleep:
                self.demand.wanted(model, route.asleep[0])  # the cheapest wakes
            return await self.demand.until_awake(model, None, lambda: self.table, deadline)
        return route

    def _missed_slo(self, request: pb.ModelInferRequest, route: routing.ModelRoute,
                    metadata: Sequence[tuple[str, str]] | None, served_by: str,
                    seconds: float) -> None:
        """A request answered slower than its SLO counts as demand for the
        sleeping tiers above the one that answered it (the GPU tiers a
        cheaper tier stood in for): what wakes them when the others miss."""
        wanted = hints.read_hints(request.model_name, request.parameters, metadata)
        slo_ms = wanted.slo_ms if wanted.slo_ms is not None else route.slo_ms
        if seconds * 1e3 <= slo_ms:
            return
        for tier in route.asleep:
            if names.TIERS.index(tier) > names.TIERS.index(served_by):
                self.demand.wanted(request.model_name, tier)

    async def _route(self, request: pb.ModelInferRequest, raw: bytes, route: routing.ModelRoute,
                     metadata: Sequence[tuple[str, str]] | None, deadline: float
                     ) -> tuple[forward.Answer, policies.VersionChoice]:
        wanted, choices, policy, ranking, _ = self._rank(request, route, metadata)
        send = self.forwarder.cascade if isinstance(policy, policies.Cascade) \
            else self.forwarder.forward
        try:
            answer = await send(request, raw, ranking.candidates, route, deadline)
        except (errors.Unavailable, errors.ResourceExhausted, errors.DeadlineExceeded) as error:
            if wanted.strict:
                raise self._strict_error(error, wanted.tier) from None
            raise
        return answer, choices[answer.candidate.tier]

    @staticmethod
    def _strict_error(error: errors.TieredError, tier: str | None) -> errors.TieredError:
        """The error of a request kept to its tier, naming the tier; `error` says why."""
        return type(error)(f"tiered-tier-strict: tier {tier!r} cannot take the request: {error}")

    def candidates(self, model: str, route: routing.ModelRoute,
                   choices: Mapping[str, policies.VersionChoice]) -> list[policies.Candidate]:
        key = (model, tuple(c.version for c in choices.values()))
        candidates = self._candidates.get(key)
        if candidates is None:  # at most 2^tiers per model: stable or canary on each
            candidates = self._candidates[key] = policies.candidates_of(
                route, {tier: choice.version for tier, choice in choices.items()})
        return candidates

    async def metadata_call(self, model: str, method: str, message):
        return await self.forwarder.first_answer(self.route_of(model), method, message)

    async def model_ready(self, model: str) -> bool:
        route = self.table.models.get(model)
        return route is not None and await self.forwarder.model_ready(model, route)

    async def any_agent_ready(self) -> bool:
        return await self.forwarder.any_agent_ready(self.table.agents())

    async def close(self) -> None:
        self.shadows.cancel()
        self.decoupled.cancel()
        await self.pool.close()


def splits(route: routing.ModelRoute, request: pb.ModelInferRequest,
           wanted: policies.RouteRequest) -> bool:
    """Whether a request may go split across the route's tiers (the policy
    then says whether it does): the route allows a split and both its tiers
    are up (not asleep), the request carries an image, and no tier hint
    keeps it whole on one tier."""
    return route.split is not None and wanted.tier is None \
        and route.split.vision in route.tiers and route.split.decoder in route.tiers \
        and any(tensor.name == IMAGE for tensor in request.inputs)


_ASK_VISUAL_TOKENS = pb.ModelInferRequest(
    outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name=VISUAL_TOKENS)]
).SerializeToString()


def split_encoders(route: routing.ModelRoute, version: int) -> list[policies.Candidate]:
    """The vision tier's agents serving `version`, the one the decoder tier
    was chosen to answer with: a version's two stages are one model, so its
    visual tokens are never decoded by another version. None where the
    vision tier does not serve it (a canary staged on one tier only)."""
    assert route.split is not None
    tier = route.tiers.get(route.split.vision)
    if tier is None or version not in (tier.stable, tier.canary):
        return []
    return [policies.Candidate(route.split.vision, agent, version)
            for agent in tier.agents_for(version)]


def asking_visual_tokens(request: pb.ModelInferRequest, raw: bytes) -> bytes:
    """`raw` (the bytes of `request`) asking for the output `visual_tokens`
    alone: the vision stage's part. A repeated field appends on the wire, so
    a request naming no outputs (as clients' streams do) is not rebuilt."""
    if not request.outputs:
        return raw + _ASK_VISUAL_TOKENS
    ask = pb.ModelInferRequest()
    ask.CopyFrom(request)
    del ask.outputs[:]
    ask.outputs.add().name = VISUAL_TOKENS
    return ask.SerializeToString()


def with_visual_tokens(request: pb.ModelInferRequest, tokens: pb.ModelInferResponse.
                       InferOutputTensor, token_bytes: bytes) -> tuple[pb.ModelInferRequest, int]:
    """The request with its image replaced by the vision stage's tokens (the
    image is not copied), and the image's bytes."""
    out = pb.ModelInferRequest(model_name=request.model_name,
                               model_version=request.model_version, id=request.id)
    for key, value in request.parameters.items():
        out.parameters[key].CopyFrom(value)
    out.outputs.extend(request.outputs)
    raw = len(request.raw_input_contents) == len(request.inputs)
    image_bytes = 0
    for index, tensor in enumerate(request.inputs):
        if tensor.name == IMAGE:
            image_bytes = len(request.raw_input_contents[index]) if raw else tensor.ByteSize()
            continue
        out.inputs.append(tensor)
        if raw:
            out.raw_input_contents.append(request.raw_input_contents[index])
    tensor = out.inputs.add(name=VISUAL_TOKENS, datatype=tokens.datatype)
    tensor.shape.extend(tokens.shape)
    if raw:
        out.raw_input_contents.append(token_bytes)
    else:
        tensor.contents.fp32_contents.extend(np.frombuffer(token_bytes, "<f4").tolist())
    return out, image_bytes


def agents_by_tier(table: routing.RoutingTable) -> set[tuple[str, str]]:
    """(address, tier) of every agent of the table, canary agents included."""
    return {(agent, tier) for route in table.models.values()
            for tier, tier_route in route.tiers.items()
            for agent in (*tier_route.agents, *tier_route.canary_agents)}

"""Routing policies: pure functions of (table, request, observations, rng).

Each policy is one method, `choose(candidates, request, observations, rng)
-> Ranking`: the candidates in the order the router should try them;
`rank` then puts the agents the router holds down after every agent that is
up (`healthy_first`). While a rollout stage is live, the policies that route
requests without a tier hint (slo-energy, cascade) send a share of them to
the stage's tiers first (`StageFloor`), so a stage is never starved by what
the policy prefers. The canary split (`pick_version`), the shadow decision,
the cascade's confidence test (`should_escalate`) and a vision-language
request's choice of split or whole (`choose_image_path`) live here too. Nothing here
does I/O, reads a clock or owns randomness: the router passes in what it
observed and an `random.Random`. Never import gRPC or agent code here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tiered import names
from tiered.errors import InvalidArgument, NotFound
from tiered.protocol import routing


@dataclass(frozen=True)
class Candidate:
    """One agent of one tier, with the version to ask it for (0: its latest)."""

    tier: str
    agent: str
    version: int


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of a request: its hints, already parsed."""

    model: str
    tier: str | None = None  # the tiered-tier hint
    slo_ms: float | None = None  # the tiered-slo-ms hint
    key: str | None = None  # the tiered-key hint
    strict: bool = False  # the tiered-tier-strict hint: the hinted tier or nothing
    # The tiered-split hint, for an image request of a route that allows a
    # split: True split, False whole (where the tier policy ranks first);
    # None the router chooses (`choose_image_path`).
    split: bool | None = None


@dataclass(frozen=True)
class AgentObservation:
    """What the router knows of one agent serving one model, now."""

    p95_s: float | None = None  # recent agent-side latency P95 (telemetry)
    service_s: float | None = None  # mean engine time of one request (telemetry)
    queue_depth: int = 0  # requests waiting in the agent's queue (telemetry)
    rtt_s: float = 0.0  # network and protocol round trip (router EWMA minus agent latency)
    ewma_s: float | None = None  # router-measured latency of forwarded calls
    joules_per_inference: float | None = None  # active energy, above the device's idle
    energy_source: str = ""  # of joules_per_inference: nvml, rapl or model
    in_flight: int = 0  # router-side requests in flight to this agent
    # A generative model's token telemetry (None until some has arrived):
    # time to first token at the agent, and active joules per output token.
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    joules_per_output_token: float | None = None
    token_energy_source: str = ""  # of joules_per_output_token

    def predicted_p95_s(self) -> float | None:
        """Recent P95 + the queue ahead x service time + the round trip."""
        if self.p95_s is not None:
            return self.p95_s + self.queue_depth * (self.service_s or 0.0) + self.rtt_s
        return self.ewma_s  # no telemetry yet: what the router saw, round trip included

    @property
    def load(self) -> int:
        return self.in_flight + self.queue_depth


Observations = Mapping[str, AgentObservation]  # by agent address
_UNKNOWN = AgentObservation()


@dataclass(frozen=True)
class Ranking:
    """A policy's decision: candidates in the order to try."""

    candidates: tuple[Candidate, ...]
    # True when energy was to decide but the figures did not compare (their
    # sources differ), so it decided nothing: the router counts these.
    energy_incomparable: bool = False
    # Agents held down that the policy had put before the first agent that is
    # up: passed over (`healthy_first`); the router counts them as failovers.
    passed_over: tuple[Candidate, ...] = ()
    # The tier a live stage's floor put first, ahead of the policy's own first
    # choice ("" when the floor moved nothing): the router counts these.
    floored: str = ""


@dataclass(frozen=True)
class VersionChoice:
    version: int
    canary: bool


def pick_version(route: routing.TierRoute, key: str | None, rng: random.Random) -> VersionChoice:
    """Stable or canary. A key always lands on the same side for a given weight,
    and raising the weight only moves keys from stable to canary."""
    if route.canary is None or route.canary_weight <= 0:
        return _stable(route.stable)
    point = key_point(key) if key else rng.random()
    if point < route.canary_weight:
        return VersionChoice(route.canary, True)
    return VersionChoice(route.stable, False)


@functools.lru_cache(maxsize=1024)
def _stable(version: int) -> VersionChoice:
    return VersionChoice(version, False)  # one value per version, not one per request


def key_point(key: str) -> float:
    """A key's fixed place in [0, 1): the consistent hash of the split. Any
    text hashes, lone surrogates too (invalid UTF-8 a client sent)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def should_shadow(route: routing.TierRoute, choice: VersionChoice, rng: random.Random) -> bool:
    """Whether a stable request is also sent to the canary, to compare answers."""
    return (not choice.canary and route.canary is not None and route.shadow_fraction > 0
            and rng.random() < route.shadow_fraction)


def order_agents(
    candidates: Sequence[Candidate], observations: Observations, rng: random.Random
) -> list[Candidate]:
    """Power of two choices: of two random agents the less loaded goes first;
    the rest follow by load, so failover has somewhere to go."""
    if len(candidates) <= 1:
        return list(candidates)

    def load(c: Candidate) -> int:
        return observations.get(c.agent, _UNKNOWN).load

    first, second = rng.sample(range(len(candidates)), 2)
    best = candidates[first] if load(candidates[first]) <= load(candidates[second]) \
        else candidates[second]
    rest = sorted((c for c in candidates if c is not best), key=load)
    return [best, *rest]


def _by_tier(candidates: Sequence[Candidate]) -> dict[str, list[Candidate]]:
    tiers: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        tiers.setdefault(candidate.tier, []).append(candidate)
    return tiers


def _known_tier(request: RouteRequest) -> str:
    if request.tier not in names.TIERS:
        raise InvalidArgument(f"tiered-tier: unknown tier {request.tier!r}; expected one of "
                              f"{', '.join(names.TIERS)}")
    return request.tier


class Pinned:
    """Only the agents of the hinted tier (`tiered-tier-strict`)."""

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest,
               observations: Observations, rng: random.Random) -> Ranking:
        tier = _known_tier(request)
        pinned = [c for c in candidates if c.tier == tier]
        if not pinned:
            raise NotFound(f"tiered-tier: model {request.model!r} has no agents on tier "
                           f"{tier!r}")
        return Ranking(tuple(order_agents(pinned, observations, rng)))


def fallback_tiers(hinted: str, tiers: Sequence[str]) -> list[str]:
    """Where a request hinted at `hinted` goes when that tier cannot take it:
    the tiers after it in `tiers` (smallest first, as routes order them),
    then those before it, nearest first. Edge falls back to regional, then
    datacenter; datacenter to regional, then edge."""
    index = tiers.index(hinted) if hinted in tiers else len(tiers)
    return [*tiers[index + 1:], *reversed(tiers[:index])]


class Preferred:
    """The hinted tier's agents first (a `tiered-tier` hint is a preference),
    then every other tier's, in `fallback_tiers` order."""

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest,
               observations: Observations, rng: random.Random) -> Ranking:
        tier = _known_tier(request)
        tiers = _by_tier(candidates)  # in the route's order
        ranked = order_agents(tiers.get(tier, ()), observations, rng)
        for other in fallback_tiers(tier, names.TIERS):
            ranked.extend(order_agents(tiers.get(other, ()), observations, rng))
        return Ranking(tuple(ranked))


@dataclass(frozen=True)
class StageFloor:
    """While a rollout stage is live: the share of requests with no tier hint
    that go first to the tiers the stage names, split evenly among them,
    whatever the policy prefers (`routing.DEFAULT_STAGE_FLOOR` says why a
    third). Each staged tier gets at least share / len(tiers) of them; the
    policy's own choices come on top. A hinted request is never moved: its
    tier is the client's word.

    The SLO is not consulted. A staged tier predicted to miss it would
    otherwise get nothing, and a stage that sees no request can decide
    nothing: the silent stall the floor is there to end. Its latency is what
    the stage measures (a canary slower than stable is caught there, not
    hidden), the share it costs is bounded, and a tier that fails still fails
    over to the policy's order."""

    tiers: tuple[str, ...]
    share: float

    def draw(self, rng: random.Random) -> str | None:
        """The tier this request must go to first, or None: the policy decides.
        One draw picks both whether and which."""
        point = rng.random()
        if point >= self.share:
            return None
        return self.tiers[min(int(point / self.share * len(self.tiers)), len(self.tiers) - 1)]


def stage_floor(route: routing.ModelRoute, reachable: Sequence[str] = names.TIERS
                ) -> StageFloor | None:
    """The floor of the route's live stage over the tiers the policy may send
    a request to (a cascade: its tiers), or None when no stage is live there."""
    if route.stage_floor <= 0:
        return None
    staged = tuple(t for t in route.staged_tiers() if t in reachable)
    return StageFloor(staged, route.stage_floor) if staged else None


def floored(ranking: Ranking, floor: StageFloor | None, rng: random.Random,
            escalating: bool = False) -> Ranking:
    """`ranking` with the floor's tier first when the floor draws one. The
    other candidates follow in the policy's order, for failover; a cascade
    (`escalating`) starts at the floor's tier and escalates only to the tiers
    after it: the cheaper ones before it are left out, since an unsure answer
    must never be handed down to a less sure tier."""
    if floor is None:
        return ranking
    tier = floor.draw(rng)
    candidates = ranking.candidates
    if tier is None or not candidates or candidates[0].tier == tier:
        return ranking
    first = [c for c in candidates if c.tier == tier]
    if not first:  # no agent of it here (not in the route, or outside the cascade)
        return ranking
    after = candidates[candidates.index(first[0]):] if escalating else candidates
    return dataclasses.replace(ranking, candidates=(*first, *(c for c in after
                                                              if c.tier != tier)),
                               floored=tier)


MIXED = "mixed"  # a tier whose agents' energy figures have more than one source


@dataclass(frozen=True)
class TierEstimate:
    """A tier's best agent's figures. For a generative model with token
    telemetry, `predicted_p95_s` is time to first token (P95), `typical_s`
    its P50 and `joules_per_inference` joules per output token; otherwise
    `typical_s` is `predicted_p95_s`."""

    tier: str
    predicted_p95_s: float  # of the tier's best agent; 0 when nothing is known yet
    joules_per_inference: float  # inf when unknown
    energy_source: str  # of that figure; "" when unknown, MIXED when several
    load: int
    typical_s: float = 0.0  # what "fastest first" orders by


def estimate_tier(tier: str, agents: Sequence[Candidate], observations: Observations,
                  tokens: bool = False) -> TierEstimate:
    """`tokens`: judge by time to first token and joules per output token."""
    # One pass: this runs for every request. An agent nobody has measured
    # predicts 0: it is tried, and so measured.
    predicted = typical = energy = load = math.inf
    source: str | None = None
    for candidate in agents:
        seen = observations.get(candidate.agent, _UNKNOWN)
        if tokens:
            predicted = min(predicted, seen.ttft_p95_s or 0.0)
            typical = min(typical, seen.ttft_p50_s or 0.0)
            joules, joules_source = seen.joules_per_output_token, seen.token_energy_source
        else:
            predicted = min(predicted, seen.predicted_p95_s() or 0.0)
            joules, joules_source = seen.joules_per_inference, seen.energy_source
        if joules is not None:
            energy = min(energy, joules)
            source = joules_source if source in (None, joules_source) else MIXED
        load = min(load, seen.load)
    return TierEstimate(tier, predicted, energy, source or "", load,  # every tier has an agent
                        typical if tokens else predicted)


def energy_comparable(estimates: Sequence[TierEstimate]) -> bool:
    """Whether the tiers' J/inference figures may be ranked against each other:
    all of one source (tiers with no figure yet rank after them)."""
    sources = {e.energy_source for e in estimates if e.joules_per_inference < math.inf}
    return len(sources) <= 1 and MIXED not in sources


class SloEnergy:
    """Among tiers predicted to meet the SLO, the lowest joules per inference
    (then the least load); when none meets it, the fastest first.

    A generative model, once any of its agents reports token telemetry, is
    judged per token: the SLO (`tiered-slo-ms`, else the route's) bounds the
    time to first token (P95 at the agent), energy is joules per output
    token, and "fastest" orders by the median time to first token. Before
    any token telemetry it is ranked like any model.

    Energy ranks only figures of one source. NVML counts a GPU, RAPL a CPU
    package (other processes included), the model CPU time x configured
    watts: a joule of one is not a joule of another, and preferring measured
    over modeled, or either way, would rank by a guess. So when the meeting
    tiers' figures have different sources, energy decides nothing: they go
    fastest first (predicted p95, then load) like the tiers that miss the
    SLO, and the ranking says so for the router to count.
    """

    def __init__(self, default_slo_ms: float, floor: StageFloor | None = None) -> None:
        self.default_slo_ms = default_slo_ms
        self.floor = floor

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest,
               observations: Observations, rng: random.Random) -> Ranking:
        if len(candidates) == 1:  # nothing to rank, and one agent's energy has one source
            return Ranking(tuple(candidates))
        slo_s = (request.slo_ms if request.slo_ms is not None else self.default_slo_ms) / 1000
        tiers = _by_tier(candidates)
        tokens = any(observations.get(c.agent, _UNKNOWN).ttft_p95_s is not None
                     for c in candidates)
        estimates = [estimate_tier(t, agents, observations, tokens)
                     for t, agents in tiers.items()]
        meeting = [e for e in estimates if e.predicted_p95_s <= slo_s]
        comparable = energy_comparable(meeting)
        meeting.sort(key=(lambda e: (e.joules_per_inference, e.load)) if comparable
                     else (lambda e: (e.typical_s, e.load)))
        missing = sorted((e for e in estimates if e.predicted_p95_s > slo_s),
                         key=lambda e: e.typical_s)
        ranked: list[Candidate] = []
        for estimate in meeting + missing:
            ranked.extend(order_agents(tiers[estimate.tier], observations, rng))
        return floored(Ranking(tuple(ranked), energy_incomparable=not comparable),
                       self.floor, rng)


@dataclass(frozen=True)
class ImagePath:
    """Where a vision-language request with an image runs: whole on one tier
    (`vision == decoder`) or split (the vision tier encodes the image, the
    decoder tier answers from its visual tokens)."""

    vision: str
    decoder: str

    @property
    def split(self) -> bool:
        return self.vision != self.decoder


@dataclass(frozen=True)
class PathObservation:
    """The router's own EWMAs of one image path (`Observer.record_image_path`):
    `first_s`, from sending the stream to its first response (for a split:
    the decoder tier's, from the visual tokens); `vision_s`, a split's vision
    call (what `tiered_router_split_vision_seconds` counts)."""

    first_s: float | None = None
    vision_s: float | None = None

    def ttft_s(self, split: bool) -> float | None:
        """Expected time to first token; None until every part was measured."""
        if self.first_s is None or (split and self.vision_s is None):
            return None
        return self.first_s + (self.vision_s or 0.0)


@dataclass(frozen=True)
class PathEstimate:
    """One image path's figures, as the choice compared them."""

    path: ImagePath
    ttft_s: float | None  # None: not measured yet (or forgotten as stale)
    joules: float  # per request; inf when a tier's figure is unknown
    energy_source: str  # "" unknown, MIXED when the split's two tiers differ


@dataclass(frozen=True)
class PathChoice:
    """`choose_image_path`'s decision, with the numbers it used."""

    path: ImagePath
    reason: str  # UNMEASURED, MEETS, FASTEST or HINTED
    estimates: tuple[PathEstimate, ...]  # none when HINTED: nothing was compared
    energy_incomparable: bool = False


UNMEASURED, MEETS, FASTEST, HINTED = "unmeasured", "meets", "fastest", "hinted"


def image_paths(tiers: Sequence[str], split: routing.SplitRoute) -> tuple[ImagePath, ...]:
    """The paths an image request may take: whole on each tier (in `tiers`'
    order), then the split. This order breaks every tie."""
    return (*(ImagePath(t, t) for t in tiers), ImagePath(split.vision, split.decoder))


def estimate_path(path: ImagePath, seen: PathObservation, energy: Mapping[str, TierEstimate]
                  ) -> PathEstimate:
    """Energy per request comes from the agents' telemetry, one figure per tier
    and model (`TierEstimate.joules_per_inference`: active joules over the
    requests the tier answered). Whole on T: T's figure. Split: the vision
    tier's figure (for its encode) plus the decoder tier's (for its answer).
    The agents do not report the vision stage's energy apart, so the vision
    tier's figure stands for an encode: exact while that tier answers only
    the split's visual-token calls, an overcount while it also answers whole
    requests (each of which includes an encode). Likewise the decoder tier's
    figure includes its own encodes while it also answers whole requests. Both
    errors raise the split's estimate: energy never sends a request split on a
    guess in the split's favour. (A whole path's figure errs the other way
    while its tier answers only split work, say only encodes; its first
    whole requests correct it.)"""
    if path.split:
        vision, decoder = energy[path.vision], energy[path.decoder]
        joules = vision.joules_per_inference + decoder.joules_per_inference
        sources = {vision.energy_source, decoder.energy_source}
        source = "" if joules == math.inf else sources.pop() if len(sources) == 1 else MIXED
    else:
        tier = energy[path.vision]
        joules, source = tier.joules_per_inference, tier.energy_source
    return PathEstimate(path, seen.ttft_s(path.split), joules, source)


def choose_image_path(paths: Sequence[ImagePath], seen: Mapping[ImagePath, PathObservation],
                      energy: Mapping[str, TierEstimate], slo_s: float) -> PathChoice:
    """Split or whole, and where, for one image request.

    1. A path with no expected TTFT yet (never taken, or its figures went
       stale) goes first, the first such in `paths`' order: taking it is how
       it gets measured. The router measures a path on its first response,
       so this costs one request per path per staleness window.
    2. Else, among paths whose expected TTFT (the router's EWMAs: a whole
       request's time to first response; a split's vision call plus its
       decoder's time to first response) meets `slo_s`, the lowest joules per
       request, then the lowest TTFT. Energy ranks only figures of one source
       (`energy_comparable`'s rule); when they differ the fastest meeting
       path goes first and the choice says so.
    3. When none meets it, the fastest.
    Remaining ties go to the earlier path in `paths` (whole before split)."""
    estimates = tuple(estimate_path(p, seen.get(p, _NO_PATH), energy) for p in paths)
    order = {e.path: index for index, e in enumerate(estimates)}
    unmeasured = [e for e in estimates if e.ttft_s is None]
    if unmeasured:
        return PathChoice(unmeasured[0].path, UNMEASURED, estimates)
    meeting = [e for e in estimates if e.ttft_s is not None and e.ttft_s <= slo_s]
    if meeting:
        known = {e.energy_source for e in meeting if e.joules < math.inf}
        comparable = len(known) <= 1 and MIXED not in known
        best = min(meeting, key=(lambda e: (e.joules, e.ttft_s, order[e.path])) if comparable
                   else (lambda e: (e.ttft_s, order[e.path])))
        return PathChoice(best.path, MEETS, estimates, energy_incomparable=not comparable)
    best = min(estimates, key=lambda e: (e.ttft_s, order[e.path]))
    return PathChoice(best.path, FASTEST, estimates)


_NO_PATH = PathObservation()


def image_path_for(route: routing.ModelRoute, candidates: Sequence[Candidate],
                   request: RouteRequest, observations: Observations,
                   seen: Mapping[ImagePath, PathObservation]) -> PathChoice:
    """`choose_image_path` for a request of a route that allows a split: the
    paths over the tiers that have candidates, each tier's energy from its
    agents' telemetry (`estimate_tier`: its best agent's J/inference), the
    SLO the request's hint or else the route's. A `tiered-split` hint
    decides instead: the split, or whole on the tier ranked first
    (`candidates` are in the tier policy's order)."""
    assert route.split is not None
    if request.split is not None:
        tier = candidates[0].tier
        path = ImagePath(route.split.vision, route.split.decoder) if request.split \
            else ImagePath(tier, tier)
        return PathChoice(path, HINTED, ())
    tiers = _by_tier(candidates)
    energy = {t: estimate_tier(t, agents, observations) for t, agents in tiers.items()}
    # Smallest tier first, whatever the ranking: ties and trials go in one fixed order.
    ordered = tuple(t for t in route.ordered_tiers() if t in tiers)
    paths = [p for p in image_paths(ordered, route.split)
             if p.vision in tiers and p.decoder in tiers]
    slo_ms = request.slo_ms if request.slo_ms is not None else route.slo_ms
    return choose_image_path(paths, seen, energy, slo_ms / 1000)


class Cascade:
    """Cheapest tier first, in the configured order; the router escalates
    along this order while `should_escalate` says the answer is unsure.
    While a stage is live, the floor's share of requests starts at a staged
    tier of the cascade instead (a tier the cascade does not list is the
    spec's choice: the controller says that such a stage gets no un-hinted
    request)."""

    def __init__(self, tiers: Sequence[str], floor: StageFloor | None = None) -> None:
        self.tiers = tuple(tiers)
        self.floor = floor

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest,
               observations: Observations, rng: random.Random) -> Ranking:
        tiers = _by_tier(candidates)
        ranked: list[Candidate] = []
        for tier in self.tiers:
            ranked.extend(order_agents(tiers.get(tier, ()), observations, rng))
        return floored(Ranking(tuple(ranked)), self.floor, rng, escalating=True)


def confidence(outputs: Mapping[str, np.ndarray], output_name: str = "") -> float:
    """The lowest per-row confidence of a batch.

    The named output (else the only one): one value per row is a confidence
    as is; rows of several values are probabilities when they already sum to
    1 (max of them), else logits (max softmax).
    """
    if output_name:
        if output_name not in outputs:
            raise NotFound(f"cascade.output: the response has no output {output_name!r}")
        array = outputs[output_name]
    elif len(outputs) == 1:
        (array,) = outputs.values()
    else:
        raise InvalidArgument(f"cascade.output: the response has {len(outputs)} outputs "
                              f"({', '.join(outputs)}); name the one to judge")
    values = np.asarray(array, dtype=np.float64)
    if values.size == 0:
        return 1.0
    rows = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(-1, 1)
    if rows.shape[1] == 1:
        return float(rows.min())
    sums = rows.sum(axis=1)
    if rows.min() >= 0 and np.allclose(sums, 1.0, atol=1e-3):
        return float(rows.max(axis=1).min())
    shifted = np.exp(rows - rows.max(axis=1, keepdims=True))
    return float((shifted.max(axis=1) / shifted.sum(axis=1)).min())


def should_escalate(outputs: Mapping[str, np.ndarray], threshold: float,
                    output_name: str = "") -> bool:
    return confidence(outputs, output_name) < threshold


def generation_confidence(mean_logprob: float) -> float:
    """A generation's confidence: the geometric mean of its tokens'
    probabilities, exp(mean log-probability), in 0..1 like a class
    probability, so one cascade threshold reads alike for both kinds."""
    return math.exp(min(mean_logprob, 0.0))


def should_escalate_generation(mean_logprob: float, threshold: float) -> bool:
    return generation_confidence(mean_logprob) < threshold


def top1(outputs: Mapping[str, np.ndarray], output_name: str = "") -> tuple[int, ...] | None:
    """Each row's arg-max of the judged output, for shadow agreement."""
    if output_name:
        array = outputs.get(output_name)
    else:
        array = next(iter(outputs.values()), None) if len(outputs) == 1 else None
    if array is None or array.ndim < 2 or array.dtype == object:
        return None
    return tuple(int(i) for i in array.reshape(array.shape[0], -1).argmax(axis=1))


def candidates_of(route: routing.ModelRoute, versions: Mapping[str, int]) -> list[Candidate]:
    """Every agent of the model, each with its tier's chosen version."""
    return [Candidate(tier, agent, versions[tier]) for tier in route.ordered_tiers()
            for agent in route.tiers[tier].agents_for(versions[tier])]


Policy = Pinned | Preferred | SloEnergy | Cascade


def policy_for(route: routing.ModelRoute, request: RouteRequest) -> Policy:
    """A tier hint wins whenever it is present (a pin when strict, else a
    preference); else the model's policy, with the live stage's floor."""
    if request.tier is not None:
        return Pinned() if request.strict else Preferred()
    if route.policy == names.Policy.CASCADE:
        return Cascade(route.cascade.tiers, stage_floor(route, route.cascade.tiers))
    return SloEnergy(route.slo_ms, stage_floor(route))


def healthy_first(ranking: Ranking, down: Container[str]) -> Ranking:
    """The ranking with the agents held down moved after every agent that is
    up, each part in the policy's order: a down agent is asked only when no
    agent that is up is left (it may be back before a probe says so). Those
    it had first are `passed_over`. A cascade's tiers keep this order too: a
    tier whose agents are all down comes after the tiers that can answer."""
    up = [c for c in ranking.candidates if c.agent not in down]
    if not up or len(up) == len(ranking.candidates):
        return ranking  # nothing down, or nothing up: the policy's order stands
    held = [c for c in ranking.candidates if c.agent in down]
    first = ranking.candidates.index(up[0])
    return dataclasses.replace(ranking, candidates=(*up, *held),
                               passed_over=ranking.candidates[:first])


def rank(policy: Policy, candidates: Sequence[Candidate], request: RouteRequest,
         observations: Observations, rng: random.Random, down: Container[str]) -> Ranking:
    """The policy's ranking given which agents are held down (by address)."""
    ranking = policy.choose(candidates, request, observations, rng)
    return healthy_first(ranking, down) if down else ranking

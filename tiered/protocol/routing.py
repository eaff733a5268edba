"""The routing table: which agents serve which model on which tier, and how.

The one schema of the document the controller writes (`table_document`,
`dump_table`) and the router reads (`parse_table`, `load_table`), reloading
it when the file changes. Loading is strict: every error names the field, so
a bad table is rejected whole and the last good one keeps serving. The
dataclasses check themselves on construction, so a table the controller
builds is valid before it is written. Pure data: no I/O beyond reading the
one file it is given; never talks to agents and imports nothing of ours above
`protocol` (tier and policy names come from the leaf `tiered.names`).

    version: 7
    models:
      digits:
        policy: slo-energy          # or cascade; a `tiered-tier` hint goes first in either
        slo_ms: 50                  # when the request sets no tiered-slo-ms
        failover_attempts: 3
        max_in_flight: 64           # per agent, counted by the router
        stage_floor: 0.333          # while a stage is live: share of un-hinted requests
                                    # sent to its tiers (those with canary_weight > 0)
        cascade: {tiers: [edge, regional, datacenter], threshold: 0.9, output: ""}
        asleep: [datacenter]        # tiers of the model with no agent now (scaled to
                                    # zero): their demand is counted and woken for
        tiers:
          edge:
            agents: ["10.0.0.5:8001"]
            stable: 1               # 0: whatever the agent serves as latest
            canary: 2               # optional
            canary_weight: 0.05     # share of keys (or requests) sent to the canary
            canary_agents: []       # optional: the canary's own agents (Kubernetes runs
                                    # each version in its own Deployment); else `agents`
            shadow_fraction: 0.1    # share of stable requests also sent to the canary
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiered import names
from tiered.errors import ConfigError
from tiered.settings import load_dataclass, read_yaml

MAX_AGENTS_PER_TIER = 1024
MAX_FAILOVER_ATTEMPTS = 10
DEFAULT_TIMEOUT_S = 30.0  # a request with no deadline of its own gets this one
# While a rollout stage is live, this share of the requests that carry no
# tier hint goes to the tiers the stage names (split evenly among them),
# whatever the policy prefers: slo-energy may send everything to the cheapest
# tier and leave the staged one, and so its canary, without a request. A
# third: the demo's first stage (20% of edge, 150 canary requests, 120 s at
# most) at 80 requests/s then sees about 5 canary requests/s, its 150 in
# some 30 s; two thirds of un-hinted traffic still go where the policy says.
# A stage of k tiers gives each at least 1/(3k). 0 turns the floor off.
DEFAULT_STAGE_FLOOR = 1 / 3


@dataclass(frozen=True)
class TierRoute:
    """One tier of one model: its agents and the version split."""

    agents: tuple[str, ...]
    stable: int = 0  # 0: the agent's latest version (model_version left empty)
    canary: int | None = None
    canary_weight: float = 0.0
    shadow_fraction: float = 0.0
    canary_agents: tuple[str, ...] = ()  # empty: the canary runs on `agents` too

    def __post_init__(self) -> None:
        _freeze(self, "agents", "canary_agents")
        if not self.agents:
            raise ConfigError("agents: needs at least one agent address")
        for name in ("agents", "canary_agents"):
            addresses = getattr(self, name)
            if len(addresses) > MAX_AGENTS_PER_TIER:
                raise ConfigError(f"{name}: at most {MAX_AGENTS_PER_TIER} per tier")
            for index, address in enumerate(addresses):
                host, _, port = address.rpartition(":")
                if not host or not port.isdigit():
                    raise ConfigError(f"{name}[{index}]: expected HOST:PORT, got {address!r}")
            if len(set(addresses)) != len(addresses):
                raise ConfigError(f"{name}: an address is listed twice")
        if self.canary_agents and self.canary is None:
            raise ConfigError("canary_agents: listed but no canary version is set")
        if self.stable < 0:
            raise ConfigError(f"stable: expected a version >= 0, got {self.stable}")
        if self.canary is not None and self.canary < 1:
            raise ConfigError(f"canary: expected a version >= 1, got {self.canary}")
        if not 0.0 <= self.canary_weight <= 1.0:
            raise ConfigError(f"canary_weight: expected 0..1, got {self.canary_weight}")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ConfigError(f"shadow_fraction: expected 0..1, got {self.shadow_fraction}")
        if self.canary is None and self.canary_weight > 0:
            raise ConfigError("canary_weight: is above 0 but no canary version is set")
        if self.canary is None and self.shadow_fraction > 0:
            raise ConfigError("shadow_fraction: is above 0 but no canary version is set")

    def agents_for(self, version: int) -> tuple[str, ...]:
        """The agents that serve `version` on this tier."""
        if version == self.canary and self.canary_agents:
            return self.canary_agents
        return self.agents


@dataclass(frozen=True)
class CascadeSettings:
    tiers: tuple[str, ...] = names.TIERS  # asked in this order
    threshold: float = 0.9  # confidence below this escalates
    output: str = ""  # the output to judge: logits, probabilities or one confidence per row

    def __post_init__(self) -> None:
        _freeze(self, "tiers")
        if not self.tiers:
            raise ConfigError("tiers: needs at least one tier")
        for index, tier in enumerate(self.tiers):
            if tier not in names.TIERS:
                raise ConfigError(f"tiers[{index}]: unknown tier {tier!r}; expected one of "
                                  f"{', '.join(names.TIERS)}")
        if len(set(self.tiers)) != len(self.tiers):
            raise ConfigError("tiers: a tier is listed twice")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold: expected 0..1, got {self.threshold}")


@dataclass(frozen=True)
class SplitRoute:
    """A vision-language model split across two tiers: a request with an
    image is encoded by the `vision` tier's agents (its vision stage alone)
    and answered by the `decoder` tier's from those visual tokens."""

    vision: str
    decoder: str

    def __post_init__(self) -> None:
        for role in ("vision", "decoder"):
            if getattr(self, role) not in names.TIERS:
                raise ConfigError(f"{role}: unknown tier {getattr(self, role)!r}; expected one "
                                  f"of {', '.join(names.TIERS)}")
        if self.vision == self.decoder:
            raise ConfigError(f"decoder: the same tier as vision ({self.vision}); a split "
                              "needs two")


@dataclass(frozen=True)
class ModelRoute:
    tiers: Mapping[str, TierRoute]
    policy: str = names.Policy.SLO_ENERGY
    slo_ms: float = 100.0
    failover_attempts: int = 3
    max_in_flight: int = 64
    cascade: CascadeSettings = field(default_factory=CascadeSettings)
    stage_floor: float = DEFAULT_STAGE_FLOOR  # see DEFAULT_STAGE_FLOOR
    asleep: tuple[str, ...] = ()  # tiers with no agent now: requests wake them
    split: SplitRoute | None = None  # a vision-language model's stages on two tiers

    def __post_init__(self) -> None:
        _freeze(self, "asleep")
        if not self.tiers and not self.asleep:
            raise ConfigError("tiers: needs at least one tier (or one asleep)")
        for tier in (*self.tiers, *self.asleep):
            if tier not in names.TIERS:
                raise ConfigError(f"tiers: unknown tier {tier!r}; expected one of "
                                  f"{', '.join(names.TIERS)}")
        both = set(self.tiers) & set(self.asleep)
        if both:
            raise ConfigError(f"asleep: tier {min(both)!r} has agents in tiers")
        if self.policy not in tuple(names.Policy):
            raise ConfigError(f"policy: unknown policy {self.policy!r}; expected one of "
                              f"{', '.join(names.Policy)}")
        if self.slo_ms <= 0:
            raise ConfigError(f"slo_ms: expected > 0, got {self.slo_ms}")
        if not 1 <= self.failover_attempts <= MAX_FAILOVER_ATTEMPTS:
            raise ConfigError(f"failover_attempts: expected 1..{MAX_FAILOVER_ATTEMPTS}, "
                              f"got {self.failover_attempts}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight: expected >= 1, got {self.max_in_flight}")
        if not 0.0 <= self.stage_floor <= 1.0:
            raise ConfigError(f"stage_floor: expected 0..1, got {self.stage_floor}")
        if self.split is not None:
            for role in ("vision", "decoder"):
                tier = getattr(self.split, role)
                if tier not in self.tiers and tier not in self.asleep:
                    raise ConfigError(f"split.{role}: tier {tier!r} has no entry in tiers")
        if self.policy == names.Policy.CASCADE:
            missing = [t for t in self.cascade.tiers if t not in self.tiers]
            if missing:
                raise ConfigError(f"cascade: tier {missing[0]!r} has no entry in tiers")

    def ordered_tiers(self) -> tuple[str, ...]:
        return tuple(t for t in names.TIERS if t in self.tiers)

    def staged_tiers(self) -> tuple[str, ...]:
        """The tiers a live rollout stage sends canary traffic to, smallest first."""
        return tuple(t for t in self.ordered_tiers() if self.tiers[t].canary_weight > 0)


@dataclass(frozen=True)
class RoutingTable:
    version: int
    models: Mapping[str, ModelRoute]
    timeout_s: float = DEFAULT_TIMEOUT_S  # deadline of a request that brings none

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ConfigError(f"version: expected >= 0, got {self.version}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s: expected > 0, got {self.timeout_s}")

    def agents(self) -> frozenset[str]:
        return frozenset(a for m in self.models.values() for t in m.tiers.values()
                         for a in (*t.agents, *t.canary_agents))


def _freeze(value: Any, *names: str) -> None:
    # Lists become tuples, so a table built in code equals the same table
    # read back; a bare string is refused rather than split into characters.
    for name in names:
        items = getattr(value, name)
        if isinstance(items, str) or not isinstance(items, Sequence):
            raise ConfigError(f"{name}: expected a list, got {type(items).__name__}")
        object.__setattr__(value, name, tuple(items))


def parse_table(data: Any, where: str = "routing table") -> RoutingTable:
    """The table a document (parsed YAML or JSON) describes; errors name the field."""
    return load_dataclass(RoutingTable, data, where)


def load_table(path: Path) -> RoutingTable:
    return parse_table(read_yaml(Path(path)), str(path))


def table_document(table: RoutingTable) -> dict[str, Any]:
    """The plain-data document `parse_table` reads back as `table`; fields at
    their defaults are left out, so a written table shows what was chosen."""
    return _document(table)


def dump_table(table: RoutingTable) -> str:
    """`table` as the YAML text of a routing table file."""
    return yaml.safe_dump(table_document(table), sort_keys=False)


def _document(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        out = {}
        for item in dataclasses.fields(value):
            current = getattr(value, item.name)
            if item.default is not dataclasses.MISSING and current == item.default:
                continue
            if item.default_factory is not dataclasses.MISSING \
                    and current == item.default_factory():
                continue
            out[item.name] = _document(current)
        return out
    if isinstance(value, Mapping):
        return {_document(key): _document(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_document(item) for item in value]
    if isinstance(value, enum.Enum):  # a tiered.names member: its plain string
        return value.value
    return value

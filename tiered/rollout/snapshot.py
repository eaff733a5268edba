"""The rollout snapshot: where a rollout stands at a decision and the figures
it used, one line of the local rollout history (progress lines, the report).

A snapshot is stored as a flat JSON record: its fields, and each version's
figures keyed as 'p95_canary_ms' (pooled over the tiers judged) or
'edge.p95_canary_ms' (on one tier). The status's history steps keep the
figures alone (`HistoryEntry.numbers` and `sources`). The keys are named
here only: `to_record`/`from_record` and `to_step_numbers`/
`from_step_numbers` write and read them. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from tiered import names

if TYPE_CHECKING:
    from tiered.rollout.spec import TieredModel
    from tiered.rollout.status import TieredModelStatus

WHO = ("stable", "canary")  # the versions compared, as `Compared` and the keys name them


@dataclass(frozen=True)
class Figures:
    """One version's headline figures over a stage, pooled or on one tier:
    those its model's kind is judged on (request p95 and J/inference, or
    output tokens, TTFT and TPOT p95 and J per output token); None where
    unknown or not of its kind."""

    requests: float | None = None  # a count (a float as the status keeps it)
    p95_ms: float | None = None
    jpi: float | None = None  # J/inference
    output_tokens: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    jpt: float | None = None  # J per output token
    # of the energy figures: nvml, rapl, model; "" unknown; None not measured
    # (and on a tier: the pooled figures name it)
    energy_source: str | None = None

    def energy(self, generative: bool) -> float | None:
        """J/inference, or a generative model's J/token."""
        return self.jpt if generative else self.jpi


@dataclass(frozen=True)
class Compared:
    """Stable's and the canary's figures side by side."""

    stable: Figures = Figures()
    canary: Figures = Figures()

    def each(self) -> tuple[tuple[str, Figures], ...]:
        """(who, figures) of stable, then of the canary."""
        return tuple(zip(WHO, (self.stable, self.canary)))


@dataclass(frozen=True)
class StageFigures(Compared):
    """What a stage measured: each version's figures pooled over the tiers
    judged, shadow agreement, and each tier's own that served the canary."""

    agreement: float | None = None  # the share of compared shadow answers that agreed
    agreement_compared: int | None = 0  # None: not known (a step kept without figures)
    tiers: Mapping[str, Compared] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One line of the rollout history: where the rollout stands after
    `action` and the figures it was taken on."""

    model: str
    kind: str
    stable_version: int
    canary_version: int | None
    phase: str
    stage_index: int
    stage_name: str
    stages: int
    weights: Mapping[str, float]  # canary percent per tier
    action: str
    reason: str
    verdict: str | None = None  # of the last analysis
    pending: tuple[str, ...] = ()  # what keeps the analysis from passing: metric labels
    # (with their tier)
    figures: StageFigures = field(default_factory=StageFigures)

    @property
    def generative(self) -> bool:
        """Judged on TTFT, TPOT and J/token, not request p95 and J/inference."""
        return names.ModelKind(self.kind).streams_tokens


# Each figure's key, "{who}" standing for stable or canary.
_KEYS = {"requests": "{who}_requests", "p95_ms": "p95_{who}_ms", "jpi": "jpi_{who}",
         "output_tokens": "{who}_output_tokens", "ttft_p95_ms": "ttft_p95_{who}_ms",
         "tpot_p95_ms": "tpot_p95_{who}_ms", "jpt": "jpt_{who}",
         "energy_source": "energy_source_{who}"}
_FIELD_OF = {key.format(who=who): (who, name) for who in WHO for name, key in _KEYS.items()}
# Pooled figures a record names even when unknown (null): always, and a
# generative version's whenever its output tokens are known.
_ALWAYS = ("requests", "p95_ms", "jpi")
_GENERATIVE = ("output_tokens", "ttft_p95_ms", "tpot_p95_ms", "jpt")
# Each energy figure's key, and the key of its source.
_SOURCE_OF = {_KEYS[energy].format(who=who): _KEYS["energy_source"].format(who=who)
              for who in WHO for energy in ("jpi", "jpt")}


def to_record(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as the flat JSON record the history stores."""
    head = {f.name: getattr(snapshot, f.name) for f in fields(snapshot) if f.name != "figures"}
    return {**head, "weights": dict(snapshot.weights), "pending": list(snapshot.pending),
            **_figures_record(snapshot.figures)}


def from_record(record: Mapping[str, Any]) -> Snapshot:
    """A stored record as a snapshot; a key it lacks reads as unknown."""
    return Snapshot(
        model=record["model"], kind=record.get("kind", names.ModelKind.PREDICTIVE),
        stable_version=record["stable_version"], canary_version=record.get("canary_version"),
        phase=record["phase"], stage_index=record["stage_index"],
        stage_name=record["stage_name"], stages=record["stages"],
        weights=dict(record.get("weights") or {}), action=record["action"],
        reason=record["reason"], verdict=record.get("verdict"),
        pending=tuple(record.get("pending", ())), figures=_read_figures(record))


def to_step_numbers(figures: StageFigures) -> tuple[dict[str, float], dict[str, str]]:
    """The figures as a status history step keeps them: its `numbers` (the
    known ones, as floats) and `sources` (each energy figure's source)."""
    record = _figures_record(figures)
    return ({key: float(value) for key, value in record.items()
             if isinstance(value, (int, float))},
            {figure: str(record[source]) for figure, source in _SOURCE_OF.items()
             if record.get(figure) is not None and record.get(source)})


def from_step_numbers(numbers: Mapping[str, float], sources: Mapping[str, str]
                      ) -> StageFigures:
    """A status history step's `numbers` and `sources` as figures."""
    return _read_figures({**numbers, **{source: sources[figure]
                                        for figure, source in _SOURCE_OF.items()
                                        if figure in sources}})


def _figures_record(figures: StageFigures) -> dict[str, Any]:
    record: dict[str, Any] = {}
    for who, version in figures.each():
        record.update(_version_record(who, version))
    record.update(agreement=figures.agreement, agreement_compared=figures.agreement_compared)
    for tier, compared in figures.tiers.items():
        for who, version in compared.each():
            record.update(_version_record(who, version, tier))
    return record


def _version_record(who: str, version: Figures, tier: str = "") -> dict[str, Any]:
    """A version's known figures by key ('edge.p95_canary_ms' on `tier`);
    pooled, also those a record names when unknown."""
    named = () if tier else _ALWAYS + (_GENERATIVE if version.output_tokens is not None
                                       else ())
    prefix = f"{tier}." if tier else ""
    return {prefix + key.format(who=who): value for name, key in _KEYS.items()
            if (value := getattr(version, name)) is not None or name in named}


def _read_figures(record: Mapping[str, Any]) -> StageFigures:
    found: dict[str, dict[str, dict[str, Any]]] = {}  # tier ("" pooled) -> who -> figures
    for key, value in record.items():
        tier, _, figure = key.rpartition(".")
        if figure in _FIELD_OF:
            who, name = _FIELD_OF[figure]
            found.setdefault(tier, {}).setdefault(who, {})[name] = value

    def compared(tier: str) -> dict[str, Figures]:
        return {who: Figures(**found.get(tier, {}).get(who, {})) for who in WHO}

    return StageFigures(**compared(""), agreement=record.get("agreement"),
                        agreement_compared=record.get("agreement_compared"),
                        tiers={tier: Compared(**compared(tier)) for tier in found if tier})


def from_history(spec: TieredModel, status: TieredModelStatus
                 ) -> list[tuple[float, Snapshot]]:
    """The status's history steps as report snapshots, each with its time
    (what the local store records every pass, Kubernetes keeps for each step
    in the status)."""
    stages = spec.rollout.stages
    snapshots = []
    for step in status.history:
        label = step.stage.split(" ", 1)
        index = next((i for i, stage in enumerate(stages)
                      if len(label) == 2 and stage.name == label[1]), 0)
        live = step.canary_version is not None and step.phase in (
            names.Phase.PROGRESSING, names.Phase.PAUSED)
        snapshots.append((step.t, Snapshot(
            model=spec.name, kind=spec.kind, stable_version=step.stable_version,
            canary_version=step.canary_version, phase=step.phase, stage_index=index,
            stage_name=stages[index].name, stages=len(stages),
            weights={tier: float(stages[index].weights.get(tier, 0.0)) if live else 0.0
                     for tier in names.TIERS if tier in spec.tiers},
            action=step.action, reason=step.reason,
            figures=from_step_numbers(step.numbers, step.sources))))
    return snapshots

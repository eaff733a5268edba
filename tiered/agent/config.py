"""A model's config.yaml: what the agent serves and how. Pure parsing.

    DIR/<model>/config.yaml
    DIR/<model>/<version>/model.onnx      version: a positive integer

Keys (all optional; `inputs`/`outputs` are filled from the model when left
out): backend, max_batch_size, inputs, outputs, dynamic_batching,
version_policy, instance_count, engine, generation, decoupled, ensemble.
`backend` defaults to the tier profile's engine; `engine` (that backend's
settings) and `dynamic_batching` are laid over the profile's defaults. A
generative backend (`onnxruntime-genai`, `torch-generative`) makes the model
decoupled: its tensors are fixed (`generation.py`), `engine.max_sequences` bounds its running
batch and `generation` its wait for a sequence slot; `generation.vision` makes it a
vision-language model, its vision stage served beside it (`vision_language.py`).
Any other model may say
`decoupled: true`: it answers a streamed request with one response per row of
its outputs' first axis (zero rows, zero responses), so each output's `dims`
are a response's. `backend: ensemble` with `ensemble: {steps: [...]}` makes
the model an ensemble of models the agent serves (`ensemble.py`): it declares
its inputs and outputs, and each step maps its model's inputs and outputs to
the ensemble's tensors by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tiered.agent.sequences import SequenceBatching
from tiered.engines.base import TensorSpec
from tiered.engines.generative import GENERATIVE_BACKENDS
from tiered.engines.visual_tokens import Pruning, TokenSelection
from tiered.errors import ConfigError, InvalidArgument
from tiered.profiles import TierProfile
from tiered.protocol import codec
from tiered.settings import load_dataclass

ENGINE_CORE_LAYOUTS = ("auto", "process", "thread")  # generation.engine_core
ENSEMBLE = "ensemble"  # the backend of a model made of other models' steps
LATEST = -1  # a step's version: the step model's newest served version

# Names become directory names: no separators, no "..", nothing hidden.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_model_name(name: str) -> str:
    if not MODEL_NAME.match(name) or ".." in name:
        raise InvalidArgument(
            f"model_name: {name!r} is not a valid model name "
            "(letters, digits, '_', '.', '-'; at most 128)"
        )
    return name


@dataclass(frozen=True)
class TensorConfig:
    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False  # a request may leave it out

    def __post_init__(self) -> None:
        if self.datatype not in codec.DATATYPES:
            raise ConfigError(
                f"datatype: {self.datatype!r} is not one of {', '.join(codec.DATATYPES)}"
            )
        if any(d < -1 for d in self.dims):
            raise ConfigError(f"dims: {list(self.dims)} may hold sizes or -1 (variable)")


@dataclass(frozen=True)
class DynamicBatching:
    max_queue_delay_us: int = 100  # how long a free instance waits for more while another runs
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 256
    wait_when_idle: bool = False  # true: the delay applies while no batch runs too (Triton's)

    def __post_init__(self) -> None:
        if self.max_queue_delay_us < 0:
            raise ConfigError(f"max_queue_delay_us: must be >= 0, got {self.max_queue_delay_us}")
        if self.max_queue_size < 1:
            raise ConfigError(f"max_queue_size: must be >= 1, got {self.max_queue_size}")
        if any(size < 1 for size in self.preferred_batch_sizes):
            raise ConfigError("preferred_batch_sizes: sizes must be >= 1")





@dataclass(frozen=True)
class VisionStageConfig:
    """A vision-language model's vision stage (images to the decoder's visual
    tokens), served beside its decoder (`vision_language.py`).

    `prune` and `max_visual_tokens` (both off by default) choose which of an
    image's visual tokens the decoder reads (`engines/visual_tokens.py`):
    `prune: {criterion: relative_norm, threshold: 0.15}` drops each token
    whose L2 norm is below `threshold` times the largest of its image's
    (threshold in [0, 1)); then at most `max_visual_tokens` (>= 1) stay, the
    highest scores; kept tokens keep their order. `tiered build` gates them
    when its profile's `build.vision` sets them, and writes them here."""

    path: str = "vision"  # its directory in the version's: model.onnx, preprocessor_config.json
    backend: str = "onnxruntime"
    engine: Mapping[str, Any] = field(default_factory=dict)  # its engine's settings
    max_images: int = 8  # images one request may carry
    max_visual_tokens: int | None = None  # kept an image, after pruning (None: all)
    prune: Pruning | None = None  # None: no pruning

    def __post_init__(self) -> None:
        if not self.path or Path(self.path).is_absolute() or ".." in Path(self.path).parts:
            raise ConfigError(f"path: a directory inside the version's, got {self.path!r}")
        if self.max_images < 1:
            raise ConfigError(f"max_images: must be >= 1, got {self.max_images}")
        self.selection  # noqa: B018 (its checks name the field)

    @property
    def selection(self) -> TokenSelection:
        return TokenSelection(self.max_visual_tokens, self.prune)


@dataclass(frozen=True)
class Generation:
    """How a generative (decoupled) model admits requests."""

    max_queue_wait_ms: int = 30_000  # a request waits this long for a sequence slot
    # A streamed response carries the tokens ready when it is sent, up to this
    # many (never waiting for more). 1: a response a token, as Triton streams.
    max_tokens_per_response: int = 1
    # Where the engine runs: `process`, an engine core of its own
    # (`engine_core.py`); `thread`, a worker thread of the agent's process;
    # `auto`, a process where the engine runs on a GPU.
    engine_core: str = "auto"
    vision: VisionStageConfig | None = None  # a vision-language model's vision stage

    def __post_init__(self) -> None:
        if self.engine_core not in ENGINE_CORE_LAYOUTS:
            raise ConfigError(f"engine_core: {self.engine_core!r} is not one of "
                              f"{', '.join(ENGINE_CORE_LAYOUTS)}")
        if self.max_queue_wait_ms < 0:
            raise ConfigError(f"max_queue_wait_ms: must be >= 0, got {self.max_queue_wait_ms}")
        if self.max_tokens_per_response < 1:
            raise ConfigError("max_tokens_per_response: must be >= 1, got "
                              f"{self.max_tokens_per_response}")


@dataclass(frozen=True)
class EnsembleStep:
    """One model the ensemble runs: `inputs` maps each of the model's inputs
    to the ensemble tensor it reads, `outputs` each output it keeps to the
    ensemble tensor it becomes (Triton's input_map and output_map)."""

    model: str
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    version: int = LATEST

    def __post_init__(self) -> None:
        check_model_name(self.model)
        if self.version != LATEST and self.version < 1:
            raise ConfigError(f"version: {LATEST} (the newest) or a version >= 1, "
                              f"got {self.version}")
        if not self.outputs:
            raise ConfigError("outputs: a step keeps at least one of its model's outputs")
        tensors = list(self.outputs.values())
        if len(tensors) != len(set(tensors)):
            raise ConfigError(f"outputs: two outputs become one ensemble tensor ({tensors})")


@dataclass(frozen=True)
class Ensemble:
    steps: tuple[EnsembleStep, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError("steps: an ensemble runs at least one step")


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions on disk are served: the newest `latest`, `all`, or `specific`."""

    latest: int | None = None
    all: bool = False
    specific: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        chosen = (self.latest is not None) + self.all + (self.specific is not None)
        if chosen > 1:
            raise ConfigError("give one of latest, all or specific")
        if self.latest is not None and self.latest < 1:
            raise ConfigError(f"latest: must be >= 1, got {self.latest}")

    def select(self, available: Iterable[int]) -> list[int]:
        versions = sorted(set(available))
        if self.all:
            return versions
        if self.specific is not None:
            return [v for v in versions if v in self.specific]
        return versions[-(self.latest or 1):]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    backend: str = "onnxruntime"
    max_batch_size: int = 0
    inputs: tuple[TensorConfig, ...] = ()
    outputs: tuple[TensorConfig, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    version_policy: VersionPolicy = VersionPolicy()
    instance_count: int = 1
    max_queue_size: int = 256  # the bound when requests are not batched
    engine: Mapping[str, Any] = field(default_factory=dict)
    generation: Generation | None = None  # set for a generative backend (decoupled)
    sequence_batching: SequenceBatching | None = None  # stateful: sequences.py
    decoupled: bool = False  # answers a request with a stream of responses (Triton's)
    ensemble: Ensemble | None = None  # set for backend `ensemble`

    def __post_init__(self) -> None:
        check_model_name(self.name)
        if self.ensemble is None and self.backend == ENSEMBLE:
            raise ConfigError(f"ensemble: required for backend {ENSEMBLE!r} (its steps)")
        if self.ensemble is not None and self.backend != ENSEMBLE:
            raise ConfigError(f"ensemble: only for backend {ENSEMBLE!r}, not "
                              f"{self.backend!r}")
        if self.ensemble is not None:
            check_ensemble_graph(self)
        if self.generation is not None and not self.decoupled:
            raise ConfigError("decoupled: a generative model streams its tokens; "
                              "leave it out or set it true")
        if self.decoupled and self.generation is None and (
                self.max_batch_size or self.sequence_batching is not None):
            raise ConfigError("decoupled: its responses are the rows of its outputs' first "
                              "axis, so it neither batches requests nor keeps sequences; "
                              "set max_batch_size: 0 and leave out sequence_batching")
        if self.sequence_batching is not None and (self.dynamic_batching is not None
                                                   or self.generation is not None):
            raise ConfigError("sequence_batching: a model has one scheduler; leave out "
                              "dynamic_batching (sequences of different IDs batch together)")
        if (self.generation is not None) != (self.backend in GENERATIVE_BACKENDS):
            raise ConfigError(f"generation: only for the generative backends "
                              f"({', '.join(GENERATIVE_BACKENDS)})")
        if self.generation is not None and (self.max_batch_size or self.dynamic_batching):
            raise ConfigError("max_batch_size, dynamic_batching: a generative model batches "
                              "its sequences itself (engine.max_sequences); leave them out")
        if self.max_batch_size < 0:
            raise ConfigError(f"max_batch_size: must be >= 0, got {self.max_batch_size}")
        if self.dynamic_batching is not None:
            if self.max_batch_size < 1:
                raise ConfigError("dynamic_batching: needs max_batch_size >= 1")
            too_large = [s for s in self.dynamic_batching.preferred_batch_sizes
                         if s > self.max_batch_size]
            if too_large:
                raise ConfigError(
                    f"dynamic_batching: preferred_batch_sizes {too_large} exceed "
                    f"max_batch_size {self.max_batch_size}"
                )
        if self.instance_count < 1:
            raise ConfigError(f"instance_count: must be >= 1, got {self.instance_count}")
        for kind in ("inputs", "outputs"):
            names = [t.name for t in getattr(self, kind)]
            if len(names) != len(set(names)):
                raise ConfigError(f"{kind}: tensor names must be unique, got {names}")

    @property
    def splits_responses(self) -> bool:
        """A decoupled model whose responses are its outputs' rows (not generative)."""
        return self.decoupled and self.generation is None

    def batch_shape(self, tensor: TensorConfig) -> tuple[int, ...]:
        """The full shape a request (or a response) carries: -1 leads when the
        model batches."""
        return (-1, *tensor.dims) if self.max_batch_size > 0 else tensor.dims

    def engine_shape(self, tensor: TensorConfig, output: bool) -> tuple[int, ...]:
        """The full shape the engine's tensor has: a decoupled model's outputs
        lead with their responses."""
        if output and self.splits_responses:
            return (-1, *tensor.dims)
        return self.batch_shape(tensor)


def check_ensemble_graph(config: ModelConfig) -> None:
    """An ensemble's tensors flow: each is produced once (an ensemble input or
    one step's output), every step input and ensemble output is produced,
    every ensemble input is read, and no step waits on itself. Pure; the
    steps' models are checked when the ensemble loads (`ensemble.py`)."""
    assert config.ensemble is not None
    if config.dynamic_batching or config.sequence_batching or config.generation:
        raise ConfigError("ensemble: an ensemble has no scheduler of its own (its steps' "
                          "models batch); leave out dynamic_batching and sequence_batching")
    if config.decoupled:
        raise ConfigError("decoupled: an ensemble answers each request once (its steps' "
                          "models may not stream); leave it out")
    if not config.inputs or not config.outputs:
        raise ConfigError("inputs, outputs: an ensemble declares both (it has no model "
                          "file to read them from)")
    producer = {t.name: "an ensemble input" for t in config.inputs}
    for index, step in enumerate(config.ensemble.steps):
        if step.model == config.name:
            raise ConfigError(f"ensemble.steps[{index}].model: an ensemble cannot be its "
                              "own step")
        for output, tensor in step.outputs.items():
            if tensor in producer:
                raise ConfigError(f"ensemble.steps[{index}].outputs.{output}: tensor "
                                  f"{tensor!r} is already produced by {producer[tensor]}")
            producer[tensor] = f"steps[{index}] (model {step.model!r})"
    read = set()
    for index, step in enumerate(config.ensemble.steps):
        for name, tensor in step.inputs.items():
            if tensor not in producer:
                raise ConfigError(f"ensemble.steps[{index}].inputs.{name}: tensor "
                                  f"{tensor!r} is no ensemble input and no step's output")
            read.add(tensor)
    for tensor in config.outputs:
        if producer.get(tensor.name, "an ensemble input") == "an ensemble input":
            raise ConfigError(f"outputs: ensemble output {tensor.name!r} is produced by no "
                              "step (map a step's output to it)")
    unread = [t.name for t in config.inputs if t.name not in read]
    if unread:
        raise ConfigError(f"inputs: ensemble input {unread[0]!r} is read by no step")
    cycle = step_cycle(config.ensemble)
    if cycle:
        raise ConfigError("ensemble.steps: steps wait on each other in a cycle: "
                          + " -> ".join(f"steps[{i}] ({config.ensemble.steps[i].model})"
                                        for i in cycle))


def step_dependencies(ensemble: Ensemble) -> list[set[int]]:
    """For each step, the steps whose outputs it reads."""
    made_by = {tensor: index for index, step in enumerate(ensemble.steps)
               for tensor in step.outputs.values()}
    return [{made_by[t] for t in step.inputs.values() if t in made_by}
            for step in ensemble.steps]


def step_cycle(ensemble: Ensemble) -> list[int]:
    """Steps that wait on each other in a cycle (the first back to itself); [] if none."""
    after = step_dependencies(ensemble)
    state: dict[int, str] = {}
    path: list[int] = []

    def visit(step: int) -> list[int]:
        state[step] = "visiting"
        path.append(step)
        for before in sorted(after[step]):
            if state.get(before) == "visiting":
                return [*path[path.index(before):], before]
            if before not in state:
                found = visit(before)
                if found:
                    return found
        path.pop()
        state[step] = "done"
        return []

    for step in range(len(after)):
        if step not in state:
            found = visit(step)
            if found:
                return found
    return []


def parse_model_config(
    name: str, data: Mapping[str, Any], profile: TierProfile, where: str
) -> ModelConfig:
    """config.yaml's mapping, laid over the tier profile's defaults."""
    data = dict(data)
    if data.setdefault("name", name) != name:
        raise ConfigError(f"{where}.name: {data['name']!r} differs from its directory {name!r}")
    if isinstance(data.get("dynamic_batching"), Mapping):
        data["dynamic_batching"] = {**profile.dynamic_batching, **data["dynamic_batching"]}
    elif data.get("dynamic_batching") is not None:
        raise ConfigError(f"{where}.dynamic_batching: expected a mapping")
    backend = data.setdefault("backend", profile.engine)
    defaults = profile.backends.get(backend, {}) if isinstance(backend, str) else {}
    if isinstance(data.get("engine", {}), Mapping):
        data["engine"] = {**defaults, **data.get("engine", {})}
    data.setdefault("instance_count", profile.instance_count)
    data.setdefault("max_queue_size", profile.limits.max_queue_size)
    if backend in GENERATIVE_BACKENDS:
        data.setdefault("generation", {})
        data.setdefault("decoupled", True)
    return load_dataclass(ModelConfig, data, where)


def complete_with_engine(config: ModelConfig, inputs: Iterable[TensorSpec],
                         outputs: Iterable[TensorSpec], where: str) -> ModelConfig:
    """Fill inputs/outputs the config left out from the model; check the rest
    agree. A sequence batcher's control and state tensors are the agent's,
    never a client's: they are left out."""
    sequences = config.sequence_batching
    fed = sequences.fed_inputs if sequences else frozenset()
    kept = sequences.state_outputs if sequences else frozenset()
    inputs, outputs = tuple(inputs), tuple(outputs)
    if sequences:
        _check_sequence_tensors(sequences, inputs, outputs, f"{where}.sequence_batching")
    inputs = tuple(spec for spec in inputs if spec.name not in fed)
    outputs = tuple(spec for spec in outputs if spec.name not in kept)
    filled = {}
    for kind, specs in (("inputs", tuple(inputs)), ("outputs", tuple(outputs))):
        declared = getattr(config, kind)
        if not declared:
            filled[kind] = tuple(_from_spec(config, spec, f"{where}.{kind}", kind == "outputs")
                                 for spec in specs)
            continue
        by_name = {spec.name: spec for spec in specs}
        for index, tensor in enumerate(declared):
            spec = by_name.get(tensor.name)
            field_name = f"{where}.{kind}[{index}]"
            if spec is None:
                raise ConfigError(
                    f"{field_name}.name: the model has no {kind[:-1]} {tensor.name!r} "
                    f"(it has {', '.join(by_name)})"
                )
            actual = codec.datatype_of(spec.dtype)
            if actual != tensor.datatype:
                raise ConfigError(
                    f"{field_name}.datatype: config says {tensor.datatype}, the model has {actual}"
                )
            declared_shape = config.engine_shape(tensor, kind == "outputs")
            if len(declared_shape) != len(spec.shape) or any(
                d != -1 and m != -1 and d != m for d, m in zip(declared_shape, spec.shape)
            ):
                raise ConfigError(
                    f"{field_name}.dims: {list(tensor.dims)} (full shape "
                    f"{list(declared_shape)}) cannot fit the model's {list(spec.shape)}"
                )
        if kind == "inputs":
            missing = set(by_name) - {t.name for t in declared}
            if missing:
                raise ConfigError(f"{where}.inputs: the model also needs {', '.join(sorted(missing))}")
    return replace(config, **filled)


def _check_sequence_tensors(sequences: SequenceBatching, inputs: tuple[TensorSpec, ...],
                            outputs: tuple[TensorSpec, ...], where: str) -> None:
    """Each control and state names a model tensor of its type."""
    types = {("input", s.name): codec.datatype_of(s.dtype) for s in inputs}
    types |= {("output", s.name): codec.datatype_of(s.dtype) for s in outputs}
    wanted = [(("input", c.name), c.datatype) for c in sequences.controls]
    for state in sequences.states:
        wanted += [(("input", state.input), state.datatype),
                   (("output", state.output), state.datatype)]
    for (kind, name), datatype in wanted:
        actual = types.get((kind, name))
        if actual is None:
            raise ConfigError(f"{where}: the model has no {kind} {name!r}")
        if actual != datatype:
            raise ConfigError(f"{where}: {kind} {name!r} is {actual} in the model, "
                              f"{datatype} in the config")


def _from_spec(config: ModelConfig, spec: TensorSpec, where: str, output: bool) -> TensorConfig:
    shape = spec.shape
    if output and config.splits_responses:
        if not shape:
            raise ConfigError(f"{where}: {spec.name!r} is a scalar; a decoupled model's "
                              "outputs lead with an axis of responses")
        shape = shape[1:]
    elif config.max_batch_size > 0:
        if not shape or shape[0] != -1:
            raise ConfigError(
                f"{where}: {spec.name!r} has shape {list(shape)} with no variable batch "
                "dimension; set max_batch_size: 0 or declare the tensors"
            )
        shape = shape[1:]
    return TensorConfig(spec.name, codec.datatype_of(spec.dtype), tuple(shape))

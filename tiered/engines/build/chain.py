"""The build's own description of an ensemble: its steps, which tensors each
reads and writes, the order they run in, and how each step is lowered for a
tier. Pure; nothing here reads files or opens an engine.

An ensemble is built from a Triton-style source repository:

    SRC/<ensemble>/config.pbtxt (or config.yaml)   platform "ensemble" and its steps
    SRC/<step model>/<version>/model.onnx           each step model's FP32 ONNX

The caller (`tiered build`) reads the ensemble's config with the agent's own
parser and hands the build an `EnsembleChain`: the build may not import
tiered.agent, and must never parse a config the agent would read differently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tiered import names
from tiered.engines import TensorSpec
from tiered.errors import ConfigError

NEWEST = -1  # a step's version: the newest version directory of its model

# Runs one step: (step index, the model's inputs by name) -> its outputs by name.
RunStep = Callable[[int, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class ChainStep:
    """One step: `inputs` maps the model's inputs to the ensemble tensors they
    read, `outputs` the model's outputs it keeps to the tensors they become."""

    model: str
    version: int  # NEWEST or a version >= 1
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]


@dataclass(frozen=True)
class EnsembleChain:
    name: str
    config_file: str  # the ensemble's config in the source: config.pbtxt or config.yaml
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    max_batch_size: int
    steps: tuple[ChainStep, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError(f"ensemble {self.name!r}: steps: an ensemble runs at least one step")
        models = [step.model for step in self.steps]
        if len(models) != len(set(models)):
            raise ConfigError(f"ensemble {self.name!r}: steps: a build makes one version of "
                              f"each step model; {models} names one model twice")

    @property
    def order(self) -> tuple[int, ...]:
        """Step indices in an order that runs each after the steps it reads from."""
        made_by = {tensor: index for index, step in enumerate(self.steps)
                   for tensor in step.outputs.values()}
        waits = [{made_by[t] for t in step.inputs.values() if t in made_by}
                 for step in self.steps]
        done: list[int] = []
        while len(done) < len(self.steps):
            ready = [i for i in range(len(self.steps))
                     if i not in done and waits[i] <= set(done)]
            if not ready:
                raise ConfigError(f"ensemble {self.name!r}: steps wait on each other in a cycle")
            done.append(ready[0])
        return tuple(done)


def run_chain(chain: EnsembleChain, feeds: Mapping[str, np.ndarray],
              run_step: RunStep) -> dict[str, np.ndarray]:
    """Every ensemble tensor (inputs, intermediates, outputs) after running the
    steps in order on `feeds`; a missing tensor is an error naming it."""
    tensors = dict(feeds)
    for index in chain.order:
        step = chain.steps[index]
        missing = [t for t in step.inputs.values() if t not in tensors]
        if missing:
            raise ConfigError(f"ensemble {chain.name!r}: steps[{index}] ({step.model}) reads "
                              f"{missing[0]!r}, which no ensemble input or step produces")
        answer = run_step(index, {name: tensors[t] for name, t in step.inputs.items()})
        for output, tensor in step.outputs.items():
            tensors[tensor] = answer[output]
    return tensors


def input_specs(chain: EnsembleChain,
                step_inputs: Sequence[Sequence[TensorSpec]]) -> tuple[TensorSpec, ...]:
    """The ensemble's inputs as TensorSpecs: each as the first step model input
    that reads it takes it (`step_inputs`: each step model's inputs)."""
    specs = {}
    for step, inputs in zip(chain.steps, step_inputs, strict=True):
        by_name = {spec.name: spec for spec in inputs}
        for name, tensor in step.inputs.items():
            if name not in by_name:
                raise ConfigError(f"ensemble {chain.name!r}: model {step.model!r} has no "
                                  f"input {name!r} (it has {', '.join(by_name)})")
            if tensor in chain.inputs and tensor not in specs:
                spec = by_name[name]
                specs[tensor] = TensorSpec(tensor, spec.dtype, spec.shape)
    unread = [t for t in chain.inputs if t not in specs]
    if unread:
        raise ConfigError(f"ensemble {chain.name!r}: input {unread[0]!r} is read by no step")
    return tuple(specs[t] for t in chain.inputs)


def rows_per_run(step_inputs: Sequence[Sequence[TensorSpec]]) -> int | None:
    """Rows the chain runs at a time: None when every step model takes a variable
    batch, 1 when any is fixed at one row (others take one row as well)."""
    leading = {spec.shape[0] if spec.shape else 0 for inputs in step_inputs for spec in inputs}
    if leading <= {-1}:
        return None
    if leading <= {-1, 1}:
        return 1
    raise ConfigError(
        "inputs: a build feeds samples along the leading dimension, which must be a "
        "variable batch dimension or 1; the step models have "
        f"{[[list(s.shape) for s in inputs] for inputs in step_inputs]}"
    )


@dataclass(frozen=True)
class StepLowering:
    """How one step model is built for the tier, and why where it is not as asked."""

    backend: str
    precision: str
    kept_fp32: str | None = None  # why the step stays FP32 ONNX Runtime, when it does


def choose_step_lowering(backend: str, precision: str,
                         tensors: Sequence[TensorSpec]) -> StepLowering:
    """The tier's backend and precision for a step whose inputs and outputs are
    all floating point; FP32 on ONNX Runtime for one with other tensors (uint8
    pre-processing, integer post-processing): quantizing or converting them
    gains nothing and their integer tensors cannot be compared within a
    tolerance."""
    others = [f"{spec.name} ({spec.dtype})" for spec in tensors if spec.dtype.kind != "f"]
    if not others or (backend, precision) == (names.Backend.ONNXRUNTIME, names.Precision.FP32):
        return StepLowering(backend, precision)
    return StepLowering(names.Backend.ONNXRUNTIME.value, names.Precision.FP32.value,
                        f"kept FP32: not floating point: {', '.join(others)}")

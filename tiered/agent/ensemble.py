"""Ensembles: one model made of steps that run other models the agent serves.

An ensemble (`backend: ensemble`, Triton's `platform: "ensemble"`) declares
its inputs and outputs; each step runs a model of this agent, reading
ensemble tensors as the model's inputs and naming the outputs it keeps as
ensemble tensors (`config.EnsembleStep`). A request runs on the agent's
event loop: a step starts once the tensors it reads are ready, so steps that
wait on nothing else run side by side, and the arrays one step answers are
the arrays the next one reads: no copy and no serialization between steps.
Only the steps the requested outputs need run.

Steps call their models' served versions, looked up at each request, so a
reloaded step model serves the next request and an unloaded one fails it
with the step's name. Each step model's own statistics count the calls the
ensemble made, and the ensemble's statistics are Triton's for an ensemble:
its requests, with the compute of its steps summed; each step's time and
failures are kept apart (`StepStats`, Prometheus).

`check_steps` and `load_order` are pure. An ensemble never opens an engine
and owns no device: its energy is its steps' models'.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace

from tiered.agent.config import LATEST, ModelConfig, step_dependencies
from tiered.agent.model import Admissions, Answer, check_inputs, check_outputs, record_failure
from tiered.agent.sequences import SequenceFlags
from tiered.errors import ConfigError, TieredError, Unavailable
from tiered.telemetry.histogram import CumulativeHistogram
from tiered.telemetry.inference_stats import BatchTiming, InferenceStats
from tiered.telemetry.recorder import VersionRecorder

Lookup = Callable[[str, str], object]  # (model, version or "") -> its served version


def step_version(version: int) -> str:
    """A step's version as a request names it: "" for the newest."""
    return "" if version == LATEST else str(version)


def check_steps(config: ModelConfig, models: Sequence[ModelConfig], where: str) -> None:
    """The ensemble's steps against their models' configs (`models`, one per
    step): each model input fed, each output kept one the model has, and
    every tensor of the same datatype and a shape that fits wherever it
    goes, as far as both sides say."""
    assert config.ensemble is not None
    # tensor -> (datatype, full shape, where it comes from)
    made = {t.name: (t.datatype, config.batch_shape(t), f"ensemble input {t.name!r}")
            for t in config.inputs}
    for index, (step, model) in enumerate(zip(config.ensemble.steps, models)):
        at = f"{where}.ensemble.steps[{index}]"
        if model.decoupled:
            raise ConfigError(f"{at}.model: {step.model!r} is decoupled (it streams its "
                              "answers); an ensemble of it is not served")
        if config.max_batch_size > model.max_batch_size > 0:
            raise ConfigError(f"{where}.max_batch_size: {config.max_batch_size} exceeds "
                              f"steps[{index}] model {step.model!r}'s {model.max_batch_size}")
        inputs = {t.name: t for t in model.inputs}
        for name in step.inputs:
            if name not in inputs:
                raise ConfigError(f"{at}.inputs.{name}: model {step.model!r} has no input "
                                  f"{name!r} (it has {', '.join(inputs)})")
        unfed = [t.name for t in model.inputs if t.name not in step.inputs and not t.optional]
        if unfed:
            raise ConfigError(f"{at}.inputs: model {step.model!r} also needs "
                              f"{', '.join(map(repr, unfed))}")
        outputs = {t.name: t for t in model.outputs}
        for name, tensor in step.outputs.items():
            if name not in outputs:
                raise ConfigError(f"{at}.outputs.{name}: model {step.model!r} has no output "
                                  f"{name!r} (it has {', '.join(outputs)})")
            made[tensor] = (outputs[name].datatype, model.batch_shape(outputs[name]),
                            f"steps[{index}] output {name!r}")
    for index, (step, model) in enumerate(zip(config.ensemble.steps, models)):
        inputs = {t.name: t for t in model.inputs}
        for name, tensor in step.inputs.items():
            wanted = inputs[name]
            _check_fits(made[tensor], wanted.datatype, model.batch_shape(wanted),
                        f"{where}.ensemble.steps[{index}].inputs.{name}",
                        f"model {step.model!r} input {name!r}", tensor)
    for tensor in config.outputs:
        _check_fits(made[tensor.name], tensor.datatype, config.batch_shape(tensor),
                    f"{where}.outputs", f"ensemble output {tensor.name!r}", tensor.name)


def _check_fits(made: tuple[str, tuple[int, ...], str], datatype: str, shape: tuple[int, ...],
                at: str, what: str, tensor: str) -> None:
    made_type, made_shape, source = made
    if made_type != datatype:
        raise ConfigError(f"{at}: tensor {tensor!r} is {made_type} ({source}), {what} "
                          f"takes {datatype}")
    if len(made_shape) != len(shape) or any(
            a != -1 and b != -1 and a != b for a, b in zip(made_shape, shape)):
        raise ConfigError(f"{at}: tensor {tensor!r} has shape {list(made_shape)} ({source}), "
                          f"{what} takes {list(shape)} (-1: any size)")


def load_order(uses: Mapping[str, Collection[str]]) -> tuple[list[str], dict[str, str]]:
    """Models in an order that loads each after the models its ensemble steps
    use (`uses`: model -> models it uses), and those that use each other in a
    cycle apart, with why. Models not in `uses` are left to fail on loading."""
    order: list[str] = []
    refused: dict[str, str] = {}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in done:
            return
        if name in path:
            cycle = [*path[path.index(name):], name]
            for member in cycle[:-1]:
                refused[member] = "ensembles use each other in a cycle: " + " -> ".join(cycle)
            return
        path.append(name)
        for used in sorted(uses[name]):
            if used in uses:
                visit(used, path)
        path.pop()
        done.add(name)
        order.append(name)

    for name in sorted(uses):
        visit(name, [])
    return [name for name in order if name not in refused], refused


@dataclass
class StepStats:
    """One step's calls made by its ensemble: each one's time from its start
    to its answer (the step model's queue and compute in it), and failures."""

    model: str
    seconds: CumulativeHistogram = field(default_factory=CumulativeHistogram)
    failures: int = 0


class EnsembleVersion:
    """Created and used on the agent's event loop; reads the same attributes
    as `model.ModelVersion` for the servicer, telemetry and metrics."""

    on_gpu = False  # it runs nothing itself

    def __init__(self, config: ModelConfig, version: int, lookup: Lookup,
                 built_from: object = None, recorder: VersionRecorder | None = None,
                 build: dict[str, str] | None = None) -> None:
        assert config.ensemble is not None
        self.config = config
        self.version = version
        self.built_from = built_from  # a reload rebuilds only when this changes
        self.stats = InferenceStats()
        self.recorder = recorder
        self.build = dict(build or {})  # key figures of `tiered build`'s verdict on the chain
        self.devices: tuple[str, ...] = ()  # its steps' models run on theirs
        self.admissions = Admissions(config.name, version)
        self.steps = config.ensemble.steps
        self.step_stats = [StepStats(step.model) for step in self.steps]
        self._lookup = lookup
        self._after = step_dependencies(config.ensemble)
        self._made_by = {tensor: index for index, step in enumerate(self.steps)
                         for tensor in step.outputs.values()}

    def describe(self) -> dict[str, str]:
        return {"steps": ", ".join(step.model for step in self.steps)}

    @property
    def ready(self) -> bool:
        """Every step's model serves."""
        try:
            return all(self._served(index).ready for index in range(len(self.steps)))
        except TieredError:
            return False

    @property
    def queue_depth(self) -> int:
        return 0  # it queues nothing itself: its steps wait in their models' queues

    @property
    def in_flight(self) -> int:
        return self.admissions.count

    def count_rejected(self, error: TieredError) -> None:
        """A request for this version that could not even be decoded."""
        record_failure(self.stats, self.recorder, 0, error)

    async def infer(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] = (),
                    deadline: float = math.inf, tracer: trace.Tracer | None = None,
                    requests: Sequence[int] = (), sequence: SequenceFlags | None = None,
                    ) -> dict[str, np.ndarray]:
        """As `ModelVersion.infer`; `sequence` goes to every step."""
        answer = await self.infer_timed(inputs, requested, deadline, tracer, requests, sequence)
        return answer.outputs

    async def infer_timed(self, inputs: Mapping[str, np.ndarray], requested: Sequence[str] = (),
                          deadline: float = math.inf, tracer: trace.Tracer | None = None,
                          requests: Sequence[int] = (), sequence: SequenceFlags | None = None,
                          ) -> Answer:
        """Triton's statistics of an ensemble: its queue is the time before
        its first step starts; its compute, its steps' summed; one execution
        a request."""
        started = time.perf_counter_ns()
        with self.admissions.request():
            try:
                outputs = check_outputs(self.config, requested)
                batch_size = check_inputs(self.config, inputs)
                tensors, first_step_ns, answers = await self._run(
                    dict(inputs), outputs, deadline, tracer, sequence)
            except TieredError as error:
                for _ in requests or (None,):
                    record_failure(self.stats, self.recorder, time.perf_counter_ns() - started,
                                   error)
                raise
        elapsed_ns = time.perf_counter_ns() - started
        queue_ns = first_step_ns - started
        timing = BatchTiming(sum(a.timing.input_ns for a in answers),
                             sum(a.timing.infer_ns for a in answers),
                             sum(a.timing.output_ns for a in answers))
        now_ms = time.time_ns() // 1_000_000
        for rows in requests or (batch_size,):
            self.stats.request_succeeded(elapsed_ns, queue_ns, timing, now_ms)
            if self.recorder is not None:
                self.recorder.request_succeeded(elapsed_ns / 1e9, queue_ns / 1e9,
                                                timing.infer_ns / 1e9, rows)
        self.stats.batch_executed(batch_size, timing)
        return Answer({name: tensors[name] for name in outputs}, queue_ns, timing)

    def _needed(self, outputs: Sequence[str]) -> set[int]:
        """The steps that the outputs wait on."""
        needed: set[int] = set()
        frontier = [self._made_by[name] for name in outputs]
        while frontier:
            index = frontier.pop()
            if index not in needed:
                needed.add(index)
                frontier.extend(self._after[index])
        return needed

    async def _run(self, tensors: dict[str, np.ndarray], outputs: Sequence[str],
                   deadline: float, tracer: trace.Tracer | None,
                   sequence: SequenceFlags | None) -> tuple[dict, int, list[Answer]]:
        """Run each needed step once the tensors it reads are ready; the first
        step's error ends the request (the others are cancelled)."""
        waiting = self._needed(outputs)
        running: dict[asyncio.Task, int] = {}
        answers: list[Answer] = []
        first_step_ns = 0
        try:
            while waiting or running:
                for index in sorted(waiting):
                    if all(t in tensors for t in self.steps[index].inputs.values()):
                        waiting.discard(index)
                        first_step_ns = first_step_ns or time.perf_counter_ns()
                        running[asyncio.create_task(
                            self._step(index, tensors, deadline, tracer, sequence))] = index
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = running.pop(task)
                    answer = task.result()
                    for output, tensor in self.steps[index].outputs.items():
                        tensors[tensor] = answer.outputs[output]
                    answers.append(answer)
        finally:
            for task in running:
                task.cancel()
        return tensors, first_step_ns, answers

    async def _step(self, index: int, tensors: Mapping[str, np.ndarray], deadline: float,
                    tracer: trace.Tracer | None, sequence: SequenceFlags | None) -> Answer:
        step, stats = self.steps[index], self.step_stats[index]
        started = time.perf_counter_ns()
        try:
            served = self._served(index)
            inputs = {name: tensors[tensor] for name, tensor in step.inputs.items()}
            if tracer is None:
                answer = await served.infer_timed(inputs, tuple(step.outputs), deadline,
                                                  sequence=sequence)
            else:
                with tracer.start_as_current_span(f"step {index}",
                                                  attributes={"tiered.model": step.model}):
                    answer = await served.infer_timed(inputs, tuple(step.outputs), deadline,
                                                      tracer, sequence=sequence)
        except TieredError as error:
            stats.failures += 1
            raise type(error)(f"ensemble {self.config.name!r} steps[{index}] (model "
                              f"{step.model!r}): {error}") from error
        stats.seconds.observe((time.perf_counter_ns() - started) / 1e9)
        return answer

    def _served(self, index: int):
        """The step model's served version now."""
        step = self.steps[index]
        try:
            served = self._lookup(step.model, step_version(step.version))
        except TieredError as error:
            raise Unavailable(f"its model is not served ({error})") from error
        if served.config.decoupled:
            raise Unavailable("its model is decoupled now (it streams its answers); an "
                              "ensemble cannot run it")
        return served

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests and let those running finish."""
        await self.admissions.close(timeout_s)

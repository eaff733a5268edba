"""One served generative model version: its engine driven by a scheduler
(on a worker thread here, or as an engine core in a process of its own:
`engine_core.py`), its statistics, token telemetry and drain.

The agent's counterpart of `model.ModelVersion` for decoupled models: the
repository, servicer, telemetry and metrics read the same attributes
(`config`, `version`, `engine`, `stats`, `recorder`, `queue_depth`,
`in_flight`, `drain`). A request becomes a stream of `Piece`s, one per token,
handed to its reader as they come (`start`, `Generation`) or read as an
async iterator (`generate`); leaving early (the client went away) frees its
sequence. A
vision-language version also holds its vision stage (`vision_language.py`):
a request's images become visual tokens before it joins the scheduler, and
a unary call asking for `visual_tokens` alone runs only that stage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tiered.agent.config import ModelConfig, TensorConfig
from tiered.agent.engine_core import CoreScheduler, EngineCores
from tiered.agent.generation import (
    STOP,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TOKEN_IDS,
    GenerationRequest,
    parse_request,
)
from tiered.agent.model import Admissions, record_failure
from tiered.agent.scheduler import Job, Piece, Scheduler, SchedulerLimits, domain_error
from tiered.agent.vision_language import VisionStage
from tiered.engines.generative.base import GenerativeEngine
from tiered.engines.generative.chat import ChatTemplate
from tiered.errors import ConfigError, InvalidArgument, TieredError
from tiered.protocol.messages import IMAGE, VISUAL_TOKENS
from tiered.telemetry.inference_stats import BatchTiming, InferenceStats
from tiered.telemetry.recorder import VersionRecorder
from tiered.telemetry.token_stats import TokenStats

log = logging.getLogger(__name__)

INPUTS = (
    TensorConfig(TEXT_INPUT, "BYTES", (1,)),
    TensorConfig("max_tokens", "INT32", (1,), optional=True),
    TensorConfig("temperature", "FP32", (1,), optional=True),
    TensorConfig("top_p", "FP32", (1,), optional=True),
    TensorConfig("seed", "UINT64", (1,), optional=True),
    TensorConfig(STOP, "BYTES", (-1,), optional=True),
)
OUTPUTS = (TensorConfig(TEXT_OUTPUT, "BYTES", (1,)), TensorConfig(TOKEN_IDS, "INT64", (-1,)))
# A vision-language model's, besides: pixels (UINT8 [H, W, C]; BYTES, encoded
# images, are taken too) or the vision stage's output made elsewhere.
VISION_INPUTS = (
    TensorConfig(IMAGE, "UINT8", (-1, -1, -1), optional=True),
    TensorConfig(VISUAL_TOKENS, "FP32", (-1, -1, -1), optional=True),
)


def with_tensors(config: ModelConfig, where: str) -> ModelConfig:
    """A generative model's config with its fixed tensors; declared ones must match."""
    assert config.generation is not None
    inputs = (*INPUTS, *(VISION_INPUTS if config.generation.vision is not None else ()))
    for kind, fixed in (("inputs", inputs), ("outputs", OUTPUTS)):
        declared = {t.name for t in getattr(config, kind)}
        if declared and declared - {t.name for t in fixed}:
            raise ConfigError(
                f"{where}.{kind}: a generative model's {kind} are "
                f"{', '.join(t.name for t in fixed)}; it has no "
                f"{', '.join(sorted(declared - {t.name for t in fixed}))}")
    return replace(config, inputs=inputs, outputs=OUTPUTS)


class GenerativeVersion:
    """Created and used on the agent's event loop."""

    def __init__(self, config: ModelConfig, version: int, engine: GenerativeEngine | EngineCores,
                 tokenizer: tuple[str, str], built_from: Hashable = None,
                 recorder: VersionRecorder | None = None,
                 build: Mapping[str, str] | None = None, device: str = "",
                 chat: ChatTemplate | None = None, vision: VisionStage | None = None) -> None:
        assert config.generation is not None
        self.chat = chat or ChatTemplate()  # chat messages to a prompt
        self.vision = vision  # a vision-language model's vision stage
        self.config = config
        self.version = version
        self.engine = engine
        # (backend, path): where a front end opens its tokenizer (`open_tokenizer`)
        self.tokenizer = tokenizer
        # as the energy ledger names them: a core's each, else the engine's
        labels = engine.labels if isinstance(engine, EngineCores) else ()
        self.devices = labels or (device or engine.device,)
        self.ready = True
        self.built_from = built_from
        self.stats = InferenceStats()  # Triton's shape: a step is an execution
        self.tokens = TokenStats()
        self.recorder = recorder
        self.build = dict(build or {})
        # Engine cores run the sequence loop themselves; else a worker thread here.
        scheduler = CoreScheduler if isinstance(engine, EngineCores) else Scheduler
        self.scheduler = scheduler(
            engine,
            SchedulerLimits(config.max_queue_size, config.generation.max_queue_wait_ms / 1e3),
            asyncio.get_running_loop(), on_step=self._stepped,
            name=f"{config.name}-v{version}")
        self.admissions = Admissions(config.name, version)

    def describe(self) -> dict[str, str]:
        """Facts of its engine for users."""
        return self.engine.describe()

    @property
    def on_gpu(self) -> bool:
        return self.engine.device != "cpu"

    @property
    def queue_depth(self) -> int:
        return self.scheduler.waiting

    @property
    def in_flight(self) -> int:
        return self.admissions.count

    @property
    def running(self) -> int:
        """Sequences in the engine's batch after its last step."""
        return self.scheduler.running

    def parse(self, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any]
              ) -> GenerationRequest:
        try:
            if self.vision is None:
                return parse_request(inputs, parameters, self.config.name, self.chat)
            text = {k: v for k, v in inputs.items() if k not in (IMAGE, VISUAL_TOKENS)}
            return self.vision.take(parse_request(text, parameters, self.config.name,
                                                  self.chat), inputs)
        except TieredError as error:
            self.count_rejected(error)
            raise

    def count_rejected(self, error: TieredError) -> None:
        self._failed(0, error)

    def _failed(self, elapsed_ns: int, error: TieredError) -> None:
        record_failure(self.stats, self.recorder, elapsed_ns, error)

    def _stepped(self, seconds: float, sequences: int, device: str | None = None) -> None:
        self.stats.batch_executed(sequences, BatchTiming(0, int(seconds * 1e9), 0))
        if self.recorder is not None:
            self.recorder.batch_ran(seconds, device or self.devices[0], sequences)

    def start(self, request: GenerationRequest, deadline: float,
              deliver: Callable[[Piece | TieredError], None]) -> Generation:
        """Answer a request as its pieces come: `deliver` gets each on the
        event loop, then or else the error that ends it (see `Generation`).
        A refusal that comes at once (the version unloading, its queue full)
        is raised; a request's images become visual tokens first."""
        generation = Generation(self, deliver)
        if request.images is None:
            try:
                generation.submit(request, deadline)
            except TieredError as error:
                generation.fail(error)
                raise
        else:
            generation.encoding = asyncio.get_running_loop().create_task(
                generation.encoded_first(request, deadline))
        return generation

    async def generate(self, request: GenerationRequest, deadline: float = math.inf,
                       most: int = 1) -> AsyncIterator[list[Piece]]:
        """The request's tokens as they come, up to `most` at a time (those
        ready: never waiting for more); the last is flagged. Closing the
        iterator early stops its sequence."""
        ready: asyncio.Queue = asyncio.Queue()
        generation = self.start(request, deadline, ready.put_nowait)
        try:
            finished = False
            while not finished:
                events = [await ready.get()]
                while len(events) < most and not ready.empty():
                    events.append(ready.get_nowait())
                pieces = []
                for event in events:
                    if isinstance(event, TieredError):
                        if pieces:  # what came before it goes out first
                            yield pieces
                        raise event
                    finished = event.last
                    pieces.append(event)
                yield pieces
        finally:
            generation.close()

    async def _encoded(self, request: GenerationRequest) -> list[np.ndarray]:
        """The request's images' kept visual tokens, one array an image; the
        vision stage's run counts as an execution and as busy time (what its
        energy follows)."""
        assert self.vision is not None and request.images is not None
        started = time.perf_counter()
        per_image = await self.vision.encode(request.images)
        self._stepped(time.perf_counter() - started, request.images.count)
        return per_image

    async def visual_tokens(self, request: GenerationRequest) -> np.ndarray:
        """Only the vision stage: the request's images as visual tokens, FP32
        [images, tokens, hidden] (what the router's split asks one tier for,
        to have another decode; where pruning or a cap keeps fewer tokens of
        one image than of another, its row ends in NaN rows). Counted as a
        request of the version."""
        if self.vision is None or request.images is None:
            raise InvalidArgument(f"outputs: {VISUAL_TOKENS} is the vision stage's; it needs "
                                  f"an {IMAGE} input and a vision-language model")
        started = time.perf_counter_ns()
        with self.admissions.request():
            try:
                per_image = await self._encoded(request)
            except TieredError as error:
                self._failed(time.perf_counter_ns() - started, error)
                raise
        elapsed_ns = time.perf_counter_ns() - started
        self.stats.request_succeeded(elapsed_ns, 0, BatchTiming(0, elapsed_ns, 0), _now_ms())
        if self.recorder is not None:
            self.recorder.request_succeeded(elapsed_ns / 1e9, 0.0, elapsed_ns / 1e9, 1)
        return self.vision.as_output(per_image)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let running ones finish, then release the engine."""
        await self.admissions.close(timeout_s)
        await asyncio.to_thread(self.scheduler.close)
        self.engine.close()
        if self.vision is not None:
            self.vision.close()


class Generation:
    """One request of a version as its pieces come (`GenerativeVersion.start`),
    counted as they pass: each token's gap in the token telemetry, the
    request's end (its last piece, or an error) in the version's statistics;
    then handed to `deliver`. `close` ends it early and frees its sequence
    (its client went away). It holds one of the version's admissions until
    it ends."""

    def __init__(self, version: GenerativeVersion,
                 deliver: Callable[[Piece | TieredError], None]) -> None:
        version.admissions.enter()
        self.version = version
        self.deliver = deliver
        self.started = time.perf_counter_ns()
        self.job: Job | None = None
        self.encoding: asyncio.Task | None = None  # its images to visual tokens, first
        self.ended = False  # its last piece or an error came, or it was closed
        self._previous = 0.0  # when its last token's step ended

    async def encoded_first(self, request: GenerationRequest, deadline: float) -> None:
        version = self.version
        assert version.vision is not None and request.images is not None
        try:  # the vision stage's time counts in the first token's
            request = version.vision.with_visual(request, await version._encoded(request))
            if not self.ended:
                self.submit(request, deadline)
        except Exception as error:  # noqa: BLE001 -- told to its reader
            self.take(domain_error(error, "encoding the images"))

    def submit(self, request: GenerationRequest, deadline: float) -> None:
        self.job = self.version.scheduler.submit(request, deadline, self.take)

    def take(self, event: Piece | TieredError) -> None:
        """A piece or the error that ends it (the scheduler's `deliver`)."""
        if self.ended:
            return
        if isinstance(event, TieredError):
            self.fail(event)
        else:
            assert self.job is not None
            first = self._previous == 0.0
            gap = event.at - (self.job.arrived if first else self._previous)
            self._previous = event.at
            self.version.tokens.token(gap, first)
            if self.version.recorder is not None:
                self.version.recorder.token(gap, first)
            if event.last:
                self._succeeded()
        self.deliver(event)

    def fail(self, error: TieredError) -> None:
        if not self.ended:
            self._end()
            self.version._failed(time.perf_counter_ns() - self.started, error)

    def close(self, done: bool = False) -> None:
        """Stop it where it is, if it has not ended: its client went away, or
        (`done`) its text reached a stop string where the text is made (a
        front end), which ends it as a success."""
        if self.ended:
            return
        if done and self.job is not None and self.job.admitted is not None:
            self._succeeded()
        else:
            self._end()
        if self.encoding is not None:
            self.encoding.cancel()
        if self.job is not None:
            self.version.scheduler.cancel(self.job)

    def _end(self) -> None:
        self.ended = True
        self.version.admissions.leave()

    def _succeeded(self) -> None:
        self._end()
        version, job = self.version, self.job
        assert job is not None and job.admitted is not None
        elapsed_ns = time.perf_counter_ns() - self.started
        queue_s = job.admitted - job.arrived
        compute_ns = int((self._previous - job.admitted) * 1e9)
        version.stats.request_succeeded(elapsed_ns, int(queue_s * 1e9),
                                        BatchTiming(0, compute_ns, 0), _now_ms())
        if version.recorder is not None:
            # Busy time comes from the steps (batch_ran), not from here.
            version.recorder.request_succeeded(elapsed_ns / 1e9, queue_s, compute_ns / 1e9, 1)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000

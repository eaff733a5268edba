"""A vision-language model version's vision stage, served beside its decoder.

A vision-language version is a generative one whose config says
`generation.vision`: its decoder (any generative backend, with `visual.json`
beside it: `engines/generative/visual.py`) reads prompts whose image tokens
carry visual tokens, and its vision stage (an ONNX model in the version's
`vision/` directory, with `preprocessor_config.json`) makes them from images.
A request carries, besides `text_input`:

- `image`: UINT8 pixels, one image `[H, W]` or `[H, W, C]` or a batch
  `[n, H, W(, C)]`, or BYTES, one encoded image (PNG, JPEG) an element; the
  agent preprocesses (`engines/images.py`) and runs the vision stage; or
- `visual_tokens`: FP32 `[images, tokens, hidden]` (or `[images x tokens,
  hidden]`), the vision stage's output made elsewhere (the router's split:
  the edge encodes, another tier decodes).

The prompt marks where each image goes with `<image>`, once per image; a
prompt without the mark gets the images in front of its text. Each mark
becomes as many image tokens as the image has visual tokens before the
prompt is tokenized: `tokens_per_image`, or fewer where the stage's
`prune` or `max_visual_tokens` keeps fewer (`engines/visual_tokens.py`), so
the marks are expanded once the stage has run. The vision stage runs on a
worker thread, one call a request; it counts the tokens it keeps and drops.

`visual_tokens` given as `[images, n, hidden]` may hold fewer than
`tokens_per_image` tokens an image (n of them, 1..tokens_per_image): a
pruned or capped stage's output. An image that kept fewer than the others
ends in rows of NaN, which are not tokens (what this stage answers a split's
request for `visual_tokens` with).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tiered.agent.config import VisionStageConfig
from tiered.agent.generation import GenerationRequest
from tiered.engines import Engine, open_engine
from tiered.engines.generative.visual import IMAGE_TOKEN, VisualFacts
from tiered.engines.images import PREPROCESSOR_FILE, Preprocessor, pixel_values
from tiered.engines.visual_tokens import TokenSelection, padded, select, unpadded
from tiered.errors import ConfigError, InvalidArgument
from tiered.protocol.messages import IMAGE, VISUAL_TOKENS

STAGE_MODEL = "model.onnx"  # in the vision stage's directory
PIXELS, TOKENS = "pixel_values", "visual_tokens"  # the vision stage's input and output


@dataclasses.dataclass(frozen=True)
class Images:
    """A request's images, not yet through the vision stage."""

    images: Any  # a numeric array or a list of encoded images: `pixel_values` reads it
    count: int


class VisionStage:
    """The vision stage of one version: images to the decoder's visual tokens."""

    def __init__(self, engine: Engine, preprocessor: Preprocessor, facts: VisualFacts,
                 max_images: int, selection: TokenSelection | None = None) -> None:
        self.engine = engine
        self.preprocessor = preprocessor
        self.facts = facts
        self.max_images = max_images
        self.selection = selection or TokenSelection()
        # Visual tokens of the images encoded here, kept and dropped (counted
        # on the event loop, which the metrics read on).
        self.kept = self.dropped = 0

    @classmethod
    def open(cls, version_dir: Path, config: VisionStageConfig, where: str) -> VisionStage:
        """The stage a version's config names (blocking: it loads the engine)."""
        facts = VisualFacts.read(version_dir)
        if facts is None:
            raise ConfigError(f"{where}: the decoder has no visual.json beside it, so it "
                              "takes no visual tokens")
        directory = version_dir / config.path
        for name in (STAGE_MODEL, PREPROCESSOR_FILE):
            if not (directory / name).is_file():
                raise ConfigError(f"{where}.path: {directory / name} is missing")
        preprocessor = Preprocessor.from_json(directory / PREPROCESSOR_FILE)
        engine = open_engine(config.backend, directory / STAGE_MODEL, config.engine,
                             f"{where}.engine")
        return cls(engine, preprocessor, facts, config.max_images, config.selection)

    def take(self, request: GenerationRequest, inputs: Mapping[str, np.ndarray]
             ) -> GenerationRequest:
        """The request with the visual tokens it came with (its prompt's image
        marks expanded), or with the images still to encode (`images`; its
        marks expanded by `with_visual`)."""
        if IMAGE in inputs and VISUAL_TOKENS in inputs:
            raise InvalidArgument(f"{IMAGE}, {VISUAL_TOKENS}: give one")
        if IMAGE in inputs:
            images = _images(inputs[IMAGE])
            count = len(images) if isinstance(images, list) else _count(images)
            self._check_count(count, IMAGE)
            return dataclasses.replace(request, prompt=self._marked(request.prompt, count),
                                       images=Images(images, count))
        if VISUAL_TOKENS in inputs:
            visual, counts = self._visual_tokens(inputs[VISUAL_TOKENS])
            return dataclasses.replace(request, visual=visual, prompt=_expanded(
                self._marked(request.prompt, len(counts)), counts))
        return dataclasses.replace(request, prompt=self._marked(request.prompt, 0))

    async def encode(self, images: Images) -> list[np.ndarray]:
        """Each image's kept visual tokens, FP32 [kept, hidden] (the stage run
        on a worker thread), counted."""
        per_image = await asyncio.to_thread(self._run, images.images)
        kept = sum(len(rows) for rows in per_image)
        self.kept += kept
        self.dropped += len(per_image) * self.facts.tokens_per_image - kept
        return per_image

    def with_visual(self, request: GenerationRequest, per_image: list[np.ndarray]
                    ) -> GenerationRequest:
        """The request with its images' visual tokens, each mark expanded to
        its image's count."""
        visual = np.ascontiguousarray(np.concatenate(per_image), dtype=np.float32)
        return dataclasses.replace(request, visual=visual, images=None, prompt=_expanded(
            request.prompt, [len(rows) for rows in per_image]))

    def as_output(self, per_image: list[np.ndarray]) -> np.ndarray:
        """The kept tokens as the `visual_tokens` output, FP32 [images, most
        kept, hidden] (an image that kept fewer ends in NaN rows)."""
        return padded(per_image, self.facts.hidden_size)

    def _run(self, images: Any) -> list[np.ndarray]:
        pixels = pixel_values(images, self.preprocessor)
        tokens = self.engine.run({PIXELS: pixels}, [TOKENS])[TOKENS]
        tokens = np.asarray(tokens, dtype=np.float32).reshape(
            len(pixels), -1, tokens.shape[-1])
        return select(tokens, self.selection) if self.selection.active else list(tokens)

    def _marked(self, prompt: str, images: int) -> str:
        """The prompt with one image mark an image (put in front where it has none)."""
        marks = prompt.count(IMAGE_TOKEN)
        if marks and marks != images:
            raise InvalidArgument(f"text_input: the prompt marks {marks} images with "
                                  f"{IMAGE_TOKEN} and {images} came with it")
        return prompt if marks else IMAGE_TOKEN * images + prompt

    def _visual_tokens(self, array: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The given tokens' rows [tokens, hidden] and each image's count."""
        facts = self.facts
        if array.dtype != np.float32 or array.ndim not in (2, 3) \
                or array.shape[-1] != facts.hidden_size \
                or (array.ndim == 3 and not 1 <= array.shape[1] <= facts.tokens_per_image) \
                or array.shape[0] == 0:
            raise InvalidArgument(
                f"input {VISUAL_TOKENS!r}: expected FP32 [images, 1..{facts.tokens_per_image}, "
                f"{facts.hidden_size}] (or [images x {facts.tokens_per_image}, "
                f"{facts.hidden_size}]), got {array.dtype} {list(array.shape)}")
        if array.ndim == 3:
            self._check_count(array.shape[0], VISUAL_TOKENS)
            try:
                rows, counts = unpadded(array)
            except ValueError as error:
                raise InvalidArgument(f"input {VISUAL_TOKENS!r}: {error}") from None
        else:
            rows = array
            if len(rows) % facts.tokens_per_image:
                raise InvalidArgument(f"input {VISUAL_TOKENS!r}: {len(rows)} rows is not a "
                                      f"whole number of images of {facts.tokens_per_image} "
                                      "tokens")
            self._check_count(len(rows) // facts.tokens_per_image, VISUAL_TOKENS)
            counts = [facts.tokens_per_image] * (len(rows) // facts.tokens_per_image)
        if not np.isfinite(rows).all():
            raise InvalidArgument(f"input {VISUAL_TOKENS!r}: holds values that are not finite")
        return np.ascontiguousarray(rows), counts

    def _check_count(self, count: int, name: str) -> None:
        if not 1 <= count <= self.max_images:
            raise InvalidArgument(f"input {name!r}: {count} images; this model takes 1 to "
                                  f"{self.max_images} a request")

    def close(self) -> None:
        self.engine.close()


def _expanded(prompt: str, counts: list[int]) -> str:
    """The prompt with its k-th image mark repeated counts[k] times (one mark
    an image, as `_marked` leaves it)."""
    pieces = prompt.split(IMAGE_TOKEN)
    return pieces[0] + "".join(IMAGE_TOKEN * count + piece
                               for count, piece in zip(counts, pieces[1:], strict=True))


def _images(array: np.ndarray) -> Any:
    """What `pixel_values` reads from an `image` input: a BYTES tensor's
    elements are encoded images; numbers are pixels."""
    if array.dtype == object:
        return [bytes(item) if isinstance(item, bytes | bytearray) else
                _not_bytes(item) for item in array.reshape(-1)]
    if array.dtype != np.uint8:
        raise InvalidArgument(f"input {IMAGE!r}: expected UINT8 pixels or BYTES encoded "
                              f"images, got {array.dtype}")
    return array


def _not_bytes(item: Any) -> bytes:
    raise InvalidArgument(f"input {IMAGE!r}: a BYTES element holds {type(item).__name__}, "
                          "not an encoded image")


def _count(pixels: np.ndarray) -> int:
    """Images in a UINT8 array: rank 2 one, rank 3 one when its last axis is a
    channel count (1, 3, 4) else a batch, rank 4 a batch (as `pixel_values`)."""
    if pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[-1] in (1, 3, 4)):
        return 1
    if pixels.ndim in (3, 4):
        return pixels.shape[0]
    raise InvalidArgument(f"input {IMAGE!r}: expected [H, W], [H, W, C] or a batch of "
                          f"those, got shape {list(pixels.shape)}")

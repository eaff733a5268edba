"""Images to a vision model's pixel values: decode, resize, rescale, normalize.

    pixel_values(images, Preprocessor.from_json(checkpoint / "preprocessor_config.json"))
        -> FP32 [n, 3, H, W]

What is taken as an image:
- a numeric array: `[H, W]` (grey), `[H, W, C]` with C of 1 (grey), 3 (RGB) or
  4 (RGBA, alpha dropped), or a batch of those, `[n, H, W]` or `[n, H, W, C]`.
  A rank-3 array is one image when its last axis is 1, 3 or 4, else a batch of
  grey images. uint8 arrays hold 0..255 (other integer types are refused:
  their scale is anyone's guess); float arrays are taken on the same
  scale (the pixel scale before `rescale_factor`, 0..255 for CLIP's 1/255),
  never as already rescaled or normalized;
- encoded bytes (PNG, JPEG, anything Pillow decodes), converted to RGB;
- a list or tuple of those, each one image or a batch of them, of any sizes:
  each image is resized on its own.

The resize is bilinear with half-pixel centres and no antialiasing (what
torch's `interpolate(mode="bilinear", align_corners=False)` computes), to the
processor's `size` {height, width}; with `size` {shortest_edge: S}, the
shorter side goes to S (aspect kept) and the centre is cropped to `crop_size`
(S x S without one). CLIP's own processor resizes bicubic with Pillow, so a
checkpoint's visual tokens from these pixels differ slightly from its
reference processor's: the build calibrates and judges on these pixels, the
ones served.

Pure numpy apart from decoding bytes (Pillow, imported then). Input that is
wrong or too large raises InvalidArgument naming the problem; a bad
preprocessor_config.json raises ConfigError naming the field. It must never
hand a model pixels it did not check: NaN/inf, zero-sized or oversized images
stop here.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiered.errors import ConfigError, InvalidArgument

PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_SIDE = 4096  # pixels of an input image's height or width, before resizing
MAX_ENCODED_BYTES = 64 * 1024 * 1024  # one encoded image (the agent's message limit)
MAX_IMAGES = 1024  # images in one call
MAX_TARGET_SIDE = 2048  # a preprocessor's own size


@dataclass(frozen=True)
class Preprocessor:
    """The image processor's fields a vision stage needs (preprocessor_config.json)."""

    height: int
    width: int
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # {shortest_edge} sizes: the side the shorter edge is resized to, then a
    # centre crop to height x width. None: resize straight to height x width.
    shortest_edge: int | None = None

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_TARGET_SIDE:
                raise ConfigError(f"size.{name}: must be within 1..{MAX_TARGET_SIDE}, got {value}")
        if self.shortest_edge is not None and not 1 <= self.shortest_edge <= MAX_TARGET_SIDE:
            raise ConfigError(f"size.shortest_edge: must be within 1..{MAX_TARGET_SIDE}, "
                              f"got {self.shortest_edge}")
        if not (math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise ConfigError(f"rescale_factor: must be a finite number > 0, "
                              f"got {self.rescale_factor}")
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            if len(values) != 3 or not all(math.isfinite(v) for v in values):
                raise ConfigError(f"{name}: give three finite numbers (R, G, B), got "
                                  f"{list(values)}")
        if any(v <= 0 for v in self.image_std):
            raise ConfigError(f"image_std: each must be > 0, got {list(self.image_std)}")

    @classmethod
    def from_json(cls, path: Path) -> Preprocessor:
        try:
            mapping = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: cannot read a preprocessor config: {error}") from error
        return cls.from_mapping(mapping, str(path))

    @classmethod
    def from_mapping(cls, mapping: Any, where: str) -> Preprocessor:
        """Hugging Face image processor fields; others (the processor's class,
        `do_resize`, `resample`, ...) are not read."""
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{where}: a preprocessor config is a JSON object")
        try:
            size = _size(mapping.get("size"), mapping.get("crop_size"))
            fields = {name: _field(mapping, name, kind) for name, kind in (
                ("do_rescale", bool), ("rescale_factor", float), ("do_normalize", bool),
                ("image_mean", tuple), ("image_std", tuple)) if name in mapping}
            return cls(**size, **fields)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None

    @property
    def shape(self) -> tuple[int, int, int]:
        """A pixel_values row's shape: (3, height, width)."""
        return (3, self.height, self.width)


def _field(mapping: Mapping[str, Any], name: str, kind: type) -> Any:
    value = mapping[name]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: must be true or false, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{name}: must be a list of three numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _side(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {value!r}")
    return value


def _size(size: Any, crop_size: Any) -> dict[str, int | None]:
    if isinstance(size, Mapping) and "height" in size and "width" in size:
        return {"height": _side(size["height"], "size.height"),
                "width": _side(size["width"], "size.width"), "shortest_edge": None}
    if isinstance(size, Mapping) and "shortest_edge" in size:
        edge = _side(size["shortest_edge"], "size.shortest_edge")
        if crop_size is None:
            return {"height": edge, "width": edge, "shortest_edge": edge}
        if not (isinstance(crop_size, Mapping) and "height" in crop_size
                and "width" in crop_size):
            raise ConfigError(f"crop_size: give {{height, width}}, got {crop_size!r}")
        return {"height": _side(crop_size["height"], "crop_size.height"),
                "width": _side(crop_size["width"], "crop_size.width"), "shortest_edge": edge}
    raise ConfigError(f"size: give {{height, width}} or {{shortest_edge}}, got {size!r}")


def pixel_values(images: Any, preprocessor: Preprocessor) -> np.ndarray:
    """FP32 [n, 3, height, width]: every image resized, rescaled and normalized
    (the module docstring says which inputs are images)."""
    rows = [_prepare(image, preprocessor) for image in _each_image(images)]
    if not rows:
        raise InvalidArgument("images: no images given")
    return np.stack(rows).astype(np.float32, copy=False)


def _each_image(images: Any) -> list[np.ndarray]:
    """Every image as an [H, W, C] array (C 1, 3 or 4), in order."""
    parts = list(images) if isinstance(images, (list, tuple)) else [images]
    found: list[np.ndarray] = []
    for index, part in enumerate(parts):
        where = f"images[{index}]" if isinstance(images, (list, tuple)) else "images"
        if isinstance(part, (bytes, bytearray, memoryview)):
            found.append(decode_image(bytes(part), where))
        else:
            found.extend(_split_array(part, where))
        if len(found) > MAX_IMAGES:
            raise InvalidArgument(f"images: more than {MAX_IMAGES} images in one call")
    return found


def _split_array(value: Any, where: str) -> list[np.ndarray]:
    if not isinstance(value, np.ndarray):
        raise InvalidArgument(f"{where}: an image is a numeric array or encoded bytes, "
                              f"got {type(value).__name__}")
    if value.dtype != np.uint8 and value.dtype.kind != "f":
        # Other integers (uint16, int32) have no agreed scale: refused, not guessed.
        raise InvalidArgument(f"{where}: pixel arrays are uint8 (0..255) or floating "
                              f"point, got {value.dtype}")
    if value.ndim == 2:
        return [value[:, :, None]]
    if value.ndim == 3:
        return [value] if value.shape[2] in (1, 3, 4) else [image[:, :, None] for image in value]
    if value.ndim == 4:
        if value.shape[3] not in (1, 3, 4):
            raise InvalidArgument(f"{where}: a batch [n, H, W, C] needs C of 1, 3 or 4, got "
                                  f"shape {list(value.shape)}")
        return list(value)
    raise InvalidArgument(f"{where}: an image array is [H, W], [H, W, C] or a batch "
                          f"[n, H, W(, C)], got shape {list(value.shape)}")


def decode_image(data: bytes, where: str = "image") -> np.ndarray:
    """Encoded bytes as uint8 RGB [H, W, 3]; refused past MAX_ENCODED_BYTES or
    MAX_SIDE (read from the header, before the pixels are decoded)."""
    if not data:
        raise InvalidArgument(f"{where}: empty image bytes")
    if len(data) > MAX_ENCODED_BYTES:
        raise InvalidArgument(f"{where}: {len(data)} bytes of encoded image, at most "
                              f"{MAX_ENCODED_BYTES}")
    try:
        from PIL import Image, UnidentifiedImageError
    except ModuleNotFoundError as error:
        raise InvalidArgument(f"{where}: decoding image bytes needs Pillow "
                              "(pip install 'tiered[generative]'); send a pixel array "
                              "instead") from error
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            _check_sides(height, width, where)
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise InvalidArgument(f"{where}: cannot decode the image bytes: {error}") from error


def _check_sides(height: int, width: int, where: str) -> None:
    if height < 1 or width < 1:
        raise InvalidArgument(f"{where}: an image of {height}x{width} pixels has no pixels")
    if height > MAX_SIDE or width > MAX_SIDE:
        raise InvalidArgument(f"{where}: an image of {height}x{width} pixels, at most "
                              f"{MAX_SIDE} a side")


def _prepare(image: np.ndarray, preprocessor: Preprocessor) -> np.ndarray:
    """One [H, W, C] image as a [3, height, width] row."""
    _check_sides(image.shape[0], image.shape[1], "images")
    pixels = image.astype(np.float32)
    if image.dtype.kind == "f" and not np.isfinite(pixels).all():
        raise InvalidArgument("images: pixel values hold NaN or infinity")
    channels = pixels.shape[2]
    if channels == 4:
        pixels = pixels[:, :, :3]  # alpha dropped, not composited
    elif channels == 1:
        pixels = np.repeat(pixels, 3, axis=2)
    pixels = _resize(pixels, preprocessor)
    if preprocessor.do_rescale:
        pixels = pixels * np.float32(preprocessor.rescale_factor)
    if preprocessor.do_normalize:
        mean = np.asarray(preprocessor.image_mean, np.float32)
        std = np.asarray(preprocessor.image_std, np.float32)
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _resize(pixels: np.ndarray, preprocessor: Preprocessor) -> np.ndarray:
    height, width = pixels.shape[:2]
    if preprocessor.shortest_edge is None:
        return resize_bilinear(pixels, preprocessor.height, preprocessor.width)
    scale = preprocessor.shortest_edge / min(height, width)
    resized = resize_bilinear(pixels, max(1, round(height * scale)),
                              max(1, round(width * scale)))
    return center_crop(resized, preprocessor.height, preprocessor.width)


def resize_bilinear(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] to [height, width, C]: bilinear, half-pixel centres, edge
    pixels repeated past the border, no antialiasing."""
    rows = _taps(pixels.shape[0], height)
    cols = _taps(pixels.shape[1], width)
    top = pixels[rows[0]] * rows[2][:, None, None] + pixels[rows[1]] * (1 - rows[2])[:, None, None]
    return top[:, cols[0]] * cols[2][None, :, None] + top[:, cols[1]] * (1 - cols[2])[None, :, None]


def _taps(size: int, target: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output position: the lower and upper source index and the lower one's weight."""
    centres = (np.arange(target, dtype=np.float64) + 0.5) * (size / target) - 0.5
    centres = np.clip(centres, 0, size - 1)
    lower = np.floor(centres).astype(np.intp)
    upper = np.minimum(lower + 1, size - 1)
    return lower, upper, (1 - (centres - lower)).astype(np.float32)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre height x width of [H, W, C], edge-padded where it is smaller."""
    pad_h, pad_w = max(0, height - pixels.shape[0]), max(0, width - pixels.shape[1])
    if pad_h or pad_w:
        pixels = np.pad(pixels, ((pad_h // 2, pad_h - pad_h // 2),
                                 (pad_w // 2, pad_w - pad_w // 2), (0, 0)), mode="edge")
    top = (pixels.shape[0] - height) // 2
    left = (pixels.shape[1] - width) // 2
    return pixels[top:top + height, left:left + width]


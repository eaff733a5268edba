"""Images to pixel values (tiered.engines.images): every input form, the
resize against torch's, the preprocessor config's checks, and each refusal."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from tiered.engines import images
from tiered.engines.images import Preprocessor, pixel_values
from tiered.errors import ConfigError, InvalidArgument

CLIP = Preprocessor(height=8, width=8, image_mean=(0.48145466, 0.4578275, 0.40821073),
                    image_std=(0.26862954, 0.26130258, 0.27577711))
PLAIN = Preprocessor(height=4, width=6, do_rescale=False, do_normalize=False)


def rgb(height: int = 10, width: int = 14, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_rgb_image_is_resized_rescaled_and_normalized_like_torch():
    torch = pytest.importorskip("torch")
    image = rgb()
    got = pixel_values(image, CLIP)
    assert got.shape == (1, 3, 8, 8) and got.dtype == np.float32
    resized = torch.nn.functional.interpolate(
        torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None], size=(8, 8),
        mode="bilinear", align_corners=False, antialias=False)[0].numpy()
    mean = np.array(CLIP.image_mean, np.float32)[:, None, None]
    std = np.array(CLIP.image_std, np.float32)[:, None, None]
    np.testing.assert_allclose(got[0], (resized / 255 - mean) / std, atol=1e-5)


def test_upscaling_matches_torch_too():
    torch = pytest.importorskip("torch")
    image = rgb(3, 2)
    got = pixel_values(image, PLAIN)[0]
    want = torch.nn.functional.interpolate(
        torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None], size=(4, 6),
        mode="bilinear", align_corners=False)[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_same_size_without_rescale_is_the_image_itself():
    image = rgb(4, 6)
    np.testing.assert_array_equal(pixel_values(image, PLAIN)[0],
                                  image.transpose(2, 0, 1).astype(np.float32))


@pytest.mark.parametrize("form", ["grey", "grey-channel", "rgba", "float"])
def test_every_single_image_form_becomes_three_channels(form):
    image = rgb(4, 6)
    grey = image[:, :, 0]
    given, want = {
        "grey": (grey, np.stack([grey] * 3)),
        "grey-channel": (grey[:, :, None], np.stack([grey] * 3)),
        "rgba": (np.concatenate([image, np.full((4, 6, 1), 7, np.uint8)], axis=2),
                 image.transpose(2, 0, 1)),
        "float": (image.astype(np.float64), image.transpose(2, 0, 1)),
    }[form]
    np.testing.assert_array_equal(pixel_values(given, PLAIN)[0], want.astype(np.float32))


def test_batches_and_lists_keep_their_order_and_may_mix_sizes():
    batch = np.stack([rgb(4, 6, seed) for seed in range(3)])
    greys = batch[:, :, :, 0]
    got = pixel_values(batch, PLAIN)
    assert got.shape == (3, 3, 4, 6)
    np.testing.assert_array_equal(got[2], batch[2].transpose(2, 0, 1))
    assert pixel_values(greys, PLAIN).shape == (3, 3, 4, 6)
    mixed = pixel_values([rgb(20, 30), batch, png(rgb(9, 9, 5))], PLAIN)
    assert mixed.shape == (5, 3, 4, 6)
    np.testing.assert_array_equal(mixed[1:4], got)


def test_png_bytes_decode_to_the_same_pixels_as_the_array():
    image = rgb(11, 13, seed=3)
    np.testing.assert_array_equal(pixel_values(png(image), CLIP), pixel_values(image, CLIP))
    np.testing.assert_array_equal(images.decode_image(png(image)), image)


def test_jpeg_bytes_decode_close_to_the_array():
    from PIL import Image

    image = np.full((16, 16, 3), (200, 30, 90), np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    decoded = images.decode_image(buffer.getvalue())
    assert decoded.shape == (16, 16, 3)
    assert np.abs(decoded.astype(int) - image).max() <= 4


def test_shortest_edge_resizes_then_crops_the_centre():
    preprocessor = Preprocessor.from_mapping(
        {"size": {"shortest_edge": 4}, "crop_size": {"height": 4, "width": 4},
         "do_rescale": False, "do_normalize": False}, "test")
    image = np.zeros((8, 16, 3), np.uint8)
    image[:, 6:10] = 255  # the middle quarter of the width
    got = pixel_values(image, preprocessor)[0, 0]
    assert got.shape == (4, 4)
    # 8x16 becomes 4x8; the crop keeps columns 2..5, whose middle two hold the stripe.
    np.testing.assert_array_equal(got[:, 1:3], 255)
    np.testing.assert_array_equal(got[:, [0, 3]], 0)


def test_preprocessor_reads_a_clip_config(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"height": 8, "width": 8},
        "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True,
        "image_mean": list(CLIP.image_mean), "image_std": list(CLIP.image_std), "resample": 3}))
    assert Preprocessor.from_json(path) == CLIP
    assert Preprocessor.from_json(path).shape == (3, 8, 8)


@pytest.mark.parametrize(("mapping", "field"), [
    ({}, "size"),
    ({"size": {"height": 0, "width": 8}}, "size.height"),
    ({"size": {"height": 8, "width": "8"}}, "size.width"),
    ({"size": {"shortest_edge": 8}, "crop_size": [8, 8]}, "crop_size"),
    ({"size": {"height": 8, "width": 8}, "image_mean": [0.5, 0.5]}, "image_mean"),
    ({"size": {"height": 8, "width": 8}, "image_std": [0.5, 0.0, 0.5]}, "image_std"),
    ({"size": {"height": 8, "width": 8}, "rescale_factor": -1}, "rescale_factor"),
    ({"size": {"height": 8, "width": 8}, "do_normalize": "yes"}, "do_normalize"),
])
def test_preprocessor_config_errors_name_the_field(mapping, field):
    with pytest.raises(ConfigError, match=rf"{field}:"):
        Preprocessor.from_mapping(mapping, "preprocessor_config.json")


def test_unreadable_preprocessor_config_is_a_config_error(tmp_path):
    path = tmp_path / "preprocessor_config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="preprocessor config"):
        Preprocessor.from_json(path)


@pytest.mark.parametrize(("given", "problem"), [
    (np.zeros((2, 3, 4, 5, 3), np.uint8), "shape"),
    (np.zeros((2, 4, 4, 2), np.uint8), "C of 1, 3 or 4"),
    (np.zeros((0, 5, 3), np.uint8), "no pixels"),
    (np.zeros((4097, 2), np.uint8), "at most 4096"),
    (np.array([[np.nan, 1.0], [2.0, 3.0]]), "NaN"),
    (np.zeros((2, 2), bool), "uint8 .* or floating point"),
    (np.zeros((2, 2), np.uint16), "uint8 .* or floating point"),
    (np.zeros((2, 2), np.complex64), "uint8 .* or floating point"),
    ("a picture", "numeric array or encoded bytes"),
    (b"not an image", "cannot decode"),
    (b"", "empty"),
    ([], "no images"),
])
def test_bad_images_are_invalid_arguments_naming_the_problem(given, problem):
    with pytest.raises(InvalidArgument, match=problem):
        pixel_values(given, PLAIN)


def test_oversized_encodings_are_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(images, "MAX_ENCODED_BYTES", 100)
    with pytest.raises(InvalidArgument, match="at most 100"):
        pixel_values(b"\x89PNG" + b"\0" * 200, PLAIN)
    monkeypatch.setattr(images, "MAX_ENCODED_BYTES", 1 << 20)
    monkeypatch.setattr(images, "MAX_SIDE", 8)
    with pytest.raises(InvalidArgument, match="9x20 pixels, at most 8"):
        images.decode_image(png(rgb(9, 20)))


def test_too_many_images_in_one_call_are_refused(monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGES", 2)
    with pytest.raises(InvalidArgument, match="more than 2 images"):
        pixel_values(np.zeros((3, 4, 5), np.uint8), PLAIN)

"""A vision-language version served by a real agent process: its vision
stage (the checkpoint's vision tower and projector, exported to ONNX) beside
its decoder (the checkpoint's Llama, run by the torch engine). Asked with the
real tritonclient, with an image or with the vision stage's tokens made
elsewhere, it answers as transformers' LlavaForConditionalGeneration does on
the same pixels; bad requests get clear errors and the agent keeps serving."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tritonclient.grpc")

import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.vlm_fixtures import QUESTIONS, write_tiny_llava  # noqa: E402
from tiered.agent.repository import write_config  # noqa: E402
from tiered.demo.rollouts import ask_streamed  # noqa: E402
from tiered.engines.build.vision_language import export_vision_stage  # noqa: E402
from tiered.engines.generative.visual import decoder_checkpoint  # noqa: E402
from tiered.engines.images import PREPROCESSOR_FILE, Preprocessor, pixel_values  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402

MODEL, MAX_TOKENS = "vlm", 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("llava") / "llava")


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(3).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)


def fp32_repository(checkpoint: Path, root: Path, vision: dict, model: str = MODEL) -> Path:
    """A repository with one version of `checkpoint` as `model`, FP32 on the
    CPU: the decoder at its root (with visual.json), the vision stage in
    vision/, `generation.vision` set to `vision`."""
    version = root / model / "1"
    decoder_checkpoint(checkpoint, version)
    export_vision_stage(checkpoint, version / "vision" / "model.onnx")
    shutil.copy(checkpoint / PREPROCESSOR_FILE, version / "vision" / PREPROCESSOR_FILE)
    write_config(root, model, {
        "backend": "torch-generative",
        "engine": {"device": "cpu", "precision": "fp32", "max_sequences": 4},
        "generation": {"engine_core": "thread", "vision": vision}})
    return root


@pytest.fixture(scope="module")
def agent(checkpoint, tmp_path_factory):
    root = fp32_repository(checkpoint, tmp_path_factory.mktemp("repository"), {"max_images": 2})
    with AgentProcess("edge", root) as process:
        yield process


def reference(checkpoint, image: np.ndarray, question: str) -> list[int]:
    """transformers' greedy tokens for one image and a question, on the pixels
    the agent makes of it."""
    import torch
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokens = model.config.vision_config.image_size // model.config.vision_config.patch_size
    ids = tokenizer("<image>" * tokens**2 + question, add_special_tokens=False,
                    return_tensors="pt").input_ids
    pixels = pixel_values(image, Preprocessor.from_json(checkpoint / PREPROCESSOR_FILE))
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=torch.from_numpy(pixels),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def ask(agent, question: str, **tensors: np.ndarray) -> list[int]:
    """One streamed request; the token ids it was answered with."""
    responses = ask_streamed(agent.address, MODEL, question,
                             max_tokens=np.array([MAX_TOKENS], np.int32), **tensors)
    return [t for r in responses for t in r.as_numpy("token_ids").tolist()]


def test_an_image_is_answered_as_transformers_answers_it(agent, checkpoint, images):
    for image, question in zip(images, QUESTIONS, strict=False):
        assert ask(agent, question, image=image) == reference(checkpoint, image, question)


def test_the_vision_stage_tokens_made_elsewhere_answer_the_same(agent, checkpoint, images,
                                                                 tmp_path):
    """What the router's split sends: the edge's vision stage output."""
    import onnxruntime as ort

    export_vision_stage(checkpoint, tmp_path / "vision.onnx")
    pixels = pixel_values(images[0], Preprocessor.from_json(checkpoint / PREPROCESSOR_FILE))
    tokens = ort.InferenceSession(str(tmp_path / "vision.onnx")).run(
        ["visual_tokens"], {"pixel_values": pixels})[0]
    question = QUESTIONS[0]
    assert ask(agent, question, visual_tokens=tokens.astype(np.float32)) == \
        ask(agent, question, image=images[0])
    # Asked for the stage's output alone (a unary call), the agent runs only it.
    with grpcclient.InferenceServerClient(agent.address) as client:
        inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
                  grpcclient.InferInput("image", [2, 8, 8, 3], "UINT8")]
        inputs[0].set_data_from_numpy(np.array([b""], dtype=object))
        inputs[1].set_data_from_numpy(images[:2])
        answer = client.infer(MODEL, inputs,
                              outputs=[grpcclient.InferRequestedOutput("visual_tokens")])
    served = answer.as_numpy("visual_tokens")
    assert served.shape == (2, *tokens.shape[1:])
    np.testing.assert_allclose(served[0], tokens[0], atol=1e-5)
    # A pruned stage's tokens: fewer an image, or as many ending in NaN rows
    # (absent tokens), answer alike.
    padded = tokens.copy()
    padded[:, 5:] = np.nan
    assert ask(agent, question, visual_tokens=np.ascontiguousarray(tokens[:, :5])) == \
        ask(agent, question, visual_tokens=padded)


def test_bad_requests_get_clear_errors_and_the_agent_keeps_serving(agent, images):
    bad = {
        "give one": dict(image=images[0], visual_tokens=np.zeros((1, 16, 128), np.float32)),
        "marks 2 images": {"image": images[0], "question": "<image> a <image> b"},
        "3 images; this model takes 1 to 2": dict(image=images),
        "expected UINT8 pixels or BYTES": dict(image=images[0].astype(np.float32)),
        r"expected FP32 \[images, 1\.\.16, 128\]": dict(visual_tokens=np.zeros((1, 16, 64),
                                                                             np.float32)),
        "must end an image's tokens": dict(visual_tokens=np.where(
            np.arange(16)[None, :, None] == 3, np.nan, 1.0).astype(np.float32) * np.ones(
                (1, 16, 128), np.float32)),
        "cannot decode the image bytes": dict(image=np.array([b"not a png"],
                                                                         dtype=object)),
    }
    for expected, tensors in bad.items():
        question = tensors.pop("question", QUESTIONS[0])
        with pytest.raises(InferenceServerException, match=expected):
            ask(agent, question, **tensors)
    assert ask(agent, "what is it ?", image=images[1])  # still serving

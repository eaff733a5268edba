"""A cap on visual tokens served by a real agent process: tinyvlm v1 (4
visual tokens an image) with `generation.vision.max_visual_tokens: 2`, asked
with the real tritonclient, answers each digit question from the two tokens
its vision stage keeps (as transformers answers from the same two), and its
/metrics count the tokens kept and dropped."""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tritonclient.grpc")

from tests.integration.test_vision_language import fp32_repository  # noqa: E402
from tiered.demo.rollouts import answer_text, ask_streamed  # noqa: E402
from tiered.engines.build.vision_language import Checkpoint  # noqa: E402
from tiered.engines.images import PREPROCESSOR_FILE, Preprocessor, pixel_values  # noqa: E402
from tiered.engines.visual_tokens import TokenSelection, select  # noqa: E402
from tiered.local.processes import AgentProcess  # noqa: E402

MODEL, CAP, ASKED = "tinyvlm", 2, 4


@pytest.fixture(scope="module")
def agent(tinyvlm_models, tmp_path_factory):
    root = fp32_repository(tinyvlm_models / "tinyvlm-v1", tmp_path_factory.mktemp("repository"),
                           {"max_visual_tokens": CAP}, MODEL)
    with AgentProcess("edge", root) as process:
        yield process


def visual_tokens_counted(agent) -> dict[str, float]:
    text = urllib.request.urlopen(agent.metrics_url, timeout=10).read().decode()
    return {kept: float(value) for kept, value in re.findall(
        rf'tiered_visual_tokens_total{{model="{MODEL}",version="1",tier="edge",'
        r'kept="(true|false)"} (\S+)', text)}


def test_a_cap_of_two_answers_from_the_two_tokens_kept_and_counts_them(agent, tinyvlm_models):
    with np.load(tinyvlm_models / "tinyvlm-eval.npz") as archive:
        images, question = archive["image"][:ASKED], str(archive["question"][0])
    checkpoint = Checkpoint(tinyvlm_models / "tinyvlm-v1")
    pixels = pixel_values(images, Preprocessor.from_json(
        tinyvlm_models / "tinyvlm-v1" / PREPROCESSOR_FILE))
    kept = select(checkpoint.image_features(pixels), TokenSelection(max_visual_tokens=CAP))
    expected = [checkpoint.tokenizer.decode(ids, skip_special_tokens=True).strip()
                for ids in checkpoint.answers(kept, [question] * ASKED, 8)]
    said = [answer_text(ask_streamed(agent.address, MODEL, question, image=image))
            for image in images]
    assert said == expected and all(said)
    assert visual_tokens_counted(agent) == {"true": CAP * ASKED, "false": (4 - CAP) * ASKED}

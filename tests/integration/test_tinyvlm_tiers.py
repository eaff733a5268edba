"""The small vision-language model on three tiers, end to end: the trained
tinyvlm v1 built whole with the real `tiered build` for the edge (vision
stage INT8, decoder INT4 on onnxruntime-genai), the regional tier (vision
stage FP16, decoder on onnxruntime-genai, FP32 on a CPU) and the datacenter
(vision stage FP16, decoder on the torch engine), each served by a real agent, and
asked about held-out digits with the real tritonclient, directly, through
a real router, and split (asked for with the `tiered-split` hint): the router
has the edge encode each image and the datacenter decode from its visual
tokens."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
pytest.importorskip("tritonclient.grpc")

from tiered import names
from tiered.demo.rollouts import answer_text, ask_streamed  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.models import tinyvlm  # noqa: E402

MODEL, ASKED = "tinyvlm", 24  # held-out images asked on each path


@pytest.fixture(scope="module")
def repositories(tinyvlm_repositories):
    """Each tier's repository, built by the CLI as a tier's build runs it, and
    the verdict its report (the build's stdout) gave."""
    return {tier: (tinyvlm_repositories / tier, json.loads(
        (tinyvlm_repositories / f"{tier}.json").read_text())["verdict"])
        for tier in names.TIERS}


@pytest.fixture(scope="module")
def served(repositories, tmp_path_factory):
    agents = {tier: AgentProcess(tier, root) for tier, (root, _) in repositories.items()}
    for agent in agents.values():
        agent.start()
    folder = tmp_path_factory.mktemp("router")
    routers = {}
    for name, split in (("whole", None), ("split", {"vision": "edge", "decoder": "datacenter"})):
        table = folder / f"{name}.json"
        table.write_text(json.dumps({"version": 1, "models": {MODEL: {"tiers": {
            tier: {"agents": [agent.address]} for tier, agent in agents.items()},
            **({"split": split} if split else {})}}}))
        routers[name] = RouterProcess(table)
        routers[name].start()
    try:
        yield agents, routers
    finally:
        for process in (*routers.values(), *agents.values()):
            process.stop()


def ask(address: str, image: np.ndarray, question: str, headers=None) -> str:
    """One streamed question about one image; the answer's text."""
    return answer_text(ask_streamed(address, MODEL, question, headers, image=image))


def test_each_tier_build_passes_its_gate_within_two_points_of_fp32(repositories):
    for tier, (_, verdict) in repositories.items():
        assert verdict["built"], (tier, verdict)
        report = json.loads((repositories[tier][0] / MODEL / "1" / "build.json").read_text())
        answers = report["answers"]
        assert answers["accuracy_fp32"] >= 0.95, answers
        assert answers["accuracy_built"] >= answers["accuracy_fp32"] - 0.02, (tier, answers)
        assert report["gate"]["verdict"] == "pass"


def test_digits_are_answered_in_words_on_each_tier_through_the_router_and_split(
        served, tinyvlm_models):
    agents, routers = served
    data = np.load(tinyvlm_models / tinyvlm.EVAL_FILE)
    images, labels = data["image"][:ASKED], data["label"][:ASKED]
    expected = [tinyvlm.NUMBER_WORDS[int(label)] for label in labels]
    paths = {tier: (agent.address, None) for tier, agent in agents.items()}
    paths.update({f"router to {tier}": (routers["whole"].address, {
        "tiered-tier": tier, "tiered-tier-strict": "true"}) for tier in agents})
    paths["split: edge encodes, datacenter decodes"] = (routers["split"].address,
                                                        {"tiered-split": "true"})
    for path, (address, headers) in paths.items():
        said = [ask(address, image, "what digit is this?", headers) for image in images]
        right = sum(a == b for a, b in zip(said, expected, strict=True))
        assert right >= 0.9 * ASKED, (path, list(zip(said, expected, strict=True)))
    # Split: every image went to the edge, its visual tokens to the datacenter.
    metrics = urllib.request.urlopen(routers["split"].metrics_url, timeout=10).read().decode()
    sent = {what: float(re.search(rf'tiered_router_split_bytes_total{{model="{MODEL}",'
                                  rf'what="{what}"}} (\S+)', metrics).group(1))
            for what in ("image", "visual_tokens")}
    assert sent["image"] == ASKED * images[0].nbytes
    assert sent["visual_tokens"] == ASKED * 4 * 128 * 4  # 4 tokens of 128 FP32 an image
    assert f'tiered_router_split_vision_seconds_count{{decoder="datacenter",model="{MODEL}",' \
        f'vision="edge"}} {float(ASKED)}' in metrics

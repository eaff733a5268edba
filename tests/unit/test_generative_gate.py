"""The generative build's pure parts: the greedy-generation gate, what a tier
really builds, eval prompts, and the digest of a checkpoint directory."""

from __future__ import annotations

import json
import subprocess

import pytest

from tiered.engines.build import gate, spec
from tiered.errors import ConfigError, EngineError
from tiered.files import sha256_tree

REF = [[5, 6, 7, 2], [8, 9, 2], [3, 3, 3, 3]]


@pytest.mark.parametrize(("name", "candidate", "forced", "first_match", "agreement"), [
    ("identical", REF, REF, 1.0, 1.0),
    ("one prompt diverges late, after the first N", [[5, 6, 7, 4], [8, 9, 2], [3, 3, 3, 3]],
     [[5, 6, 7, 4], [8, 9, 2], [3, 3, 3, 3]], 1.0, 10 / 11),
    ("one prompt diverges early", [[5, 1, 1, 1], [8, 9, 2], [3, 3, 3, 3]],
     [[5, 1, 7, 2], [8, 9, 2], [3, 3, 3, 3]], 2 / 3, 10 / 11),
    ("ends early", [[5, 6, 7, 2], [8, 2], [3, 3, 3, 3]], [[5, 6, 7, 2], [8, 2, 2],
                                                         [3, 3, 3, 3]], 2 / 3, 10 / 11),
])
def test_compare_generations(name, candidate, forced, first_match, agreement):
    result = gate.compare_generations(REF, candidate, forced, first_tokens=3)
    assert result.first_tokens_match == pytest.approx(first_match), name
    assert result.token_agreement == pytest.approx(agreement), name
    assert result.positions == 11


def test_compare_generations_refuses_misaligned_rows():
    with pytest.raises(EngineError, match="forced positions"):
        gate.compare_generations(REF, REF, [[5], [8, 9, 2], [3, 3, 3, 3]], first_tokens=3)


@pytest.mark.parametrize(("first", "agree", "prompts", "nonfinite", "verdict", "why"), [
    (1.0, 1.0, 24, 0, "pass", "within"),
    (0.95, 0.99, 24, 0, "pass", "within"),
    (0.85, 1.0, 24, 0, "fail", "first-8-token match below"),
    (1.0, 0.97, 24, 0, "fail", "token agreement below"),
    (1.0, 1.0, 24, 3, "fail", "NaN/inf"),
    (1.0, 1.0, 4, 0, "inconclusive", "only 4 prompts"),
])
def test_judge_generations(first, agree, prompts, nonfinite, verdict, why):
    agreement = gate.GenerationAgreement(prompts, 8, first, agree, 100, nonfinite, ())
    decision = gate.judge_generations(agreement, min_first_tokens_match=0.9,
                                      min_token_agreement=0.98, min_prompts=8)
    assert decision.verdict == verdict
    assert decision.accepted == (verdict == "pass")
    assert why in decision.reason and "threshold 0.9800" in decision.reason
    allowed = gate.judge_generations(agreement, min_first_tokens_match=0.9,
                                     min_token_agreement=0.98, min_prompts=8,
                                     allow_accuracy_drop=True)
    assert allowed.accepted and allowed.verdict == verdict


def test_what_a_tier_builds_without_cuda(monkeypatch):
    from tiered.engines.build import generative

    monkeypatch.setattr(generative, "_cuda_runs", lambda backend: False)
    regional = spec.GenerativeBuildSettings(precision="fp16", cpu_precision="fp32")
    target = generative.choose_target(regional)
    assert (target.precision, target.device) == ("fp32", "cpu")
    assert "fp16 asked for" in target.note
    with pytest.raises(ConfigError, match="cpu_precision"):
        generative.choose_target(spec.GenerativeBuildSettings(precision="fp16"))
    edge = generative.choose_target(spec.GenerativeBuildSettings())
    assert (edge.precision, edge.device, edge.note) == ("int4", "cpu", None)
    monkeypatch.setattr(generative, "_cuda_runs", lambda backend: True)
    assert generative.choose_target(regional).device == "cuda"


def test_fp8_is_built_where_the_gpu_multiplies_fp8(monkeypatch):
    from tiered.engines.build import generative

    fp8 = spec.GenerativeBuildSettings(backend="torch-generative", precision="fp8",
                                       cpu_precision="fp32")
    monkeypatch.setattr(generative, "_cuda_runs", lambda backend: True)
    monkeypatch.setattr(generative, "_fp8_runs", lambda: True)
    assert generative.choose_target(fp8) == generative.Target("torch-generative", "fp8", "cuda")
    monkeypatch.setattr(generative, "_fp8_runs", lambda: False)
    older = generative.choose_target(fp8)
    assert (older.precision, older.device) == ("fp16", "cuda")
    assert "no FP8 tensor cores" in older.note
    monkeypatch.setattr(generative, "_cuda_runs", lambda backend: False)
    assert generative.choose_target(fp8).precision == "fp32"


@pytest.mark.parametrize(("settings", "field"), [
    ({"backend": "onnxruntime"}, "backend"),
    ({"precision": "int8"}, "precision"),
    ({"backend": "torch-generative", "precision": "int4"}, "precision"),
    ({"cpu_precision": "fp8"}, "cpu_precision"),
    ({"min_token_agreement": 1.5}, "min_token_agreement"),
    ({"first_tokens": 32}, "first_tokens"),
])
def test_generative_settings_name_the_bad_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        spec.GenerativeBuildSettings(**settings)


@pytest.mark.parametrize(("content", "message"), [
    (None, "needs eval prompts"),
    ("[1, 2]", "expected"),
    ('{"prompts": []}', "expected"),
    ('{"prompts": ["a", ""]}', "expected"),
    ("not json", "eval"),
])
def test_eval_prompts_are_checked(tmp_path, content, message):
    from tiered.engines.build.generative import read_prompts

    path = None
    if content is not None:
        path = tmp_path / "prompts.json"
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        read_prompts(path)


def test_sha256_of_a_checkpoint_changes_when_any_file_changes(tmp_path):
    root = tmp_path / "checkpoint"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    (root / "sub" / "extra.txt").write_text("x")
    first = sha256_tree(root)
    assert sha256_tree(root) == first
    # The documented shell line gives the same digest.
    shell = subprocess.run(
        "find -L . -type f -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum "
        "| sha256sum", shell=True, cwd=root, capture_output=True, text=True, check=True)
    assert shell.stdout.split()[0] == first
    seen = {first}
    for change in (lambda: (root / "model.safetensors").write_bytes(b"\0" * 63 + b"\1"),
                   lambda: (root / "sub" / "extra.txt").write_text("y"),
                   lambda: (root / "sub" / "extra.txt").rename(root / "sub" / "other.txt"),
                   lambda: (root / "tokenizer.json").write_text(json.dumps({})),
                   lambda: (root / "sub" / "other.txt").unlink()):
        change()
        digest = sha256_tree(root)
        assert digest not in seen
        seen.add(digest)

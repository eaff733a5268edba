"""Model configs and tier profiles: defaults laid over, strict parsing whose
errors name the field, and the request checks a config implies."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiered import names
from tiered.agent.batching import BatchPolicy
from tiered.agent.config import (
    DynamicBatching,
    ModelConfig,
    TensorConfig,
    VersionPolicy,
    check_model_name,
    complete_with_engine,
    parse_model_config,
)
from tiered.agent.engine_core import runs_in_a_process
from tiered.agent.model import batch_policy, check_inputs, check_outputs
from tiered.engines.base import TensorSpec
from tiered.errors import ConfigError, InvalidArgument
from tiered.profiles import ServerLimits, TierProfile, load_profile
from tiered.settings import load_dataclass, read_yaml

WHERE = "repo/m/config.yaml"


@pytest.fixture(scope="module")
def edge() -> TierProfile:
    return load_profile("edge")


# --- parse_model_config: defaults --------------------------------------------------


def test_an_empty_config_takes_the_profiles_defaults(edge: TierProfile) -> None:
    config = parse_model_config("m", {}, edge, WHERE)

    assert config.name == "m"
    assert config.max_batch_size == 0
    assert config.inputs == config.outputs == ()
    assert config.dynamic_batching is None
    assert config.version_policy == VersionPolicy()
    assert config.instance_count == edge.instance_count
    assert config.max_queue_size == edge.limits.max_queue_size
    assert dict(config.engine) == dict(edge.onnxruntime)


def test_empty_dynamic_batching_takes_every_key_from_the_profile(edge: TierProfile) -> None:
    config = parse_model_config("m", {"max_batch_size": 8, "dynamic_batching": {}}, edge, WHERE)

    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=edge.dynamic_batching["max_queue_delay_us"],
        max_queue_size=edge.dynamic_batching["max_queue_size"],
        wait_when_idle=edge.dynamic_batching["wait_when_idle"],
    )
    assert config.dynamic_batching.max_queue_delay_us == 200  # the built-in edge.yaml
    assert config.dynamic_batching.wait_when_idle  # Triton's rule on two-core gateways


def test_dynamic_batching_keys_given_by_the_model_win(edge: TierProfile) -> None:
    config = parse_model_config("m", {
        "max_batch_size": 8,
        "dynamic_batching": {"max_queue_delay_us": 5, "preferred_batch_sizes": [4, 8]},
    }, edge, WHERE)

    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=5,
        preferred_batch_sizes=(4, 8),
        max_queue_size=edge.dynamic_batching["max_queue_size"],
        wait_when_idle=True,  # the profile's, as the model names none
    )


def test_engine_overrides_are_merged_over_the_profiles_onnxruntime_settings(
    edge: TierProfile,
) -> None:
    config = parse_model_config(
        "m", {"engine": {"intra_op_threads": 2, "enable_profiling": True}}, edge, WHERE
    )

    assert config.engine == {**edge.onnxruntime, "intra_op_threads": 2, "enable_profiling": True}
    assert config.engine["providers"] == ["CPUExecutionProvider"]


def test_model_keys_override_profile_scalars(edge: TierProfile) -> None:
    config = parse_model_config(
        "m", {"instance_count": 3, "max_queue_size": 7, "name": "m"}, edge, WHERE
    )

    assert (config.instance_count, config.max_queue_size) == (3, 7)


def test_parsing_does_not_change_the_callers_mapping_or_the_profile(edge: TierProfile) -> None:
    data = {"max_batch_size": 4, "dynamic_batching": {}, "engine": {"intra_op_threads": 1}}
    before_profile = (dict(edge.onnxruntime), dict(edge.dynamic_batching))

    parse_model_config("m", data, edge, WHERE)

    assert data == {"max_batch_size": 4, "dynamic_batching": {}, "engine": {"intra_op_threads": 1}}
    assert (dict(edge.onnxruntime), dict(edge.dynamic_batching)) == before_profile


def test_tensors_are_parsed_into_tensor_configs(edge: TierProfile) -> None:
    config = parse_model_config("m", {
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "dims": [3, -1]}],
        "outputs": [{"name": "y", "datatype": "BYTES", "dims": []}],
        "version_policy": {"specific": [1, 3]},
    }, edge, WHERE)

    assert config.inputs == (TensorConfig("x", "FP32", (3, -1)),)
    assert config.outputs == (TensorConfig("y", "BYTES", ()),)
    assert config.version_policy == VersionPolicy(specific=(1, 3))
    assert config.batch_shape(config.inputs[0]) == (-1, 3, -1)


# --- parse_model_config: errors ---------------------------------------------------


def _tensor(**overrides: Any) -> dict[str, Any]:
    return {"name": "x", "datatype": "FP32", "dims": [3], **overrides}


CONFIG_ERRORS = {
    "typo at the top": ({"max_batch_sise": 4}, "unknown key 'max_batch_sise'", WHERE),
    "typo in dynamic_batching": (
        {"max_batch_size": 4, "dynamic_batching": {"max_queue_delay": 5}},
        "unknown key 'max_queue_delay'", f"{WHERE}.dynamic_batching",
    ),
    "typo in a tensor": (
        {"inputs": [_tensor(dim=[3])]}, "unknown key 'dim'", f"{WHERE}.inputs[0]",
    ),
    "typo in version_policy": (
        {"version_policy": {"lastest": 2}}, "unknown key 'lastest'", f"{WHERE}.version_policy",
    ),
    "string for an integer": (
        {"max_batch_size": "8"}, "expected an integer", f"{WHERE}.max_batch_size",
    ),
    "bool for an integer": (
        {"instance_count": True}, "expected an integer", f"{WHERE}.instance_count",
    ),
    "float for an integer": (
        {"max_batch_size": 8.0}, "expected an integer", f"{WHERE}.max_batch_size",
    ),
    "integer for a list": (
        {"max_batch_size": 4, "dynamic_batching": {"preferred_batch_sizes": 4}},
        "expected a list", f"{WHERE}.dynamic_batching.preferred_batch_sizes",
    ),
    "string in a list of integers": (
        {"inputs": [_tensor(dims=[3, "n"])]}, "expected an integer", f"{WHERE}.inputs[0].dims[1]",
    ),
    "mapping for a list": ({"inputs": {"x": 1}}, "expected a list", f"{WHERE}.inputs"),
    "list for a mapping": ({"engine": ["a"]}, "expected a mapping", f"{WHERE}.engine"),
    "string for a bool": (
        {"version_policy": {"all": "yes"}}, "expected true or false", f"{WHERE}.version_policy.all",
    ),
    "dynamic_batching not a mapping": (
        {"max_batch_size": 4, "dynamic_batching": True}, "expected a mapping",
        f"{WHERE}.dynamic_batching",
    ),
    "bad datatype": (
        {"inputs": [_tensor(datatype="FLOAT32")]}, "'FLOAT32' is not one of",
        f"{WHERE}.inputs[0].datatype",
    ),
    "bad datatype in outputs": (
        {"outputs": [_tensor(datatype="fp32")]}, "'fp32' is not one of",
        f"{WHERE}.outputs[0].datatype",
    ),
    "negative dims": (
        {"inputs": [_tensor(), _tensor(name="z", dims=[3, -2])]}, "may hold sizes or -1",
        f"{WHERE}.inputs[1].dims",
    ),
    "tensor without a name": (
        {"inputs": [{"datatype": "FP32", "dims": [1]}]}, "name", f"{WHERE}.inputs[0]",
    ),
    "duplicate tensor names": (
        {"outputs": [_tensor(), _tensor()]}, "names must be unique", f"{WHERE}.outputs",
    ),
    "dynamic_batching with max_batch_size 0": (
        {"dynamic_batching": {}}, "needs max_batch_size >= 1", f"{WHERE}.dynamic_batching",
    ),
    "negative max_batch_size": (
        {"max_batch_size": -1}, "must be >= 0", f"{WHERE}.max_batch_size",
    ),
    "zero instance_count": ({"instance_count": 0}, "must be >= 1", f"{WHERE}.instance_count"),
    "negative queue delay": (
        {"max_batch_size": 2, "dynamic_batching": {"max_queue_delay_us": -1}}, "must be >= 0",
        f"{WHERE}.dynamic_batching.max_queue_delay_us",
    ),
    "zero queue size": (
        {"max_batch_size": 2, "dynamic_batching": {"max_queue_size": 0}}, "must be >= 1",
        f"{WHERE}.dynamic_batching.max_queue_size",
    ),
    "zero preferred batch size": (
        {"max_batch_size": 2, "dynamic_batching": {"preferred_batch_sizes": [0]}},
        "must be >= 1", f"{WHERE}.dynamic_batching.preferred_batch_sizes",
    ),
    "name differs from its directory": ({"name": "other"}, "differs from its directory",
                                        f"{WHERE}.name"),
    "version_policy with two choices": (
        {"version_policy": {"latest": 1, "all": True}}, "give one of", f"{WHERE}.version_policy",
    ),
    "version_policy with three choices": (
        {"version_policy": {"latest": 1, "all": True, "specific": [1]}}, "give one of",
        f"{WHERE}.version_policy",
    ),
    "version_policy latest 0": (
        {"version_policy": {"latest": 0}}, "must be >= 1", f"{WHERE}.version_policy.latest",
    ),
    "zero tokens a streamed response": (
        {"backend": "onnxruntime-genai", "generation": {"max_tokens_per_response": 0}},
        "must be >= 1", f"{WHERE}.generation",
    ),
    "an engine core layout that does not exist": (
        {"backend": "onnxruntime-genai", "generation": {"engine_core": "fiber"}},
        "engine_core: 'fiber' is not one of auto, process, thread", f"{WHERE}.generation",
    ),
}


@pytest.mark.parametrize(("data", "match", "path"), CONFIG_ERRORS.values(),
                         ids=CONFIG_ERRORS.keys())
def test_bad_configs_are_refused_naming_the_field(
    edge: TierProfile, data: dict, match: str, path: str
) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_model_config("m", data, edge, WHERE)

    assert path in str(info.value)


def test_a_version_policy_with_two_choices_names_the_field_once(edge: TierProfile) -> None:
    with pytest.raises(ConfigError) as info:
        parse_model_config("m", {"version_policy": {"latest": 1, "all": True}}, edge, WHERE)

    assert str(info.value).startswith(f"{WHERE}.version_policy: ")


@pytest.mark.parametrize("name", ["../x", "a/b", "", "..", ".hidden", "-dash", "a b", "x" * 129,
                                  "a..b", "a\\b", "é"])
def test_bad_model_names_are_refused(edge: TierProfile, name: str) -> None:
    with pytest.raises(InvalidArgument, match="model_name: .* is not a valid model name"):
        parse_model_config(name, {}, edge, WHERE)
    with pytest.raises(InvalidArgument, match="model_name"):
        check_model_name(name)


@pytest.mark.parametrize("name", ["m", "resnet18", "a.b-c_d", "X" * 128, "0model"])
def test_good_model_names_are_accepted(name: str) -> None:
    assert check_model_name(name) == name


# --- VersionPolicy ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "available", "served"),
    [
        (VersionPolicy(), [1, 2, 3], [3]),
        (VersionPolicy(latest=1), [3, 1, 2], [3]),
        (VersionPolicy(latest=2), [3, 1, 2], [2, 3]),
        (VersionPolicy(latest=5), [2, 1], [1, 2]),
        (VersionPolicy(latest=2), [], []),
        (VersionPolicy(all=True), [3, 1, 2, 2], [1, 2, 3]),
        (VersionPolicy(all=True), [], []),
        (VersionPolicy(specific=(1, 3)), [1, 2, 3], [1, 3]),
        (VersionPolicy(specific=(4, 2)), [1, 2, 3], [2]),
        (VersionPolicy(specific=()), [1, 2], []),
    ],
    ids=["default latest 1", "latest 1", "latest 2", "latest more than exist",
         "latest of none", "all", "all of none", "specific", "specific missing one",
         "specific none"],
)
def test_version_policy_selects(policy: VersionPolicy, available: list[int],
                                served: list[int]) -> None:
    assert policy.select(available) == served


# --- complete_with_engine -----------------------------------------------------------

ENGINE_INPUTS = (
    TensorSpec("image", np.dtype(np.float32), (-1, 3, 8, 8)),
    TensorSpec("mask", np.dtype(np.bool_), (-1, 8)),
)
ENGINE_OUTPUTS = (
    TensorSpec("logits", np.dtype(np.float32), (-1, 10)),
    TensorSpec("label", np.dtype(object), (-1,)),
)


def test_complete_with_engine_fills_tensors_without_the_batch_dim() -> None:
    config = complete_with_engine(ModelConfig("m", max_batch_size=4), ENGINE_INPUTS,
                                  ENGINE_OUTPUTS, WHERE)

    assert config.inputs == (TensorConfig("image", "FP32", (3, 8, 8)),
                             TensorConfig("mask", "BOOL", (8,)))
    assert config.outputs == (TensorConfig("logits", "FP32", (10,)),
                              TensorConfig("label", "BYTES", ()))


def test_complete_with_engine_keeps_every_dim_when_the_model_does_not_batch() -> None:
    config = complete_with_engine(ModelConfig("m"), ENGINE_INPUTS, ENGINE_OUTPUTS, WHERE)

    assert config.inputs[0] == TensorConfig("image", "FP32", (-1, 3, 8, 8))
    assert config.outputs[1] == TensorConfig("label", "BYTES", (-1,))


def test_complete_with_engine_keeps_declared_tensors() -> None:
    declared = ModelConfig(
        "m", max_batch_size=4,
        inputs=(TensorConfig("mask", "BOOL", (8,)), TensorConfig("image", "FP32", (3, 8, 8))),
        outputs=(TensorConfig("logits", "FP32", (10,)),),
    )

    config = complete_with_engine(declared, ENGINE_INPUTS, ENGINE_OUTPUTS, WHERE)

    assert config == declared


COMPLETE_ERRORS = {
    "declared input the model lacks": (
        ModelConfig("m", max_batch_size=4, inputs=(TensorConfig("pixels", "FP32", (3,)),)),
        "the model has no input 'pixels'", f"{WHERE}.inputs[0].name",
    ),
    "declared output the model lacks": (
        ModelConfig("m", max_batch_size=4, outputs=(TensorConfig("logits", "FP32", (10,)),
                                                    TensorConfig("probs", "FP32", (10,)))),
        "the model has no output 'probs'", f"{WHERE}.outputs[1].name",
    ),
    "declared input datatype differs": (
        ModelConfig("m", max_batch_size=4, inputs=(TensorConfig("image", "FP16", (3, 8, 8)),
                                                   TensorConfig("mask", "BOOL", (8,)))),
        "config says FP16, the model has FP32", f"{WHERE}.inputs[0].datatype",
    ),
    "declared output datatype differs": (
        ModelConfig("m", max_batch_size=4, outputs=(TensorConfig("label", "INT64", ()),)),
        "config says INT64, the model has BYTES", f"{WHERE}.outputs[0].datatype",
    ),
    "declared inputs leave one out": (
        ModelConfig("m", max_batch_size=4, inputs=(TensorConfig("image", "FP32", (3, 8, 8)),)),
        "the model also needs mask", f"{WHERE}.inputs",
    ),
}


@pytest.mark.parametrize(("config", "match", "path"), COMPLETE_ERRORS.values(),
                         ids=COMPLETE_ERRORS.keys())
def test_complete_with_engine_refuses_disagreement(config, match, path) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        complete_with_engine(config, ENGINE_INPUTS, ENGINE_OUTPUTS, WHERE)

    assert path in str(info.value)


def test_complete_with_engine_refuses_declared_dims_that_cannot_fit_the_model() -> None:
    declared = ModelConfig(
        "m", max_batch_size=4,
        inputs=(TensorConfig("image", "FP32", (4, 4)), TensorConfig("mask", "BOOL", (8,))),
    )

    with pytest.raises(ConfigError, match="dims") as info:
        complete_with_engine(declared, ENGINE_INPUTS, ENGINE_OUTPUTS, WHERE)

    assert f"{WHERE}.inputs[0].dims" in str(info.value)


@pytest.mark.parametrize(
    "shape", [(3, 8), (), (4, 3)], ids=["fixed first dim", "scalar", "fixed batch"]
)
def test_complete_with_engine_needs_a_variable_batch_dim_when_batching(shape) -> None:
    inputs = (TensorSpec("image", np.dtype(np.float32), shape),)

    with pytest.raises(ConfigError, match="no variable batch dimension") as info:
        complete_with_engine(ModelConfig("m", max_batch_size=4), inputs, (), WHERE)

    assert f"{WHERE}.inputs" in str(info.value) and "'image'" in str(info.value)


# --- check_inputs / check_outputs ---------------------------------------------------

BATCHED = ModelConfig(
    "m",
    max_batch_size=4,
    inputs=(TensorConfig("x", "FP32", (3,)), TensorConfig("ids", "INT64", (-1,))),
    outputs=(TensorConfig("y", "FP32", (3,)), TensorConfig("z", "BYTES", ())),
    dynamic_batching=DynamicBatching(),
)
UNBATCHED = ModelConfig("u", inputs=(TensorConfig("x", "FP32", (2, -1)),),
                        outputs=(TensorConfig("y", "FP32", (2,)),))


def _inputs(rows_x: int = 2, rows_ids: int | None = None, **overrides) -> dict[str, np.ndarray]:
    rows_ids = rows_x if rows_ids is None else rows_ids
    inputs = {"x": np.zeros((rows_x, 3), np.float32), "ids": np.zeros((rows_ids, 5), np.int64)}
    inputs.update(overrides)
    return {k: v for k, v in inputs.items() if v is not None}


@pytest.mark.parametrize(
    ("config", "inputs", "batch"),
    [
        (BATCHED, _inputs(1), 1),
        (BATCHED, _inputs(4), 4),
        (BATCHED, _inputs(3, ids=np.zeros((3, 0), np.int64)), 3),
        (UNBATCHED, {"x": np.zeros((2, 7), np.float32)}, 1),
        (UNBATCHED, {"x": np.zeros((2, 0), np.float32)}, 1),
    ],
    ids=["batch of 1", "batch of max_batch_size", "zero-length variable dim",
         "unbatched model", "unbatched zero-length variable dim"],
)
def test_check_inputs_accepts_matching_inputs_and_returns_the_batch_size(
    config, inputs, batch
) -> None:
    assert check_inputs(config, inputs) == batch


CHECK_INPUT_ERRORS = {
    "unknown input": (BATCHED, _inputs(extra=np.zeros((2, 3), np.float32)),
                      "unexpected inference input 'extra' for model 'm'"),
    "missing input": (BATCHED, _inputs(ids=None),
                      r"expected 2 inputs but got 1 inputs for model 'm' \(inputs; missing 'ids'"),
    "datatype mismatch": (BATCHED, _inputs(x=np.zeros((2, 3), np.float64)),
                          "inference input 'x' data-type is 'FP64', but model 'm' expects 'FP32'"),
    "BYTES where numbers are expected": (BATCHED, _inputs(x=np.zeros((2, 3), object)),
                                         "inference input 'x' data-type is 'BYTES'"),
    "wrong rank": (BATCHED, _inputs(x=np.zeros((2, 3, 1), np.float32)),
                   r"input 'x' for model 'm'. Expected \[-1,3\], got \[2,3,1\]"),
    "missing batch dim": (BATCHED, _inputs(x=np.zeros((3,), np.float32)),
                          r"input 'x' for model 'm'. Expected \[-1,3\], got \[3\]"),
    "wrong fixed dim": (BATCHED, _inputs(x=np.zeros((2, 4), np.float32)),
                        r"input 'x' for model 'm'. Expected \[-1,3\], got \[2,4\]"),
    "wrong fixed dim unbatched": (UNBATCHED, {"x": np.zeros((3, 1), np.float32)},
                                  r"Expected \[2,-1\], got \[3,1\]"),
    "batch above max_batch_size": (BATCHED, _inputs(5),
                                   "inference request batch-size must be <= 4 for 'm' "
                                   r"\(input 'x': batch size 5"),
    "empty batch": (BATCHED, _inputs(0), "input 'x': batch size 0; at least 1"),
    "batch sizes differ between inputs": (BATCHED, _inputs(2, 3),
                                          r"batch sizes differ between inputs: \[2, 3\]"),
}


@pytest.mark.parametrize(("config", "inputs", "match"), CHECK_INPUT_ERRORS.values(),
                         ids=CHECK_INPUT_ERRORS.keys())
def test_check_inputs_refuses_mismatches(config, inputs, match) -> None:
    with pytest.raises(InvalidArgument, match=match):
        check_inputs(config, inputs)


@pytest.mark.parametrize(
    ("requested", "chosen"),
    [((), ("y", "z")), (("z",), ("z",)), (("z", "y"), ("z", "y"))],
)
def test_check_outputs_returns_the_requested_outputs_or_all(requested, chosen) -> None:
    assert check_outputs(BATCHED, requested) == chosen


def test_check_outputs_refuses_an_unknown_output() -> None:
    with pytest.raises(InvalidArgument, match="unknown output 'probs'; model 'm' has y, z"):
        check_outputs(BATCHED, ("y", "probs"))


# --- batch_policy -------------------------------------------------------------------


def test_batch_policy_of_a_batching_model() -> None:
    config = ModelConfig(
        "m", max_batch_size=16, instance_count=2,
        dynamic_batching=DynamicBatching(1500, (4, 8), 99),
    )

    assert batch_policy(config) == BatchPolicy(16, 0.0015, (4, 8), 99, 2)


def test_batch_policy_without_dynamic_batching_runs_requests_alone() -> None:
    config = ModelConfig("m", max_batch_size=16, instance_count=3, max_queue_size=12)

    assert batch_policy(config) == BatchPolicy(0, 0.0, (), 12, 3)


# --- profiles and YAML --------------------------------------------------------------


@pytest.mark.parametrize("tier", names.TIERS)
def test_every_shipped_tier_profile_loads(tier: str) -> None:
    profile = load_profile(tier)

    assert profile.tier == tier
    assert profile.engine == "onnxruntime"
    assert profile.onnxruntime["providers"][-1] == "CPUExecutionProvider"
    assert profile.instance_count >= 1
    assert isinstance(profile.limits, ServerLimits)
    # the profile's batching defaults are themselves a valid DynamicBatching
    load_dataclass(DynamicBatching, profile.dynamic_batching, f"{tier}.dynamic_batching")
    # and any model can be parsed against it
    parse_model_config("m", {"max_batch_size": 2, "dynamic_batching": {}}, profile, WHERE)


def _write(tmp_path: Path, text: str, name: str = "profile.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


EDGE_TEXT = resources.files("tiered.profiles").joinpath("edge.yaml").read_text()


@dataclass(frozen=True)
class ProfileCase:
    name: str
    text: str
    match: str
    tier: str = "edge"
    extra: tuple[str, ...] = field(default=())


PROFILE_ERRORS = [
    ProfileCase("typo at the top", EDGE_TEXT.replace("instance_count:", "instance_cont:"),
                "unknown key 'instance_cont'"),
    ProfileCase("typo in limits", EDGE_TEXT.replace("drain_timeout_s:", "drain_timeout:"),
                "unknown key 'drain_timeout'", extra=(".limits",)),
    ProfileCase("wrong type in limits",
                EDGE_TEXT.replace("max_concurrent_rpcs: 1024", "max_concurrent_rpcs: lots"),
                "expected an integer", extra=(".limits.max_concurrent_rpcs",)),
    ProfileCase("zero limit", EDGE_TEXT.replace("max_queue_size: 256\n  drain",
                                                "max_queue_size: 0\n  drain"),
                "must be >= 1", extra=(".limits.max_queue_size",)),
    ProfileCase("unknown tier", "tier: cloud\n", "'cloud' is not one of", tier="cloud",
                extra=(".tier",)),
    ProfileCase("profile for another tier", "tier: regional\n", "not 'edge'"),
    ProfileCase("no tier at all", "engine: onnxruntime\n", "tier"),
    ProfileCase("a list, not a mapping", "- tier: edge\n", "expected a mapping at the top"),
    ProfileCase("malformed YAML", "tier: edge\nonnxruntime: [a, b\n", "invalid YAML"),
]


@pytest.mark.parametrize("case", PROFILE_ERRORS, ids=[c.name for c in PROFILE_ERRORS])
def test_bad_profile_files_are_refused_naming_the_file_and_field(
    tmp_path: Path, case: ProfileCase
) -> None:
    path = _write(tmp_path, case.text)

    with pytest.raises(ConfigError, match=case.match) as info:
        load_profile(case.tier, path)

    for expected in (str(path), *case.extra):
        assert expected in str(info.value)


def test_a_copy_of_a_shipped_profile_loads_from_any_path(tmp_path: Path) -> None:
    assert load_profile("edge", _write(tmp_path, EDGE_TEXT)) == load_profile("edge")


def test_a_missing_profile_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_profile("edge", tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "text",
    ["a: [1, 2\n", "a: b: c\n", "key: 'unterminated\n", "\t- tab\n", "a: 1\na: {\n"],
    ids=["open list", "nested colon", "open quote", "tab indent", "open mapping"],
)
def test_read_yaml_refuses_malformed_yaml_naming_the_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text, "broken.yaml")

    with pytest.raises(ConfigError, match="invalid YAML") as info:
        read_yaml(path)

    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", {}), ("# only a comment\n", {}), ("a: 1\nb: [x]\n", {"a": 1, "b": ["x"]})],
)
def test_read_yaml_returns_the_top_level_mapping(tmp_path: Path, text: str, expected) -> None:
    assert read_yaml(_write(tmp_path, text)) == expected


@pytest.mark.parametrize("text", ["42\n", "- a\n", "just text\n"])
def test_read_yaml_refuses_a_top_level_that_is_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, text)

    with pytest.raises(ConfigError, match="expected a mapping at the top level") as info:
        read_yaml(path)

    assert str(path) in str(info.value)


def test_read_yaml_of_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as info:
        read_yaml(tmp_path / "absent.yaml")

    assert "absent.yaml" in str(info.value)


@pytest.mark.parametrize(("layout", "backend", "device", "gpus", "process"), [
    ("process", "onnxruntime-genai", "auto", 0, True),
    ("thread", "torch-generative", "cuda", 1, False),
    ("auto", "torch-generative", "cuda", 0, True),  # asked for: its engine says if it can
    ("auto", "torch-generative", "auto", 1, True),
    ("auto", "torch-generative", "auto", 0, False),
    ("auto", "torch-generative", "cpu", 1, False),
    ("auto", "onnxruntime-genai", "auto", 1, False),
])
def test_a_generative_engine_gets_a_process_of_its_own_where_it_runs_on_a_gpu(
        layout: str, backend: str, device: str, gpus: int, process: bool) -> None:
    assert runs_in_a_process(layout, backend, {"device": device}, lambda: gpus) is process

"""A Triton model directory's `config.pbtxt`, read as the config.yaml mapping
it stands for. Pure parsing.

The text is parsed into the `inference.ModelConfig` message (protobuf's text
format, Triton's field names), then mapped: platform or backend (ONNX
Runtime, TensorRT, and the generative onnxruntime-genai and torch-generative,
which must say `model_transaction_policy { decoupled: true }`, as any other
model may), max_batch_size,
input and output (TYPE_FP32 -> FP32), dynamic_batching (preferred sizes, delay,
the default queue policy's size), sequence_batching (control inputs, implicit
state with zero initial data, the idle limit, the strategy), ensemble_scheduling
(`platform: "ensemble"`: each step's model_name, model_version, input_map and
output_map), version_policy and instance_group counts. Fields of Triton's
config that this agent does not read are named in a warning, never silently
dropped (among them optimization, model_warmup, response_cache,
parameters and an ensemble's max_inflight_requests);
a platform it cannot serve is an error.
"""

from __future__ import annotations

import logging
from typing import Any

from google.protobuf import text_format

from tiered.agent.config import ENSEMBLE, LATEST
from tiered.engines.generative import GENERATIVE_BACKENDS
from tiered.errors import ConfigError
from tiered.protocol import model_config_pb2 as mc

log = logging.getLogger(__name__)

# Triton's platform and backend names -> ours.
BACKENDS = {"onnxruntime_onnx": "onnxruntime", "onnxruntime": "onnxruntime",
            "tensorrt_plan": "tensorrt", "tensorrt": "tensorrt",
            "onnxruntime_genai": "onnxruntime-genai", "onnxruntime-genai": "onnxruntime-genai",
            "torch-generative": "torch-generative", "ensemble": ENSEMBLE}
MODEL_FILE = "model.onnx"  # each version's file, as the repository reads it


def parse(text: str, where: str) -> dict[str, Any]:
    config = mc.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as strict:
        try:
            config = mc.ModelConfig()
            text_format.Parse(text, config, allow_unknown_field=True)
        except text_format.ParseError as error:
            raise ConfigError(f"{where}: not a Triton model configuration: {error}") from error
        log.warning("%s: ignoring what this agent does not read (%s)", where, strict)
    return _mapping(config, where)


def _mapping(config: mc.ModelConfig, where: str) -> dict[str, Any]:
    data: dict[str, Any] = {"max_batch_size": config.max_batch_size}
    if config.name:
        data["name"] = config.name
    named = config.backend or config.platform
    if named:
        if named not in BACKENDS:
            raise ConfigError(f"{where}: platform/backend {named!r} is not served here "
                              f"(served: {', '.join(sorted(BACKENDS))})")
        data["backend"] = BACKENDS[named]
    generative = data.get("backend") in GENERATIVE_BACKENDS
    if generative and not config.model_transaction_policy.decoupled:
        raise ConfigError(f"{where}.model_transaction_policy.decoupled: a generative backend "
                          "streams many responses a request: set it true")
    if config.model_transaction_policy.decoupled:
        data["decoupled"] = True
    if generative and config.default_model_filename:
        raise ConfigError(f"{where}.default_model_filename: a generative version is a "
                          "directory (a built model or a checkpoint); leave it out")
    if config.default_model_filename not in ("", MODEL_FILE):
        raise ConfigError(f"{where}.default_model_filename: each version's model must be "
                          f"{MODEL_FILE}, not {config.default_model_filename!r}")
    data["inputs"] = [_tensor(t, f"{where}.input[{i}]") for i, t in enumerate(config.input)]
    data["outputs"] = [_tensor(t, f"{where}.output[{i}]") for i, t in enumerate(config.output)]
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        data["dynamic_batching"] = {
            "preferred_batch_sizes": list(batching.preferred_batch_size),
            "max_queue_delay_us": batching.max_queue_delay_microseconds,
        }
        if batching.default_queue_policy.max_queue_size:
            data["dynamic_batching"]["max_queue_size"] = \
                batching.default_queue_policy.max_queue_size
    if config.HasField("ensemble_scheduling"):
        data["ensemble"] = _ensemble(config.ensemble_scheduling, f"{where}.ensemble_scheduling")
    if config.HasField("sequence_batching"):
        data["sequence_batching"] = _sequence_batching(config.sequence_batching,
                                                       f"{where}.sequence_batching")
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "latest":
        data["version_policy"] = {"latest": config.version_policy.latest.num_versions or 1}
    elif policy == "all":
        data["version_policy"] = {"all": True}
    elif policy == "specific":
        data["version_policy"] = {"specific": list(config.version_policy.specific.versions)}
    counts = [group.count or 1 for group in config.instance_group]
    if counts:
        data["instance_count"] = sum(counts)
    return data


def _tensor(tensor, where: str) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": _datatype(tensor.data_type, f"{where}.data_type"),
            "dims": list(tensor.dims)}


def _datatype(value: int, where: str) -> str:
    kind = mc.DataType.Name(value)
    if kind == "TYPE_INVALID":
        raise ConfigError(f"{where}: missing")
    return "BYTES" if kind == "TYPE_STRING" else kind.removeprefix("TYPE_")


def _sequence_batching(batching: mc.ModelSequenceBatching, where: str) -> dict[str, Any]:
    """Triton's sequence batcher settings as config.yaml's (sequences.py)."""
    kinds = {"CONTROL_SEQUENCE_START": "start", "CONTROL_SEQUENCE_END": "end",
             "CONTROL_SEQUENCE_READY": "ready", "CONTROL_SEQUENCE_CORRID": "corrid"}
    controls = []
    for i, entry in enumerate(batching.control_input):
        for j, control in enumerate(entry.control):
            at = f"{where}.control_input[{i}].control[{j}]"
            kind = kinds[mc.ModelSequenceBatching.Control.Kind.Name(control.kind)]
            given = [(name, list(values)) for name, values in (
                ("INT32", control.int32_false_true), ("FP32", control.fp32_false_true),
                ("BOOL", control.bool_false_true)) if values]
            if kind == "corrid":
                controls.append({"name": entry.name, "kind": kind,
                                 "datatype": _datatype(control.data_type, f"{at}.data_type")})
            elif len(given) != 1:
                raise ConfigError(f"{at}: give one of int32_false_true, fp32_false_true or "
                                  "bool_false_true")
            else:
                datatype, values = given[0]
                controls.append({"name": entry.name, "kind": kind, "datatype": datatype,
                                 "false_true": values})
    states = []
    for i, state in enumerate(batching.state):
        if any(initial.WhichOneof("state_data") == "data_file"
               for initial in state.initial_state):
            raise ConfigError(f"{where}.state[{i}].initial_state: only zero_data is served")
        states.append({"input": state.input_name, "output": state.output_name,
                       "datatype": _datatype(state.data_type, f"{where}.state[{i}].data_type"),
                       "dims": list(state.dims)})
    data: dict[str, Any] = {"controls": controls, "states": states,
                            "strategy": batching.WhichOneof("strategy_choice") or "direct"}
    if batching.max_sequence_idle_microseconds:
        data["max_sequence_idle_us"] = batching.max_sequence_idle_microseconds
    if batching.HasField("oldest") and batching.oldest.max_candidate_sequences:
        data["max_sequences"] = batching.oldest.max_candidate_sequences
    return data


def _ensemble(ensembling: mc.ModelEnsembling, where: str) -> dict[str, Any]:
    """Triton's ensemble steps as config.yaml's (`ensemble.steps`)."""
    if ensembling.max_inflight_requests:
        log.warning("%s.max_inflight_requests: not read (an ensemble's steps are bounded by "
                    "their models' queues)", where)
    steps = []
    for i, step in enumerate(ensembling.step):
        if step.model_namespace:
            raise ConfigError(f"{where}.step[{i}].model_namespace: reserved; leave it out")
        steps.append({"model": step.model_name,
                      # unset (0) reads as Triton's -1: the newest version
                      "version": step.model_version if step.model_version else LATEST,
                      "inputs": dict(step.input_map), "outputs": dict(step.output_map)})
    return {"steps": steps}

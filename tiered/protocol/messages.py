"""Conversions between v2 protocol messages and tiered's values. Pure.

The servicers call these so each RPC reads: convert the request, call the
data plane, convert the response.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiered.errors import InvalidArgument
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import model_config_pb2 as mc

# Triton's extension names for what the agent implements.
SERVER_EXTENSIONS = ("model_configuration", "model_repository", "statistics", "parameters",
                     "system_shared_memory", "cuda_shared_memory")

# Triton's response parameter: the last response of a decoupled model's request.
FINAL_RESPONSE = "triton_final_response"
# A generative model's answers: the generated token ids (an output), and on a
# whole-text (ModelInfer) answer the mean natural-log probability of those
# tokens under the model (a response parameter; the router's cascade reads it).
TOKEN_IDS = "token_ids"
TEXT_OUTPUT = "text_output"
# A vision-language model's inputs: an image, or its vision stage's output
# (the router's split sends the one tier's in place of the other's image).
IMAGE, VISUAL_TOKENS = "image", "visual_tokens"
MEAN_LOGPROB = "mean_logprob"
# A generative model's response parameters: its request's prompt in tokens, and
# on the last response why it ended ("length": max_tokens; "stop": the model's
# end or a stop string), as OpenAI's API reports them.
PROMPT_TOKENS = "prompt_tokens"
FINISH_REASON = "finish_reason"
# Triton's request parameter asking a decoupled model for an empty response
# that only says "final"; clients such as perf_analyzer send it on every request.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"

# Output parameters with a meaning here; any other is refused.
_SUPPORTED_OUTPUT_PARAMETERS = {"binary_data", codec.SHARED_MEMORY_REGION,
                                codec.SHARED_MEMORY_BYTE_SIZE, codec.SHARED_MEMORY_OFFSET}


@dataclass(frozen=True)
class InferCall:
    """A decoded ModelInferRequest."""

    model_name: str
    model_version: str
    id: str
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...]
    timeout_s: float  # math.inf when the request set none
    priority: int
    parameters: Mapping[str, Any]
    # Outputs to be written into a shared-memory region: name -> its parameters.
    output_regions: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def decode_infer_request(request: pb.ModelInferRequest, regions=None, raw=None) -> InferCall:
    """`regions`: the agent's shared memory, for tensors that name a region;
    `raw`: the raw input buffers, when they travelled apart from the message."""
    parameters = codec.parameters_of(request.parameters)
    timeout = parameters.get("timeout", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
        raise InvalidArgument(f"parameters.timeout: expected microseconds >= 0, got {timeout!r}")
    priority = parameters.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise InvalidArgument(f"parameters.priority: expected an integer >= 0, got {priority!r}")
    for index, output in enumerate(request.outputs):
        for key in output.parameters:
            if key not in _SUPPORTED_OUTPUT_PARAMETERS:
                raise InvalidArgument(
                    f"outputs[{index}] {output.name!r}: parameter {key!r} is not supported"
                )
    return InferCall(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=codec.decode_inputs(request, regions, raw),
        outputs=tuple(output.name for output in request.outputs),
        output_regions={output.name: codec.parameters_of(output.parameters)
                        for output in request.outputs
                        if codec.SHARED_MEMORY_REGION in output.parameters},
        timeout_s=timeout / 1e6 if timeout else math.inf,
        priority=priority,
        parameters=parameters,
    )


def encode_infer_response(
    call: InferCall, model_name: str, version: int, outputs: Mapping[str, np.ndarray],
    regions=None,
) -> pb.ModelInferResponse:
    """An output asked for in a shared-memory region is written there (through
    `regions`) and answered with its name, datatype, shape and region, and an
    empty buffer in its place, as Triton answers it."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=str(version), id=call.id)
    for name, array in outputs.items():
        datatype, shape, raw = codec.to_raw(array)
        tensor = response.outputs.add(name=name, datatype=datatype, shape=shape)
        region = call.output_regions.get(name)
        if region is not None:
            if regions is None:
                raise InvalidArgument(f"output {name!r}: shared-memory regions are written "
                                      "only by the agent they were registered with")
            regions.write(region, raw, f"output {name!r}")
            for key in (codec.SHARED_MEMORY_REGION, codec.SHARED_MEMORY_BYTE_SIZE,
                        codec.SHARED_MEMORY_OFFSET):
                if key in region:
                    codec.set_parameter(tensor.parameters[key], region[key])
            raw = b""
        response.raw_output_contents.append(raw)
    return response


def text_response(response: pb.ModelInferResponse, model_name: str, version: int,
                  request_id: str, outputs: Sequence[str], text: bytes,
                  token_ids: Sequence[int], prompt_tokens: int, finish: str = "",
                  ) -> pb.ModelInferResponse:
    """A generative model's answer, built in `response` (a fresh message, or
    one inside a stream message): the `outputs` asked for (none: both) of
    its text (one BYTES element) and token ids (INT64), the prompt's length
    in tokens and, on the last, why it finished. Made for every token a
    stream answers, so it fills the message directly, not through arrays."""
    response.model_name, response.model_version, response.id = \
        model_name, str(version), request_id
    for name in outputs or (TEXT_OUTPUT, TOKEN_IDS):
        if name == TEXT_OUTPUT:
            response.outputs.add(name=name, datatype="BYTES", shape=(1,))
            response.raw_output_contents.append(codec.bytes_element(text))
        elif name == TOKEN_IDS:
            response.outputs.add(name=name, datatype="INT64", shape=(len(token_ids),))
            response.raw_output_contents.append(np.asarray(token_ids, "<i8").tobytes())
        else:
            raise InvalidArgument(f"outputs: {name!r} is not a generative model's output")
    response.parameters[PROMPT_TOKENS].int64_param = prompt_tokens
    if finish:
        response.parameters[FINISH_REASON].string_param = finish
    return response


def stream_response(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    """Flag one response of a decoupled model's stream as Triton does: every
    response says whether it is the request's last."""
    response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def wants_empty_final(parameters: Mapping[str, Any]) -> bool:
    """Whether a request to a decoupled model asks for Triton's empty final response."""
    wanted = parameters.get(EMPTY_FINAL_RESPONSE, False)
    if not isinstance(wanted, bool):
        raise InvalidArgument(f"parameters.{EMPTY_FINAL_RESPONSE}: expected a bool")
    return wanted


def empty_final_response(model_name: str, version: int, request_id: str
                         ) -> pb.ModelInferResponse:
    """The response that only says a decoupled model's request is answered."""
    return stream_response(pb.ModelInferResponse(model_name=model_name,
                                                 model_version=str(version), id=request_id),
                           True)


def token_count(response: pb.ModelInferResponse) -> int:
    """Output tokens in a generative model's response: its `token_ids` (INT64)
    elements."""
    for index, output in enumerate(response.outputs):
        if output.name == TOKEN_IDS and index < len(response.raw_output_contents):
            return len(response.raw_output_contents[index]) // 8
    return 0


def tensor_metadata(
    message: pb.ModelMetadataResponse.TensorMetadata, name: str, datatype: str,
    shape: Sequence[int],
) -> None:
    message.name, message.datatype = name, datatype
    message.shape.extend(shape)


def model_metadata(config, versions: Iterable[int], platform: str) -> pb.ModelMetadataResponse:
    response = pb.ModelMetadataResponse(
        name=config.name, versions=[str(v) for v in sorted(versions)], platform=platform
    )
    for tensor in config.inputs:
        tensor_metadata(response.inputs.add(), tensor.name, tensor.datatype, config.batch_shape(tensor))
    for tensor in config.outputs:
        tensor_metadata(response.outputs.add(), tensor.name, tensor.datatype, config.batch_shape(tensor))
    return response


def _data_type(datatype: str) -> int:
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def model_config(
    config, platform: str, backend: str, gpu: bool, facts: Mapping[str, str]
) -> mc.ModelConfig:
    """Our ModelConfig dataclass in Triton's ModelConfig message shape. An
    ensemble says so by its platform alone and has no instances, as in Triton."""
    ensemble = config.ensemble
    message = mc.ModelConfig(
        name=config.name, platform=platform, backend="" if ensemble else backend,
        max_batch_size=config.max_batch_size,
    )
    for tensor in config.inputs:
        message.input.add(name=tensor.name, data_type=_data_type(tensor.datatype), dims=tensor.dims,
                          optional=tensor.optional)
    for tensor in config.outputs:
        message.output.add(name=tensor.name, data_type=_data_type(tensor.datatype), dims=tensor.dims)
    policy = config.version_policy
    if policy.all:
        message.version_policy.all.SetInParent()
    elif policy.specific is not None:
        message.version_policy.specific.versions.extend(policy.specific)
    else:
        message.version_policy.latest.num_versions = policy.latest or 1
    if ensemble is not None:
        for step in ensemble.steps:
            message.ensemble_scheduling.step.add(
                model_name=step.model, model_version=step.version, input_map=step.inputs,
                output_map=step.outputs)
    else:
        message.instance_group.add(
            name=config.name,
            kind=mc.ModelInstanceGroup.KIND_GPU if gpu else mc.ModelInstanceGroup.KIND_CPU,
            count=config.instance_count,
        )
    if config.decoupled:
        message.model_transaction_policy.decoupled = True
    batching = config.dynamic_batching
    if batching is not None:
        message.dynamic_batching.preferred_batch_size.extend(batching.preferred_batch_sizes)
        message.dynamic_batching.max_queue_delay_microseconds = batching.max_queue_delay_us
        message.dynamic_batching.default_queue_policy.max_queue_size = batching.max_queue_size
    if config.sequence_batching is not None:
        _sequence_batching(message.sequence_batching, config.sequence_batching)
    for key, value in facts.items():
        message.parameters[key].string_value = str(value)
    return message


def _sequence_batching(message, batching) -> None:
    Control = mc.ModelSequenceBatching.Control
    kinds = {"start": Control.CONTROL_SEQUENCE_START, "end": Control.CONTROL_SEQUENCE_END,
             "ready": Control.CONTROL_SEQUENCE_READY, "corrid": Control.CONTROL_SEQUENCE_CORRID}
    message.max_sequence_idle_microseconds = batching.max_sequence_idle_us
    for control in batching.controls:
        entry = message.control_input.add(name=control.name).control.add(
            kind=kinds[control.kind])
        if control.kind == "corrid":
            entry.data_type = _data_type(control.datatype)
        else:
            cast = {"INT32": int, "FP32": float, "BOOL": bool}[control.datatype]
            getattr(entry, f"{control.datatype.lower()}_false_true").extend(
                cast(value) for value in control.false_true)
    for state in batching.states:
        added = message.state.add(input_name=state.input, output_name=state.output,
                                  data_type=_data_type(state.datatype), dims=state.dims)
        added.initial_state.add(data_type=_data_type(state.datatype), dims=state.dims,
                                zero_data=True)
    if batching.strategy == "oldest":
        message.oldest.max_candidate_sequences = batching.max_sequences
    else:
        message.direct.SetInParent()


def _duration(message, duration) -> None:
    message.count, message.ns = duration.count, duration.ns


def model_statistics(name: str, version: int, stats) -> pb.ModelStatistics:
    message = pb.ModelStatistics(
        name=name,
        version=str(version),
        last_inference=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=stats.execution_count,
    )
    for phase in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        _duration(getattr(message.inference_stats, phase), getattr(stats, phase))
    for size, durations in sorted(stats.by_batch_size.items()):
        batch = message.batch_stats.add(batch_size=size)
        for phase in ("compute_input", "compute_infer", "compute_output"):
            _duration(getattr(batch, phase), getattr(durations, phase))
    return message


def repository_parameters(parameters: Mapping) -> None:
    """Load/unload parameters we do not implement are refused, not ignored."""
    for key in parameters:
        if key != "unload_dependents":
            raise InvalidArgument(f"parameters: {key!r} is not supported by this agent")

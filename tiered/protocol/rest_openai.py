"""OpenAI's API for generative models, on the servicer methods Triton's
protocols use (so routing, rollouts, shadowing, credentials, deadlines,
cancellation and statistics are theirs): `/v1/completions` and
`/v1/chat/completions`, whole or streamed as server-sent events, and
`/v1/models`.

A body becomes the ModelInferRequest a generate call would send: the prompt
as `text_input`, or the chat `messages` as a request parameter that the
agent renders with the model's chat template; sampling fields as request
parameters. An answer becomes OpenAI's JSON, usage counted from the
responses (their `token_ids`, and the agent's `prompt_tokens` and
`finish_reason` parameters). Fields that would change the answer in ways
not served (several choices, log-probabilities, penalties, tools) are
refused naming the field; others the server has no use for are ignored.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered.errors import InvalidArgument
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import messages
from tiered.protocol.rest_generate import generate_json
from tiered.protocol.rest_json import body_object, set_parameters

PREFIX = "/v1/"  # its paths
TEXT_INPUT = "text_input"
CHAT_MESSAGES = "messages"  # the agent's request parameter (tiered.agent.generation)
SAMPLING = ("temperature", "top_p", "seed")
# What is refused unless left at OpenAI's default (the value here).
NOT_SERVED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
              "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
              "suffix": None, "tools": None, "tool_choice": None, "functions": None,
              "response_format": None}
OWNER = "tiered"
_serial = itertools.count(1)


@dataclass(frozen=True)
class Call:
    """One OpenAI request, as the servicer takes it."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    request: pb.ModelInferRequest
    id: str = field(default_factory=lambda: f"{os.getpid():x}-{next(_serial)}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def completion_call(body: bytes) -> Call:
    """A /v1/completions body: `prompt` a string (or a list of one)."""
    document = body_object(body)
    prompt = document.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt: expected a string (or a list of one string)")
    request = _request(document, "max_tokens")
    _bytes_input(request, TEXT_INPUT, [prompt])
    return _call(document, False, request)


def chat_call(body: bytes) -> Call:
    """A /v1/chat/completions body: its `messages` travel as JSON text."""
    document = body_object(body)
    chat = document.get(CHAT_MESSAGES)
    if not isinstance(chat, list):
        raise InvalidArgument("messages: expected a list of messages")
    request = _request(document, "max_completion_tokens", "max_tokens")
    request.parameters[CHAT_MESSAGES].string_param = json.dumps(chat)
    return _call(document, True, request)


def _request(document: Mapping[str, Any], *max_tokens_fields: str) -> pb.ModelInferRequest:
    for name, default in NOT_SERVED.items():
        if document.get(name, default) not in (default, None):
            raise InvalidArgument(f"{name}: {document[name]!r} is not served (only {default!r})")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgument("model: expected the model's name")
    parameters: dict[str, Any] = {}
    for name in SAMPLING:
        if document.get(name) is not None:
            parameters[name] = document[name]
    for name in max_tokens_fields:
        if document.get(name) is not None:
            parameters["max_tokens"] = document[name]
            break
    request = pb.ModelInferRequest(model_name=model)
    set_parameters(request.parameters, parameters)
    stop = document.get("stop")
    if stop is not None:  # the `stop` input: a parameter holds one string, not a list
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument("stop: expected a string or a list of strings")
        _bytes_input(request, "stop", stop)
    return request


def _bytes_input(request: pb.ModelInferRequest, name: str, items: list[str]) -> None:
    """A BYTES input of `items`, as raw contents (each length-prefixed)."""
    request.inputs.add(name=name, datatype="BYTES", shape=[len(items)])
    request.raw_input_contents.append(b"".join(
        len(data).to_bytes(4, "little") + data for data in (item.encode() for item in items)))


def _call(document: Mapping[str, Any], chat: bool, request: pb.ModelInferRequest) -> Call:
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgument("stream: expected true or false")
    options = document.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options: expected an object")
    return Call(chat, request.model_name, stream, bool(options.get("include_usage")), request)


@dataclass
class Usage:
    """Tokens counted over a call's responses."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, answer: Mapping[str, Any]) -> None:
        parameters = answer.get("parameters", {})
        self.prompt_tokens = int(parameters.get(messages.PROMPT_TOKENS, self.prompt_tokens))
        ids = answer.get(messages.TOKEN_IDS, [])
        self.completion_tokens += len(ids) if isinstance(ids, list) else 1
        self.finish_reason = parameters.get(messages.FINISH_REASON) or self.finish_reason

    def json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _head(call: Call, object_name: str) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{call.id}", "object": object_name,
            "created": call.created, "model": call.model}


def answer_json(call: Call, response: pb.ModelInferResponse) -> dict[str, Any]:
    """The whole answer."""
    answer = generate_json(response)
    usage = Usage()
    usage.add(answer)
    text = answer.get("text_output", "")
    choice: dict[str, Any] = {"index": 0, "finish_reason": usage.finish_reason or "stop"}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    return {**_head(call, call.object), "choices": [choice], "usage": usage.json()}


def chunk_json(call: Call, response: pb.ModelInferResponse, usage: Usage,
               first: bool) -> dict[str, Any]:
    """One streamed response as a chunk; counts its tokens into `usage`."""
    answer = generate_json(response)
    usage.add(answer)
    text = answer.get("text_output", "")
    finish = answer.get("parameters", {}).get(messages.FINISH_REASON)
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if call.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        return {**_head(call, "chat.completion.chunk"), "choices": [choice]}
    choice.update(text=text, logprobs=None)
    return {**_head(call, "text_completion"), "choices": [choice]}


def usage_chunk(call: Call, usage: Usage) -> dict[str, Any]:
    """The last chunk stream_options.include_usage asks for: no choices, the usage."""
    object_name = "chat.completion.chunk" if call.chat else "text_completion"
    return {**_head(call, object_name), "choices": [], "usage": usage.json()}


def models_json(names: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": OWNER} for name in names]}


DONE = b"data: [DONE]\n\n"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_json(status: int, message: str) -> dict[str, Any]:
    """An error as OpenAI's clients read it."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": None, "code": None}}

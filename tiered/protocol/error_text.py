"""Triton's texts for the errors its clients and users match on (unknown
model, version or input; wrong datatype, shape or batch size; a model with
no ready version), each followed by what tiered adds: the field, and what
was expected where Triton's text does not say it. Tools written against
Triton find the text they look for at the start of the message."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def unknown_model(model: str, detail: str = "") -> str:
    return f"Request for unknown model: '{model}' is not found (model_name{detail})"


def unknown_version(model: str, version: str, serving: Iterable[int]) -> str:
    return (f"Request for unknown model: '{model}' version {version} is not found "
            f"(model_version; serving {', '.join(map(str, sorted(serving)))})")


def no_available_versions(model: str, why: str) -> str:
    return f"Request for unknown model: '{model}' has no available versions (model_name: {why})"


def unexpected_input(name: str, model: str, takes: Iterable[str]) -> str:
    return (f"unexpected inference input '{name}' for model '{model}' "
            f"(inputs; it takes {', '.join(takes)})")


def missing_inputs(model: str, expected: int, got: int, missing: Iterable[str]) -> str:
    return (f"expected {expected} inputs but got {got} inputs for model '{model}' "
            f"(inputs; missing {', '.join(repr(m) for m in missing)})")


def wrong_datatype(name: str, got: str, model: str, expected: str) -> str:
    return (f"inference input '{name}' data-type is '{got}', but model '{model}' "
            f"expects '{expected}' (input '{name}')")


def wrong_shape(name: str, model: str, expected: Sequence[int], got: Sequence[int]) -> str:
    return (f"unexpected shape for input '{name}' for model '{model}'. Expected "
            f"{_dims(expected)}, got {_dims(got)} (input '{name}'; -1 = any size)")


def batch_too_large(model: str, max_batch_size: int, name: str, got: int) -> str:
    return (f"inference request batch-size must be <= {max_batch_size} for '{model}' "
            f"(input '{name}': batch size {got}; max_batch_size)")


def decoupled_unary(model: str) -> str:
    return (f"ModelInfer RPC doesn't support models with decoupled transaction policy "
            f"(model '{model}'); send its requests on ModelStreamInfer")

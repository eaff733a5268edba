"""Domain errors map to gRPC status codes in exactly one place."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tiered import errors
from tiered.protocol.status import describe, error_from_status, status_code, translate_errors

CODES = [
    (errors.InvalidArgument("inputs[0] 'x': bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ConfigError("m/config.yaml.max_batch_size: bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound("model 'm'"), grpc.StatusCode.NOT_FOUND),
    (errors.Unavailable("unloading"), grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded("timeout"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.EngineError("engine failed"), grpc.StatusCode.INTERNAL),
    (errors.TieredError("no more specific kind"), grpc.StatusCode.INTERNAL),
    (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    (KeyError("a bug"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("error", "code"), CODES, ids=[type(e).__name__ for e, _ in CODES])
def test_each_error_class_maps_to_its_grpc_code(error: BaseException,
                                                code: grpc.StatusCode) -> None:
    assert status_code(error) == code


class _UnknownModel(errors.NotFound):
    pass


class _QueueFull(errors.ResourceExhausted, ValueError):
    pass


@pytest.mark.parametrize(
    ("error", "code"),
    [(_UnknownModel("m"), grpc.StatusCode.NOT_FOUND),
     (_QueueFull("q"), grpc.StatusCode.RESOURCE_EXHAUSTED)],
)
def test_subclasses_map_like_their_domain_base(error: BaseException,
                                               code: grpc.StatusCode) -> None:
    assert status_code(error) == code


def test_domain_errors_are_described_by_their_own_message() -> None:
    assert describe(errors.InvalidArgument("inputs[0] 'x': bad shape")) == \
        "inputs[0] 'x': bad shape"


def test_unexpected_errors_are_described_as_internal_with_their_type(caplog) -> None:
    message = describe(ZeroDivisionError("division by zero"))

    assert message == "internal error: ZeroDivisionError: division by zero"
    assert any(record.levelname == "ERROR" for record in caplog.records)


class _Context:
    """Records what a servicer method aborted with, as grpc.aio's context would."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.NotFound("unknown model 'm'"), (grpc.StatusCode.NOT_FOUND, "unknown model 'm'")),
        (RuntimeError("boom"), (grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom")),
    ],
)
def test_translate_errors_aborts_with_the_mapped_status(error, expected) -> None:
    class Servicer:
        @translate_errors
        async def ModelReady(self, request, context):
            raise error

    context = _Context()

    asyncio.run(Servicer().ModelReady(object(), context))

    assert context.aborted == expected


def test_translate_errors_passes_answers_through() -> None:
    class Servicer:
        @translate_errors
        async def ServerLive(self, request, context):
            return "live"

    context = _Context()

    assert asyncio.run(Servicer().ServerLive(object(), context)) == "live"
    assert context.aborted is None


@pytest.mark.parametrize("kind", [errors.InvalidArgument, errors.NotFound, errors.Unavailable,
                                  errors.ResourceExhausted, errors.DeadlineExceeded,
                                  errors.EngineError])
def test_an_upstream_status_maps_back_to_the_error_that_produces_it(kind):
    error = error_from_status(status_code(kind("x")), "details")
    assert status_code(error) == status_code(kind("x"))
    assert str(error) == "details"

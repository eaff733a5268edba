"""The one place that maps tiered's domain errors to gRPC status codes, and
gRPC status codes to HTTP ones (for the REST front door, `rest.py`).

Servicer methods raise `TieredError`s; `translate_errors` turns them into
statuses. Anything else is a bug: it is logged with its traceback and answered
INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from tiered import errors

log = logging.getLogger(__name__)

_CODES: dict[type[errors.TieredError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.EngineError: grpc.StatusCode.INTERNAL,
    errors.Conflict: grpc.StatusCode.ABORTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
}


# The reverse, for errors that come back from an upstream server (router ->
# agent): the first domain error mapped to each code.
_ERRORS: dict[grpc.StatusCode, type[errors.TieredError]] = {}
for _kind, _code in _CODES.items():
    _ERRORS.setdefault(_code, _kind)


# What each status is over HTTP: the same message, this code.
_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,  # the client went away
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP.get(code, 500)


def error_from_status(code: grpc.StatusCode, details: str) -> errors.TieredError:
    """The domain error an upstream status stands for (unknown codes: TieredError)."""
    return _ERRORS.get(code, errors.TieredError)(details)


def status_code(error: BaseException) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INTERNAL


def describe(error: BaseException) -> str:
    """The message a client sees for `error`."""
    if isinstance(error, errors.TieredError):
        return str(error)
    log.error("unexpected error while serving a request", exc_info=error)
    return f"internal error: {type(error).__name__}: {error}"


R = TypeVar("R")
Handler = Callable[..., Awaitable[R]]


def translate_errors(method: Handler) -> Handler:
    """Wrap an async unary servicer method so errors become gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except Exception as error:  # the server never dies of a request
            await context.abort(status_code(error), describe(error))

    return wrapper

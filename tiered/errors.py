"""Domain errors, transport-neutral.

Code anywhere in tiered raises these; exactly one place
(`tiered.protocol.status`) maps them to gRPC status codes. They never name a
transport, so engines, policies and the repository stay free of gRPC.
"""

from __future__ import annotations


class TieredError(Exception):
    """Base of every error tiered raises on purpose."""


class InvalidArgument(TieredError):
    """The request (or a config file) is malformed; the message names the field."""


class NotFound(TieredError):
    """An unknown model, version, input or output."""


class AlreadyExists(TieredError):
    """A name that is already taken (a shared-memory region)."""


class Unavailable(TieredError):
    """The target exists but cannot serve now (loading, draining, unloaded)."""


class ResourceExhausted(TieredError):
    """A bounded queue or limit is full; retry later or elsewhere."""


class DeadlineExceeded(TieredError):
    """The request's timeout passed before it could be answered."""


class EngineError(TieredError):
    """The engine failed while running a batch."""


class ConfigError(TieredError):
    """A configuration file or tier profile is invalid; the message names the field."""


class Conflict(TieredError):
    """A write based on a stale revision; re-read and try again."""


class Unauthenticated(TieredError):
    """The call carries no credentials where some are required."""


class PermissionDenied(TieredError):
    """The caller's credentials do not allow this call."""


class Unimplemented(TieredError):
    """A call this model cannot answer (a decoupled model's ModelInfer)."""


# What a client's request caused, not the server: a malformed or unknown
# request, a full queue or limit, missing or refused credentials. A version's
# telemetry counts these apart from its failures, so that the rollout judge
# (which reads only failures) cannot be driven to a rollback by what clients
# send, as Flagger's and Argo Rollouts' success rates count only server errors.
CLIENT_ERRORS = (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted,
                 Unauthenticated, PermissionDenied, Unimplemented)


def caused_by_client(error: BaseException) -> bool:
    return isinstance(error, CLIENT_ERRORS)

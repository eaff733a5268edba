"""The private descriptor pool that tiered's generated protocol stubs live in.

Why a private pool: wire compatibility with Triton's clients requires our
messages to use Triton's fully-qualified names (package ``inference``, e.g.
``inference.ModelInferRequest``). ``tritonclient`` registers its own copies of
those names in protobuf's process-wide default pool. Two *different* files
defining the same fully-qualified name in one pool raise at import time, and
users (and our tests) import tiered and tritonclient in the same process. So
``proto/generate.py`` rewrites our ``*_pb2.py`` modules to add their files to
:data:`POOL` instead of ``descriptor_pool.Default()``; message classes built
from a private pool behave exactly like ordinary generated classes.

Public names:

* :data:`POOL` -- the pool holding ``grpc_service.proto`` and
  ``model_config.proto`` (filled when ``tiered.protocol.grpc_service_pb2`` /
  ``model_config_pb2`` are imported).
* :data:`INFERENCE_SERVICE` -- ``"inference.GRPCInferenceService"``.
* :func:`method_path` -- the path a gRPC call names a service's method by.
* :func:`reflection_pool` -- :data:`POOL`, made complete for gRPC server
  reflection (adds the health and reflection service files).
* :func:`reflection_service_names` -- the service names to pass to
  ``enable_server_reflection`` together with :func:`reflection_pool`.
* :func:`build_message_classes` -- called by the generated ``*_pb2.py``
  modules in place of protobuf's own builder; not for other callers.

This module must not import the generated modules at import time: they import
it to find :data:`POOL`.
"""

from __future__ import annotations

import threading
from typing import Any

from google.protobuf import descriptor_pool, message, reflection
from google.protobuf.descriptor import Descriptor, FileDescriptor
from google.protobuf.internal import enum_type_wrapper

__all__ = [
    "INFERENCE_SERVICE",
    "POOL",
    "TELEMETRY_SERVICE",
    "build_message_classes",
    "method_path",
    "reflection_pool",
    "reflection_service_names",
]

POOL: descriptor_pool.DescriptorPool = descriptor_pool.DescriptorPool()
"""Descriptor pool of tiered's wire contracts, separate from the default pool
so tiered and tritonclient can be imported in one process."""

INFERENCE_SERVICE = "inference.GRPCInferenceService"
"""Fully-qualified name of the v2 inference service."""

TELEMETRY_SERVICE = "tiered.v1.Telemetry"
"""Fully-qualified name of tiered's telemetry service."""

_reflection_lock = threading.Lock()


def method_path(service: str, method: str) -> str:
    """The path a gRPC call names `method` of `service` by, e.g.
    ``/inference.GRPCInferenceService/ModelInfer``."""
    return f"/{service}/{method}"


def build_message_classes(file: FileDescriptor, module_name: str, module: dict[str, Any]) -> None:
    """Create the enum wrappers and message classes of ``file`` in ``module``.

    Does what protobuf's ``builder.BuildTopDescriptorsAndMessages`` does for
    generated code, except registering the classes in the process-wide
    default symbol database. Why: under the pure-Python protobuf backend that
    registration also copies each descriptor -- and its file -- into the
    default pool, where our ``model_config.proto`` would then shadow
    tritonclient's file of the same name (tritonclient, imported after us,
    breaks). Under upb the registration only fills a dict nobody reads here.
    ``proto/generate.py`` points the generated modules at this function.
    """

    def build(desc: Descriptor, prefix: str) -> type[message.Message]:
        namespace: dict[str, Any] = {
            name: build(nested, f"{prefix}{desc.name}.")
            for name, nested in desc.nested_types_by_name.items()
        }
        namespace["DESCRIPTOR"] = desc
        namespace["__module__"] = module_name
        namespace["__qualname__"] = prefix + desc.name
        cls: type[message.Message] = reflection.GeneratedProtocolMessageType(
            desc.name, (message.Message,), namespace
        )
        return cls

    for name, enum_desc in file.enum_types_by_name.items():
        module["_" + name.upper()] = enum_desc
        module[name] = enum_type_wrapper.EnumTypeWrapper(enum_desc)
        for value in enum_desc.values:
            module[value.name] = value.number
    for name, extension in file.extensions_by_name.items():
        module[name.upper() + "_FIELD_NUMBER"] = extension.number
        module[name] = extension
    for name, service in file.services_by_name.items():
        module["_" + name.upper()] = service
    for name, desc in file.message_types_by_name.items():
        module[name] = build(desc, "")


def _add_file_once(pool: descriptor_pool.DescriptorPool, file: FileDescriptor) -> None:
    """Add ``file`` (from another pool) and its imports to ``pool``."""
    # Re-adding a file a pool already holds is not reliably a no-op across
    # protobuf backends, so look it up first. Imports go in before the file
    # that needs them.
    try:
        pool.FindFileByName(file.name)
    except KeyError:
        for dependency in file.dependencies:
            _add_file_once(pool, dependency)
        pool.AddSerializedFile(file.serialized_pb)


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """Return :data:`POOL` holding every file a tiered server exposes.

    gRPC server reflection answers from exactly one pool, and a tiered server
    serves three services: ``inference.GRPCInferenceService`` (our files, in
    :data:`POOL`), ``grpc.health.v1.Health`` and the reflection service itself
    (whose files live in the default pool). This copies the latter two files
    into :data:`POOL` -- descriptors only, no message classes -- so reflection
    clients such as grpcurl can describe all three. Idempotent and
    thread-safe; also imports our generated stubs so the pool is filled.

    Use::

        reflection.enable_server_reflection(
            reflection_service_names(), server, pool=reflection_pool())
    """
    # Imported here: the generated modules import this module, and the health
    # and reflection packages are only needed by servers.
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    from tiered.protocol import grpc_service_pb2, telemetry_pb2  # noqa: F401  (fill POOL)

    with _reflection_lock:
        for module in (health_pb2, reflection_pb2):
            _add_file_once(POOL, module.DESCRIPTOR)
    return POOL


def reflection_service_names() -> tuple[str, ...]:
    """Names of the services a tiered server registers, for reflection."""
    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection

    return (INFERENCE_SERVICE, TELEMETRY_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)

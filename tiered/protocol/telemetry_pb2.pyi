# Post-processed by proto/generate.py (package imports, private descriptor pool).
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatsRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "cursor")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    cursor: float
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., cursor: _Optional[float] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("lowest_s", "growth", "bucket", "count", "sum_s")
    LOWEST_S_FIELD_NUMBER: _ClassVar[int]
    GROWTH_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_S_FIELD_NUMBER: _ClassVar[int]
    lowest_s: float
    growth: float
    bucket: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    sum_s: float
    def __init__(self, lowest_s: _Optional[float] = ..., growth: _Optional[float] = ..., bucket: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., sum_s: _Optional[float] = ...) -> None: ...

class Energy(_message.Message):
    __slots__ = ("source", "device", "joules", "idle_watts")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    JOULES_FIELD_NUMBER: _ClassVar[int]
    IDLE_WATTS_FIELD_NUMBER: _ClassVar[int]
    source: str
    device: str
    joules: float
    idle_watts: float
    def __init__(self, source: _Optional[str] = ..., device: _Optional[str] = ..., joules: _Optional[float] = ..., idle_watts: _Optional[float] = ...) -> None: ...

class VersionStats(_message.Message):
    __slots__ = ("model_name", "model_version", "device", "success", "failure", "inferences", "latency", "queue", "compute", "latency_samples_s", "busy_s", "has_energy", "energy", "joules_per_inference", "queue_depth", "in_flight", "generation", "devices", "client_errors")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    INFERENCES_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SAMPLES_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    HAS_ENERGY_FIELD_NUMBER: _ClassVar[int]
    ENERGY_FIELD_NUMBER: _ClassVar[int]
    JOULES_PER_INFERENCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    device: str
    success: int
    failure: int
    inferences: int
    latency: Histogram
    queue: Histogram
    compute: Histogram
    latency_samples_s: _containers.RepeatedScalarFieldContainer[float]
    busy_s: float
    has_energy: bool
    energy: Energy
    joules_per_inference: float
    queue_depth: int
    in_flight: int
    generation: Generation
    devices: _containers.RepeatedCompositeFieldContainer[DeviceShare]
    client_errors: int
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., device: _Optional[str] = ..., success: _Optional[int] = ..., failure: _Optional[int] = ..., inferences: _Optional[int] = ..., latency: _Optional[_Union[Histogram, _Mapping]] = ..., queue: _Optional[_Union[Histogram, _Mapping]] = ..., compute: _Optional[_Union[Histogram, _Mapping]] = ..., latency_samples_s: _Optional[_Iterable[float]] = ..., busy_s: _Optional[float] = ..., has_energy: _Optional[bool] = ..., energy: _Optional[_Union[Energy, _Mapping]] = ..., joules_per_inference: _Optional[float] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., generation: _Optional[_Union[Generation, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceShare, _Mapping]]] = ..., client_errors: _Optional[int] = ...) -> None: ...

class DeviceShare(_message.Message):
    __slots__ = ("device", "inferences", "busy_s", "joules", "up", "down_reason", "restarts")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INFERENCES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    JOULES_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    device: str
    inferences: int
    busy_s: float
    joules: float
    up: bool
    down_reason: str
    restarts: int
    def __init__(self, device: _Optional[str] = ..., inferences: _Optional[int] = ..., busy_s: _Optional[float] = ..., joules: _Optional[float] = ..., up: _Optional[bool] = ..., down_reason: _Optional[str] = ..., restarts: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("output_tokens", "time_to_first_token", "time_per_output_token", "tokens_per_s", "joules_per_output_token", "running", "max_sequences")
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    JOULES_PER_OUTPUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    output_tokens: int
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    tokens_per_s: float
    joules_per_output_token: float
    running: int
    max_sequences: int
    def __init__(self, output_tokens: _Optional[int] = ..., time_to_first_token: _Optional[_Union[Histogram, _Mapping]] = ..., time_per_output_token: _Optional[_Union[Histogram, _Mapping]] = ..., tokens_per_s: _Optional[float] = ..., joules_per_output_token: _Optional[float] = ..., running: _Optional[int] = ..., max_sequences: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tier", "start", "end", "window_s", "versions", "devices", "instance")
    TIER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    tier: str
    start: float
    end: float
    window_s: float
    versions: _containers.RepeatedCompositeFieldContainer[VersionStats]
    devices: _containers.RepeatedCompositeFieldContainer[Energy]
    instance: str
    def __init__(self, tier: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., window_s: _Optional[float] = ..., versions: _Optional[_Iterable[_Union[VersionStats, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[Energy, _Mapping]]] = ..., instance: _Optional[str] = ...) -> None: ...

class AgreementRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class TierAgreement(_message.Message):
    __slots__ = ("tier", "agreed", "disagreed")
    TIER_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    DISAGREED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    agreed: int
    disagreed: int
    def __init__(self, tier: _Optional[str] = ..., agreed: _Optional[int] = ..., disagreed: _Optional[int] = ...) -> None: ...

class AgreementResponse(_message.Message):
    __slots__ = ("instance", "tiers")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierAgreement]
    def __init__(self, instance: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierAgreement, _Mapping]]] = ...) -> None: ...

class RoutesRequest(_message.Message):
    __slots__ = ("model_name",)
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    def __init__(self, model_name: _Optional[str] = ...) -> None: ...

class TierRoute(_message.Message):
    __slots__ = ("model_name", "tier", "stable", "canary")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tier: str
    stable: int
    canary: int
    def __init__(self, model_name: _Optional[str] = ..., tier: _Optional[str] = ..., stable: _Optional[int] = ..., canary: _Optional[int] = ...) -> None: ...

class UnmetDemand(_message.Message):
    __slots__ = ("model_name", "tier", "requests", "waiting")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tier: str
    requests: int
    waiting: int
    def __init__(self, model_name: _Optional[str] = ..., tier: _Optional[str] = ..., requests: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class RoutesResponse(_message.Message):
    __slots__ = ("table_version", "routes", "instance", "unmet")
    TABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    UNMET_FIELD_NUMBER: _ClassVar[int]
    table_version: int
    routes: _containers.RepeatedCompositeFieldContainer[TierRoute]
    instance: str
    unmet: _containers.RepeatedCompositeFieldContainer[UnmetDemand]
    def __init__(self, table_version: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[TierRoute, _Mapping]]] = ..., instance: _Optional[str] = ..., unmet: _Optional[_Iterable[_Union[UnmetDemand, _Mapping]]] = ...) -> None: ...

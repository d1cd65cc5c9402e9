from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("client_version", "num_unlabeled", "num_labeled", "capabilities", "device", "skipped_images", "preparing", "protocol_version", "features")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_UNLABELED_FIELD_NUMBER: _ClassVar[int]
    NUM_LABELED_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PREPARING_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    num_unlabeled: int
    num_labeled: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    device: str
    skipped_images: int
    preparing: bool
    protocol_version: int
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_version: _Optional[str] = ..., num_unlabeled: _Optional[int] = ..., num_labeled: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., skipped_images: _Optional[int] = ..., preparing: bool = ..., protocol_version: _Optional[int] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class RunDescription(_message.Message):
    __slots__ = ("run_id", "algorithm", "model", "num_classes", "in_channels", "image_size", "total_rounds", "algorithm_options_json", "normalize_mean", "normalize_std", "model_options_json", "max_upload_bytes", "chunk_bytes", "model_factory", "architecture", "protocol_version", "terms", "classes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    IN_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_MEAN_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_STD_FIELD_NUMBER: _ClassVar[int]
    MODEL_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FACTORY_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TERMS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    algorithm: str
    model: str
    num_classes: int
    in_channels: int
    image_size: int
    total_rounds: int
    algorithm_options_json: str
    normalize_mean: _containers.RepeatedScalarFieldContainer[float]
    normalize_std: _containers.RepeatedScalarFieldContainer[float]
    model_options_json: str
    max_upload_bytes: int
    chunk_bytes: int
    model_factory: str
    architecture: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    protocol_version: int
    terms: PrivacyTerms
    classes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., algorithm: _Optional[str] = ..., model: _Optional[str] = ..., num_classes: _Optional[int] = ..., in_channels: _Optional[int] = ..., image_size: _Optional[int] = ..., total_rounds: _Optional[int] = ..., algorithm_options_json: _Optional[str] = ..., normalize_mean: _Optional[_Iterable[float]] = ..., normalize_std: _Optional[_Iterable[float]] = ..., model_options_json: _Optional[str] = ..., max_upload_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., model_factory: _Optional[str] = ..., architecture: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., protocol_version: _Optional[int] = ..., terms: _Optional[_Union[PrivacyTerms, _Mapping]] = ..., classes: _Optional[_Iterable[str]] = ...) -> None: ...

class PrivacyTerms(_message.Message):
    __slots__ = ("secure_aggregation", "client_dp", "sample_dp", "clear_metrics")
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_DP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DP_FIELD_NUMBER: _ClassVar[int]
    CLEAR_METRICS_FIELD_NUMBER: _ClassVar[int]
    secure_aggregation: SecureAggregationTerms
    client_dp: ClientDPTerms
    sample_dp: SampleDPTerms
    clear_metrics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, secure_aggregation: _Optional[_Union[SecureAggregationTerms, _Mapping]] = ..., client_dp: _Optional[_Union[ClientDPTerms, _Mapping]] = ..., sample_dp: _Optional[_Union[SampleDPTerms, _Mapping]] = ..., clear_metrics: _Optional[_Iterable[str]] = ...) -> None: ...

class SecureAggregationTerms(_message.Message):
    __slots__ = ("enabled", "min_cohort", "threshold", "neighbours", "dropouts", "signed", "min_threshold")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MIN_COHORT_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    DROPOUTS_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    MIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    min_cohort: int
    threshold: float
    neighbours: int
    dropouts: int
    signed: bool
    min_threshold: int
    def __init__(self, enabled: bool = ..., min_cohort: _Optional[int] = ..., threshold: _Optional[float] = ..., neighbours: _Optional[int] = ..., dropouts: _Optional[int] = ..., signed: bool = ..., min_threshold: _Optional[int] = ...) -> None: ...

class ClientDPTerms(_message.Message):
    __slots__ = ("enabled", "noise", "noise_multiplier", "clip_norm", "max_clip_norm", "delta", "adaptive", "clip_tensors", "epsilon_budget", "rounds", "sample_rate")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    CLIP_TENSORS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    noise: str
    noise_multiplier: float
    clip_norm: float
    max_clip_norm: float
    delta: float
    adaptive: bool
    clip_tensors: _containers.RepeatedScalarFieldContainer[str]
    epsilon_budget: float
    rounds: int
    sample_rate: float
    def __init__(self, enabled: bool = ..., noise: _Optional[str] = ..., noise_multiplier: _Optional[float] = ..., clip_norm: _Optional[float] = ..., max_clip_norm: _Optional[float] = ..., delta: _Optional[float] = ..., adaptive: bool = ..., clip_tensors: _Optional[_Iterable[str]] = ..., epsilon_budget: _Optional[float] = ..., rounds: _Optional[int] = ..., sample_rate: _Optional[float] = ...) -> None: ...

class SampleDPTerms(_message.Message):
    __slots__ = ("enabled", "noise_multiplier", "clip_norm", "delta", "epsilon_budget")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    noise_multiplier: float
    clip_norm: float
    delta: float
    epsilon_budget: float
    def __init__(self, enabled: bool = ..., noise_multiplier: _Optional[float] = ..., clip_norm: _Optional[float] = ..., delta: _Optional[float] = ..., epsilon_budget: _Optional[float] = ...) -> None: ...

class TaskPrivacy(_message.Message):
    __slots__ = ("secagg_session", "min_contributors", "client_dp", "sample_dp")
    SECAGG_SESSION_FIELD_NUMBER: _ClassVar[int]
    MIN_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_DP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_DP_FIELD_NUMBER: _ClassVar[int]
    secagg_session: str
    min_contributors: int
    client_dp: TaskClientDP
    sample_dp: SampleDPTerms
    def __init__(self, secagg_session: _Optional[str] = ..., min_contributors: _Optional[int] = ..., client_dp: _Optional[_Union[TaskClientDP, _Mapping]] = ..., sample_dp: _Optional[_Union[SampleDPTerms, _Mapping]] = ...) -> None: ...

class TaskClientDP(_message.Message):
    __slots__ = ("enabled", "clip_norm", "noise_std", "indicator_noise_std", "adaptive", "clip_tensors")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_STD_FIELD_NUMBER: _ClassVar[int]
    INDICATOR_NOISE_STD_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    CLIP_TENSORS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    clip_norm: float
    noise_std: float
    indicator_noise_std: float
    adaptive: bool
    clip_tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, enabled: bool = ..., clip_norm: _Optional[float] = ..., noise_std: _Optional[float] = ..., indicator_noise_std: _Optional[float] = ..., adaptive: bool = ..., clip_tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class PolicyRefusal(_message.Message):
    __slots__ = ("kind", "clause", "required", "offered", "message", "round")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[PolicyRefusal.Kind]
        REFUSED: _ClassVar[PolicyRefusal.Kind]
        BREACH: _ClassVar[PolicyRefusal.Kind]
        BUDGET: _ClassVar[PolicyRefusal.Kind]
    KIND_UNSPECIFIED: PolicyRefusal.Kind
    REFUSED: PolicyRefusal.Kind
    BREACH: PolicyRefusal.Kind
    BUDGET: PolicyRefusal.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLAUSE_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    kind: PolicyRefusal.Kind
    clause: str
    required: str
    offered: str
    message: str
    round: int
    def __init__(self, kind: _Optional[_Union[PolicyRefusal.Kind, str]] = ..., clause: _Optional[str] = ..., required: _Optional[str] = ..., offered: _Optional[str] = ..., message: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "refusal")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    refusal: PolicyRefusal
    def __init__(self, run_id: _Optional[str] = ..., refusal: _Optional[_Union[PolicyRefusal, _Mapping]] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: bool = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("silo_id", "run")
    SILO_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    silo_id: str
    run: RunDescription
    def __init__(self, silo_id: _Optional[str] = ..., run: _Optional[_Union[RunDescription, _Mapping]] = ...) -> None: ...

class NextTaskRequest(_message.Message):
    __slots__ = ("run_id", "last_round_done")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_DONE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    last_round_done: int
    def __init__(self, run_id: _Optional[str] = ..., last_round_done: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("kind", "run_id", "round", "task_id", "bundle_bytes", "bundle_sha256", "hyperparameters_json", "class_thresholds", "expected", "retry_after_s", "message", "secagg_stage", "secagg_payload", "privacy", "upload_within_s")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Task.Kind]
        WAIT: _ClassVar[Task.Kind]
        TRAIN: _ClassVar[Task.Kind]
        DONE: _ClassVar[Task.Kind]
        SECAGG: _ClassVar[Task.Kind]
        RECEIVE: _ClassVar[Task.Kind]
    KIND_UNSPECIFIED: Task.Kind
    WAIT: Task.Kind
    TRAIN: Task.Kind
    DONE: Task.Kind
    SECAGG: Task.Kind
    RECEIVE: Task.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    CLASS_THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SECAGG_STAGE_FIELD_NUMBER: _ClassVar[int]
    SECAGG_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    kind: Task.Kind
    run_id: str
    round: int
    task_id: str
    bundle_bytes: int
    bundle_sha256: str
    hyperparameters_json: str
    class_thresholds: _containers.RepeatedScalarFieldContainer[float]
    expected: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    retry_after_s: float
    message: str
    secagg_stage: str
    secagg_payload: bytes
    privacy: TaskPrivacy
    upload_within_s: float
    def __init__(self, kind: _Optional[_Union[Task.Kind, str]] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., bundle_bytes: _Optional[int] = ..., bundle_sha256: _Optional[str] = ..., hyperparameters_json: _Optional[str] = ..., class_thresholds: _Optional[_Iterable[float]] = ..., expected: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., retry_after_s: _Optional[float] = ..., message: _Optional[str] = ..., secagg_stage: _Optional[str] = ..., secagg_payload: _Optional[bytes] = ..., privacy: _Optional[_Union[TaskPrivacy, _Mapping]] = ..., upload_within_s: _Optional[float] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("run_id", "task_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("run_id", "task_id", "round", "total_bytes", "sha256", "skipped", "metrics", "secagg_stage")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_STAGE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    round: int
    total_bytes: int
    sha256: str
    skipped: bool
    metrics: _containers.ScalarMap[str, float]
    secagg_stage: str
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., round: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., skipped: bool = ..., metrics: _Optional[_Mapping[str, float]] = ..., secagg_stage: _Optional[str] = ...) -> None: ...

class UploadMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: bool = ..., message: _Optional[str] = ...) -> None: ...

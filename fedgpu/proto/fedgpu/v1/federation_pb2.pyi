from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DigestAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIGEST_ALGORITHM_UNSPECIFIED: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_SHA256: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_BLAKE3: _ClassVar[DigestAlgorithm]
    DIGEST_ALGORITHM_BLAKE3_SEGMENTS: _ClassVar[DigestAlgorithm]

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_NONE: _ClassVar[TaskKind]
    TASK_KIND_INIT: _ClassVar[TaskKind]
    TASK_KIND_TRAIN: _ClassVar[TaskKind]
    TASK_KIND_EVALUATE: _ClassVar[TaskKind]
    TASK_KIND_SHUTDOWN: _ClassVar[TaskKind]
    TASK_KIND_SECAGG_ADVERTISE_KEYS: _ClassVar[TaskKind]
    TASK_KIND_SECAGG_SHARE_KEYS: _ClassVar[TaskKind]
    TASK_KIND_SECAGG_MASKED_INPUT: _ClassVar[TaskKind]
    TASK_KIND_SECAGG_UNMASK: _ClassVar[TaskKind]
    TASK_KIND_SECAGG_CONSISTENCY: _ClassVar[TaskKind]
    TASK_KIND_STATISTICS: _ClassVar[TaskKind]
    TASK_KIND_LOCAL_MODEL: _ClassVar[TaskKind]
DIGEST_ALGORITHM_UNSPECIFIED: DigestAlgorithm
DIGEST_ALGORITHM_SHA256: DigestAlgorithm
DIGEST_ALGORITHM_BLAKE3: DigestAlgorithm
DIGEST_ALGORITHM_BLAKE3_SEGMENTS: DigestAlgorithm
TASK_KIND_NONE: TaskKind
TASK_KIND_INIT: TaskKind
TASK_KIND_TRAIN: TaskKind
TASK_KIND_EVALUATE: TaskKind
TASK_KIND_SHUTDOWN: TaskKind
TASK_KIND_SECAGG_ADVERTISE_KEYS: TaskKind
TASK_KIND_SECAGG_SHARE_KEYS: TaskKind
TASK_KIND_SECAGG_MASKED_INPUT: TaskKind
TASK_KIND_SECAGG_UNMASK: TaskKind
TASK_KIND_SECAGG_CONSISTENCY: TaskKind
TASK_KIND_STATISTICS: TaskKind
TASK_KIND_LOCAL_MODEL: TaskKind

class BulkTicket(_message.Message):
    __slots__ = ("ticket", "port", "expires_in_s", "already_accepted", "message")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ticket: str
    port: int
    expires_in_s: float
    already_accepted: bool
    message: str
    def __init__(self, ticket: _Optional[str] = ..., port: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., already_accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_mib", "memory_used_mib", "memory_free_mib", "utilization_pct", "compute_capability", "healthy", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_MIB_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    utilization_pct: int
    compute_capability: str
    healthy: bool
    reason: str
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_mib: _Optional[int] = ..., memory_used_mib: _Optional[int] = ..., memory_free_mib: _Optional[int] = ..., utilization_pct: _Optional[int] = ..., compute_capability: _Optional[str] = ..., healthy: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DeviceInventory(_message.Message):
    __slots__ = ("nvml_available", "nvml_reason", "driver_version", "cuda_driver_version", "gpus")
    NVML_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NVML_REASON_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    nvml_available: bool
    nvml_reason: str
    driver_version: str
    cuda_driver_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, nvml_available: _Optional[bool] = ..., nvml_reason: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_driver_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class GpuDecision(_message.Message):
    __slots__ = ("mode", "use_gpu", "device", "gpu_index", "gpu_uuid", "gpu_name", "memory_fraction", "reason", "warnings")
    MODE_FIELD_NUMBER: _ClassVar[int]
    USE_GPU_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    use_gpu: bool
    device: str
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    memory_fraction: float
    reason: str
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, mode: _Optional[str] = ..., use_gpu: _Optional[bool] = ..., device: _Optional[str] = ..., gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., gpu_name: _Optional[str] = ..., memory_fraction: _Optional[float] = ..., reason: _Optional[str] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_name", "version", "devices", "decision", "labels", "tasks", "ring_host", "ring_port", "num_examples", "task_approval", "identity", "capacity", "site_policy_json", "slots")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    RING_HOST_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TASK_APPROVAL_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SITE_POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    version: str
    devices: DeviceInventory
    decision: GpuDecision
    labels: _containers.ScalarMap[str, str]
    tasks: _containers.RepeatedScalarFieldContainer[str]
    ring_host: str
    ring_port: int
    num_examples: int
    task_approval: str
    identity: str
    capacity: NodeCapacity
    site_policy_json: str
    slots: int
    def __init__(self, node_name: _Optional[str] = ..., version: _Optional[str] = ..., devices: _Optional[_Union[DeviceInventory, _Mapping]] = ..., decision: _Optional[_Union[GpuDecision, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., tasks: _Optional[_Iterable[str]] = ..., ring_host: _Optional[str] = ..., ring_port: _Optional[int] = ..., num_examples: _Optional[int] = ..., task_approval: _Optional[str] = ..., identity: _Optional[str] = ..., capacity: _Optional[_Union[NodeCapacity, _Mapping]] = ..., site_policy_json: _Optional[str] = ..., slots: _Optional[int] = ...) -> None: ...

class NodeCapacity(_message.Message):
    __slots__ = ("gpu_mode", "gpu_min_free_mib", "nvml_available", "nvml_reason", "gpus")
    GPU_MODE_FIELD_NUMBER: _ClassVar[int]
    GPU_MIN_FREE_MIB_FIELD_NUMBER: _ClassVar[int]
    NVML_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NVML_REASON_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    gpu_mode: str
    gpu_min_free_mib: int
    nvml_available: bool
    nvml_reason: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, gpu_mode: _Optional[str] = ..., gpu_min_free_mib: _Optional[int] = ..., nvml_available: _Optional[bool] = ..., nvml_reason: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("node_id", "run_id", "heartbeat_interval_s", "max_update_bytes", "chunk_size", "bulk_port", "offers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_UPDATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    heartbeat_interval_s: int
    max_update_bytes: int
    chunk_size: int
    bulk_port: int
    offers: _containers.RepeatedCompositeFieldContainer[TaskBundle]
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[int] = ..., max_update_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., bulk_port: _Optional[int] = ..., offers: _Optional[_Iterable[_Union[TaskBundle, _Mapping]]] = ...) -> None: ...

class PullTaskRequest(_message.Message):
    __slots__ = ("node_id", "wait_s", "bulk", "bulk_error", "resume_task_id", "resume_offset", "down_bytes_per_s", "up_bytes_per_s", "busy_task_ids", "only_task_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    BULK_ERROR_FIELD_NUMBER: _ClassVar[int]
    RESUME_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUSY_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    ONLY_TASK_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    wait_s: int
    bulk: bool
    bulk_error: str
    resume_task_id: str
    resume_offset: int
    down_bytes_per_s: float
    up_bytes_per_s: float
    busy_task_ids: _containers.RepeatedScalarFieldContainer[str]
    only_task_id: str
    def __init__(self, node_id: _Optional[str] = ..., wait_s: _Optional[int] = ..., bulk: _Optional[bool] = ..., bulk_error: _Optional[str] = ..., resume_task_id: _Optional[str] = ..., resume_offset: _Optional[int] = ..., down_bytes_per_s: _Optional[float] = ..., up_bytes_per_s: _Optional[float] = ..., busy_task_ids: _Optional[_Iterable[str]] = ..., only_task_id: _Optional[str] = ...) -> None: ...

class TaskHeader(_message.Message):
    __slots__ = ("task_id", "round", "kind", "task_name", "hyperparameters_json", "use_gpu", "payload_size", "payload_sha256", "evaluated_round", "seed", "message", "ring", "bulk", "payload_digest_algorithm", "payload_digest", "bundle", "resources", "secagg_setup", "secagg_stage_timeout_s", "privacy_local", "privacy_distributed", "payload_offset", "job_terms", "statistics", "local_model_of", "payload_segment_digests")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TASK_NAME_FIELD_NUMBER: _ClassVar[int]
    HYPERPARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    USE_GPU_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_ROUND_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SETUP_FIELD_NUMBER: _ClassVar[int]
    SECAGG_STAGE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_LOCAL_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    JOB_TERMS_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MODEL_OF_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SEGMENT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    kind: TaskKind
    task_name: str
    hyperparameters_json: str
    use_gpu: bool
    payload_size: int
    payload_sha256: str
    evaluated_round: int
    seed: int
    message: str
    ring: RingAssignment
    bulk: BulkTicket
    payload_digest_algorithm: DigestAlgorithm
    payload_digest: str
    bundle: TaskBundle
    resources: JobResources
    secagg_setup: bytes
    secagg_stage_timeout_s: float
    privacy_local: PrivacyLocalDp
    privacy_distributed: PrivacyDistributedDp
    payload_offset: int
    job_terms: JobTerms
    statistics: StatisticsRelease
    local_model_of: str
    payload_segment_digests: bytes
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., task_name: _Optional[str] = ..., hyperparameters_json: _Optional[str] = ..., use_gpu: _Optional[bool] = ..., payload_size: _Optional[int] = ..., payload_sha256: _Optional[str] = ..., evaluated_round: _Optional[int] = ..., seed: _Optional[int] = ..., message: _Optional[str] = ..., ring: _Optional[_Union[RingAssignment, _Mapping]] = ..., bulk: _Optional[_Union[BulkTicket, _Mapping]] = ..., payload_digest_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., payload_digest: _Optional[str] = ..., bundle: _Optional[_Union[TaskBundle, _Mapping]] = ..., resources: _Optional[_Union[JobResources, _Mapping]] = ..., secagg_setup: _Optional[bytes] = ..., secagg_stage_timeout_s: _Optional[float] = ..., privacy_local: _Optional[_Union[PrivacyLocalDp, _Mapping]] = ..., privacy_distributed: _Optional[_Union[PrivacyDistributedDp, _Mapping]] = ..., payload_offset: _Optional[int] = ..., job_terms: _Optional[_Union[JobTerms, _Mapping]] = ..., statistics: _Optional[_Union[StatisticsRelease, _Mapping]] = ..., local_model_of: _Optional[str] = ..., payload_segment_digests: _Optional[bytes] = ...) -> None: ...

class JobTerms(_message.Message):
    __slots__ = ("job_id", "study", "rounds", "secure_aggregation", "dp_mode", "target_epsilon")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STUDY_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    DP_MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    study: str
    rounds: int
    secure_aggregation: bool
    dp_mode: str
    target_epsilon: float
    def __init__(self, job_id: _Optional[str] = ..., study: _Optional[str] = ..., rounds: _Optional[int] = ..., secure_aggregation: _Optional[bool] = ..., dp_mode: _Optional[str] = ..., target_epsilon: _Optional[float] = ...) -> None: ...

class StatisticsRelease(_message.Message):
    __slots__ = ("min_count", "noise", "epsilon", "delta")
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    min_count: int
    noise: str
    epsilon: float
    delta: float
    def __init__(self, min_count: _Optional[int] = ..., noise: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class PrivacyLocalDp(_message.Message):
    __slots__ = ("clip_norm", "noise_multiplier")
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    clip_norm: float
    noise_multiplier: float
    def __init__(self, clip_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ...) -> None: ...

class PrivacyDistributedDp(_message.Message):
    __slots__ = ("clip_norm", "noise_multiplier")
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    clip_norm: float
    noise_multiplier: float
    def __init__(self, clip_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ...) -> None: ...

class JobResources(_message.Message):
    __slots__ = ("gpu", "min_gpu_free_mib", "gpu_memory_mib", "workers", "min_workers")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MIN_GPU_FREE_MIB_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    min_gpu_free_mib: int
    gpu_memory_mib: int
    workers: int
    min_workers: int
    def __init__(self, gpu: _Optional[str] = ..., min_gpu_free_mib: _Optional[int] = ..., gpu_memory_mib: _Optional[int] = ..., workers: _Optional[int] = ..., min_workers: _Optional[int] = ...) -> None: ...

class TaskBundle(_message.Message):
    __slots__ = ("sha256", "size", "name", "entry", "job_id")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    name: str
    entry: str
    job_id: str
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ..., name: _Optional[str] = ..., entry: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class FetchBundleRequest(_message.Message):
    __slots__ = ("node_id", "sha256")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    sha256: str
    def __init__(self, node_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class BundleChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TaskBundle
    data: bytes
    def __init__(self, header: _Optional[_Union[TaskBundle, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BundleStatus(_message.Message):
    __slots__ = ("sha256", "state", "reason")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    state: str
    reason: str
    def __init__(self, sha256: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RingAssignment(_message.Message):
    __slots__ = ("run_id", "rank", "world_size", "master_addr", "master_port", "first_iteration", "iterations", "total_iterations", "local_steps", "mixing", "peers", "restart", "timeout_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITERATION_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIXING_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    first_iteration: int
    iterations: int
    total_iterations: int
    local_steps: int
    mixing: _containers.RepeatedScalarFieldContainer[float]
    peers: _containers.RepeatedScalarFieldContainer[str]
    restart: bool
    timeout_s: float
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., first_iteration: _Optional[int] = ..., iterations: _Optional[int] = ..., total_iterations: _Optional[int] = ..., local_steps: _Optional[int] = ..., mixing: _Optional[_Iterable[float]] = ..., peers: _Optional[_Iterable[str]] = ..., restart: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TaskChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TaskHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TaskHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RoundResources(_message.Message):
    __slots__ = ("device", "gpu_uuid", "nvml_used_before_mib", "nvml_used_peak_mib", "nvml_used_after_mib", "torch_peak_allocated_mib", "torch_peak_reserved_mib", "rss_peak_mib", "train_seconds", "round_seconds", "queued_seconds", "devices", "device_seconds")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_BEFORE_MIB_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_PEAK_MIB_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_AFTER_MIB_FIELD_NUMBER: _ClassVar[int]
    TORCH_PEAK_ALLOCATED_MIB_FIELD_NUMBER: _ClassVar[int]
    TORCH_PEAK_RESERVED_MIB_FIELD_NUMBER: _ClassVar[int]
    RSS_PEAK_MIB_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    device: str
    gpu_uuid: str
    nvml_used_before_mib: int
    nvml_used_peak_mib: int
    nvml_used_after_mib: int
    torch_peak_allocated_mib: int
    torch_peak_reserved_mib: int
    rss_peak_mib: int
    train_seconds: float
    round_seconds: float
    queued_seconds: float
    devices: _containers.RepeatedCompositeFieldContainer[DeviceUse]
    device_seconds: float
    def __init__(self, device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., nvml_used_before_mib: _Optional[int] = ..., nvml_used_peak_mib: _Optional[int] = ..., nvml_used_after_mib: _Optional[int] = ..., torch_peak_allocated_mib: _Optional[int] = ..., torch_peak_reserved_mib: _Optional[int] = ..., rss_peak_mib: _Optional[int] = ..., train_seconds: _Optional[float] = ..., round_seconds: _Optional[float] = ..., queued_seconds: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[DeviceUse, _Mapping]]] = ..., device_seconds: _Optional[float] = ...) -> None: ...

class DeviceUse(_message.Message):
    __slots__ = ("rank", "device", "gpu_uuid", "nvml_used_before_mib", "nvml_used_peak_mib", "nvml_used_after_mib", "train_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_BEFORE_MIB_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_PEAK_MIB_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_AFTER_MIB_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: str
    gpu_uuid: str
    nvml_used_before_mib: int
    nvml_used_peak_mib: int
    nvml_used_after_mib: int
    train_seconds: float
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., nvml_used_before_mib: _Optional[int] = ..., nvml_used_peak_mib: _Optional[int] = ..., nvml_used_after_mib: _Optional[int] = ..., train_seconds: _Optional[float] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("node_id", "task_id", "round", "kind", "num_examples", "payload_size", "payload_sha256", "train_metrics", "eval_metrics", "num_eval_examples", "resources", "decision", "failed", "error", "evaluated_round", "iteration_loss", "lost_ranks", "payload_digest_algorithm", "payload_digest", "ineligible", "ineligible_reason", "statistics_json", "payload_offset", "payload_segment_digests")
    class TrainMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    TRAIN_METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVAL_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_ROUND_FIELD_NUMBER: _ClassVar[int]
    ITERATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    INELIGIBLE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_JSON_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SEGMENT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    task_id: str
    round: int
    kind: TaskKind
    num_examples: int
    payload_size: int
    payload_sha256: str
    train_metrics: _containers.ScalarMap[str, float]
    eval_metrics: _containers.ScalarMap[str, float]
    num_eval_examples: int
    resources: RoundResources
    decision: GpuDecision
    failed: bool
    error: str
    evaluated_round: int
    iteration_loss: _containers.RepeatedScalarFieldContainer[float]
    lost_ranks: _containers.RepeatedScalarFieldContainer[int]
    payload_digest_algorithm: DigestAlgorithm
    payload_digest: str
    ineligible: bool
    ineligible_reason: str
    statistics_json: str
    payload_offset: int
    payload_segment_digests: bytes
    def __init__(self, node_id: _Optional[str] = ..., task_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., num_examples: _Optional[int] = ..., payload_size: _Optional[int] = ..., payload_sha256: _Optional[str] = ..., train_metrics: _Optional[_Mapping[str, float]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., num_eval_examples: _Optional[int] = ..., resources: _Optional[_Union[RoundResources, _Mapping]] = ..., decision: _Optional[_Union[GpuDecision, _Mapping]] = ..., failed: _Optional[bool] = ..., error: _Optional[str] = ..., evaluated_round: _Optional[int] = ..., iteration_loss: _Optional[_Iterable[float]] = ..., lost_ranks: _Optional[_Iterable[int]] = ..., payload_digest_algorithm: _Optional[_Union[DigestAlgorithm, str]] = ..., payload_digest: _Optional[str] = ..., ineligible: _Optional[bool] = ..., ineligible_reason: _Optional[str] = ..., statistics_json: _Optional[str] = ..., payload_offset: _Optional[int] = ..., payload_segment_digests: _Optional[bytes] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadOffsetReply(_message.Message):
    __slots__ = ("offset", "already_accepted", "message")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    already_accepted: bool
    message: str
    def __init__(self, offset: _Optional[int] = ..., already_accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "state", "decision", "task_id", "capacity", "bundles", "down_bytes_per_s", "up_bytes_per_s", "more_task_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    DOWN_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    UP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MORE_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: str
    decision: GpuDecision
    task_id: str
    capacity: NodeCapacity
    bundles: _containers.RepeatedCompositeFieldContainer[BundleStatus]
    down_bytes_per_s: float
    up_bytes_per_s: float
    more_task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[str] = ..., decision: _Optional[_Union[GpuDecision, _Mapping]] = ..., task_id: _Optional[str] = ..., capacity: _Optional[_Union[NodeCapacity, _Mapping]] = ..., bundles: _Optional[_Iterable[_Union[BundleStatus, _Mapping]]] = ..., down_bytes_per_s: _Optional[float] = ..., up_bytes_per_s: _Optional[float] = ..., more_task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "shutdown", "bulk_port", "abandon", "offers", "abandon_task_ids")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    ABANDON_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    shutdown: bool
    bulk_port: int
    abandon: bool
    offers: _containers.RepeatedCompositeFieldContainer[TaskBundle]
    abandon_task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, known: _Optional[bool] = ..., shutdown: _Optional[bool] = ..., bulk_port: _Optional[int] = ..., abandon: _Optional[bool] = ..., offers: _Optional[_Iterable[_Union[TaskBundle, _Mapping]]] = ..., abandon_task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

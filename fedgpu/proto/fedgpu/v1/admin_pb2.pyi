from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetAuditRequest(_message.Message):
    __slots__ = ("after_seq", "limit", "verify")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    verify: bool
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ..., verify: _Optional[bool] = ...) -> None: ...

class AddUserRequest(_message.Message):
    __slots__ = ("name", "role", "studies", "cert_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STUDIES_FIELD_NUMBER: _ClassVar[int]
    CERT_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    studies: _containers.RepeatedScalarFieldContainer[str]
    cert_sha256: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., studies: _Optional[_Iterable[str]] = ..., cert_sha256: _Optional[str] = ...) -> None: ...

class ListUsersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RevokeUserRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ForgetNodeRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class StopServerRequest(_message.Message):
    __slots__ = ("retire_nodes",)
    RETIRE_NODES_FIELD_NUMBER: _ClassVar[int]
    retire_nodes: bool
    def __init__(self, retire_nodes: _Optional[bool] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListRoundsRequest(_message.Message):
    __slots__ = ("offset", "job_id")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    offset: int
    job_id: str
    def __init__(self, offset: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class SubmitJobHeader(_message.Message):
    __slots__ = ("job_toml", "filename", "bundle_size", "bundle_sha256", "initial_weights_size", "initial_weights_sha256")
    JOB_TOML_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WEIGHTS_SIZE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    job_toml: str
    filename: str
    bundle_size: int
    bundle_sha256: str
    initial_weights_size: int
    initial_weights_sha256: str
    def __init__(self, job_toml: _Optional[str] = ..., filename: _Optional[str] = ..., bundle_size: _Optional[int] = ..., bundle_sha256: _Optional[str] = ..., initial_weights_size: _Optional[int] = ..., initial_weights_sha256: _Optional[str] = ...) -> None: ...

class SubmitJobChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SubmitJobHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SubmitJobHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job_id", "follow", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    follow: bool
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., follow: _Optional[bool] = ..., after_seq: _Optional[int] = ...) -> None: ...

class DownloadModelRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("job_id", "round", "size", "sha256")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    size: int
    sha256: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class JsonReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class CreateStudyRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class EnrolSitesRequest(_message.Message):
    __slots__ = ("name", "sites")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sites: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., sites: _Optional[_Iterable[str]] = ...) -> None: ...

class ListStudiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

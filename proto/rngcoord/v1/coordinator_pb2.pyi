from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinGroupRequest(_message.Message):
    __slots__ = ("job", "group", "rank", "world_size", "member_id", "job_seed", "timeout_ms")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_SEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    rank: int
    world_size: int
    member_id: str
    job_seed: int
    timeout_ms: int
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., member_id: _Optional[str] = ..., job_seed: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class JoinGroupResponse(_message.Message):
    __slots__ = ("epoch", "seed", "start", "job_seed", "members")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    JOB_SEED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seed: int
    start: int
    job_seed: int
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., seed: _Optional[int] = ..., start: _Optional[int] = ..., job_seed: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("job", "group", "epoch", "seq", "size", "fingerprint", "rank", "member_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    epoch: int
    seq: int
    size: int
    fingerprint: bytes
    rank: int
    member_id: str
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., size: _Optional[int] = ..., fingerprint: _Optional[bytes] = ..., rank: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("group", "epoch", "seq", "seed", "start", "end")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    group: str
    epoch: int
    seq: int
    seed: int
    start: int
    end: int
    def __init__(self, group: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., seed: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease", "existing")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    existing: bool
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., existing: _Optional[bool] = ...) -> None: ...

class LeaveGroupRequest(_message.Message):
    __slots__ = ("job", "group", "epoch", "rank", "member_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    epoch: int
    rank: int
    member_id: str
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class LeaveGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetGroupRequest(_message.Message):
    __slots__ = ("job", "group")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ...) -> None: ...

class GetGroupResponse(_message.Message):
    __slots__ = ("job", "group", "seed", "epoch", "members", "high_water", "leases", "job_seed")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    JOB_SEED_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    seed: int
    epoch: int
    members: _containers.RepeatedScalarFieldContainer[str]
    high_water: int
    leases: int
    job_seed: int
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., high_water: _Optional[int] = ..., leases: _Optional[int] = ..., job_seed: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("job", "group", "epoch", "seq", "cursor", "rank", "member_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    epoch: int
    seq: int
    cursor: int
    rank: int
    member_id: str
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., cursor: _Optional[int] = ..., rank: _Optional[int] = ..., member_id: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("cursor", "existing")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    existing: bool
    def __init__(self, cursor: _Optional[int] = ..., existing: _Optional[bool] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("job", "group", "kinds", "since_us", "until_us", "limit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    since_us: int
    until_us: int
    limit: int
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("id", "ts_us", "job", "group", "kind", "actor", "detail", "prev_hash", "hash")
    ID_FIELD_NUMBER: _ClassVar[int]
    TS_US_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    id: int
    ts_us: int
    job: str
    group: str
    kind: str
    actor: str
    detail: str
    prev_hash: str
    hash: str
    def __init__(self, id: _Optional[int] = ..., ts_us: _Optional[int] = ..., job: _Optional[str] = ..., group: _Optional[str] = ..., kind: _Optional[str] = ..., actor: _Optional[str] = ..., detail: _Optional[str] = ..., prev_hash: _Optional[str] = ..., hash: _Optional[str] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterInfo
    def __init__(self, adapter: _Optional[_Union[AdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("draining_requests",)
    DRAINING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    draining_requests: int
    def __init__(self, draining_requests: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "max_loras", "max_cpu_loras", "max_lora_rank")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "resident", "running_requests", "host_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    resident: bool
    running_requests: int
    host_bytes: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., resident: _Optional[bool] = ..., running_requests: _Optional[int] = ..., host_bytes: _Optional[int] = ...) -> None: ...

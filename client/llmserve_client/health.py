"""The standard grpc.health.v1 messages, built at import from a descriptor so that the client needs
nothing beyond protobuf (the grpcio-health-checking package is a server-side dependency).

They live in a private descriptor pool: a process that also imports grpc_health gets no conflict.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

CHECK_METHOD = "/grpc.health.v1.Health/Check"
STATUS_NAMES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")


def _build() -> tuple[type, type]:
    f = descriptor_pb2.FileDescriptorProto(name="grpc/health/v1/health.proto", package="grpc.health.v1")
    f.syntax = "proto3"
    Field = descriptor_pb2.FieldDescriptorProto
    request = f.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=Field.TYPE_STRING, label=Field.LABEL_OPTIONAL)
    response = f.message_type.add(name="HealthCheckResponse")
    enum = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(STATUS_NAMES):
        enum.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=Field.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=Field.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest: Any
HealthCheckResponse: Any
HealthCheckRequest, HealthCheckResponse = _build()


def check_method(channel: Any) -> Any:
    """The Health/Check method of a grpc or grpc.aio channel, as a callable."""
    return channel.unary_unary(
        CHECK_METHOD,
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )


def status_name(response: object) -> str:
    """ "SERVING", "NOT_SERVING", ... for a HealthCheckResponse."""
    status = response.status  # type: ignore[attr-defined]
    return STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else str(status)

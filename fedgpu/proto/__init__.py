"""Generated gRPC code for the `fedgpu.v1` wire contract (see fedgpu/v1/*.proto)."""

from fedgpu.proto.fedgpu.v1 import admin_pb2, admin_pb2_grpc
from fedgpu.proto.fedgpu.v1 import federation_pb2 as pb
from fedgpu.proto.fedgpu.v1 import federation_pb2_grpc as pb_grpc

__all__ = ["admin_pb2", "admin_pb2_grpc", "pb", "pb_grpc"]

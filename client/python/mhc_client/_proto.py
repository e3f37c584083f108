"""The generated protobuf/gRPC modules (see client/python/build_stubs.py).

They are committed in ``mhc_client/_pb`` (so installing the package needs
no protoc) and checked against proto/ by a ctest test.
"""

from __future__ import annotations

try:
    from ._pb import checkpoint_pb2  # noqa: F401
    from ._pb import health_pb2, health_pb2_grpc  # noqa: F401
    from ._pb import group_pb2, layer_pb2, ops_pb2, optimizer_pb2  # noqa: F401
    from ._pb import service_pb2, service_pb2_grpc  # noqa: F401
    from ._pb import shm_pb2, tensor_pb2  # noqa: F401
except ImportError as error:  # pragma: no cover - a setup problem
    raise ImportError(
        f"mhc_client: the generated gRPC modules (mhc_client._pb) do not "
        f"import ({error}); is grpcio/protobuf installed? After a proto "
        f"change, regenerate them with `python3 client/python/build_stubs.py`"
    ) from error

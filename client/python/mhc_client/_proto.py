"""The generated protobuf/gRPC modules (see client/python/build_stubs.py).

They are generated at build time into ``mhc_client/_pb`` (next to the
sources, in a build directory on sys.path, or inside an installed wheel).
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
        "mhc_client: the generated gRPC modules (mhc_client._pb) are missing. "
        "Generate them with `python3 client/python/build_stubs.py` (or the "
        "CMake target mhc_python_stubs, output under BUILD_DIR/client/python, "
        "which then goes on PYTHONPATH next to client/python)."
    ) from error

"""mhc_client: Python client of mhcd, the mHC kernel server.

    from mhc_client import Client
    with Client("unix:/run/mhcd.sock") as client:
        client.create_layer("l0", hidden=256, seed=1)
        y, h_pre, h_post, h_res = client.pre("l0", x)

See docs/user-guide.md for the client, shared memory and the torch
layer (``mhc_client.torch``), docs/api.md for the RPCs.
"""

# The native extension (mhc_client/_native*.so) is built by CMake into
# BUILD_DIR/client/python/mhc_client; with that directory on sys.path after
# client/python, this package spans both. The sources come first, so their
# committed mhc_client._pb wins over a stale copy an older build left there.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)  # type: ignore[name-defined]

from . import errors, tensors  # noqa: E402
from .benchmark_calls import BenchmarkResult  # noqa: E402
from .client import (AggregateBackwardResult, Batch,  # noqa: E402
                     Client, Device, Gradients, HeadResult, PostBackwardResult,
                     PreResult, ProjectionResult, ScaleBackwardResult,
                     ScaleResult, ServerInfo, normalize_address)
from .training import CheckpointInfo, OptimizerStepResult  # noqa: E402
from .groups import CollectiveResult, GroupInfo  # noqa: E402
from .errors import (AlreadyExists, DeadlineExceeded, FailedPrecondition,  # noqa: E402
                     Internal, InvalidArgument, MhcError, NotFound,
                     PermissionDenied, ResourceExhausted, Unavailable)
from .ops import Ref  # noqa: E402
from .spec import PRESETS, LayerInfo, LayerSpec  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AggregateBackwardResult", "AlreadyExists", "Batch", "BenchmarkResult",
    "CheckpointInfo", "Client", "CollectiveResult", "DeadlineExceeded",
    "Device", "FailedPrecondition", "Gradients", "GroupInfo",
    "HeadResult", "Internal", "InvalidArgument", "LayerInfo", "LayerSpec",
    "MhcError", "NotFound", "OptimizerStepResult", "PRESETS",
    "PermissionDenied", "PostBackwardResult", "PreResult", "ProjectionResult", "Ref",
    "ResourceExhausted", "ScaleBackwardResult", "ScaleResult", "ServerInfo",
    "Unavailable", "errors", "normalize_address", "tensors",
]

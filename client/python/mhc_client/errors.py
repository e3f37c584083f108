"""Typed exceptions for the daemon's gRPC status codes.

Every RPC failure surfaces as a subclass of :class:`MhcError` carrying the
gRPC code and the daemon's message (which names the offending field), so
callers can ``except NotFound`` instead of inspecting ``grpc.RpcError``.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc


class MhcError(Exception):
    """A failed call to mhcd (or a client-side check with the same meaning).

    Attributes:
        code: the gRPC status code.
        message: the daemon's (or client's) explanation.
        rpc: the RPC that failed, e.g. ``"Pre"``, when known.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None,
                 rpc: Optional[str] = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.rpc = rpc
        prefix = f"{rpc}: " if rpc else ""
        super().__init__(f"{prefix}{self.code.name}: {message}")


class Cancelled(MhcError):
    code = grpc.StatusCode.CANCELLED


class InvalidArgument(MhcError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(MhcError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(MhcError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MhcError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(MhcError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(MhcError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(MhcError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(MhcError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(MhcError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(MhcError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(MhcError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(MhcError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(MhcError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(MhcError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[MhcError]] = {
    cls.code: cls
    for cls in (Cancelled, InvalidArgument, DeadlineExceeded, NotFound,
                AlreadyExists, PermissionDenied, ResourceExhausted,
                FailedPrecondition, Aborted, OutOfRange, Unimplemented,
                Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_for(code: grpc.StatusCode, message: str,
              rpc: Optional[str] = None) -> MhcError:
    """The exception class for `code` (MhcError itself for UNKNOWN)."""
    cls = _BY_CODE.get(code, MhcError)
    return cls(message, code=code, rpc=rpc)


def from_rpc_error(error: grpc.RpcError, rpc: Optional[str] = None) -> MhcError:
    """Converts a grpc.RpcError (a grpc.Call) to the typed exception."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "", rpc)

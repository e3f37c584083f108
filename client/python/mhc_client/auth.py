"""TLS and bearer tokens of a :class:`~mhc_client.Client` (see the daemon's
docs/security.md): the channel's credentials, and an interceptor that sends
``authorization: Bearer TOKEN`` with every call, sessions and health checks
included."""

from __future__ import annotations

import os
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import grpc

from . import errors

TOKEN_FILE_ENV = "MHC_TOKEN_FILE"


def read_token(path: str) -> str:
    """The token in `path`, without surrounding whitespace."""
    with open(path, "r", encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise errors.InvalidArgument(f"token file {path} is empty")
    return token


def resolve_token(token: Optional[str]) -> Optional[str]:
    """`token`, else the one in the file ``$MHC_TOKEN_FILE`` names."""
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    return read_token(path) if path else None


def channel(target: str, options: List[Tuple[str, Any]], *, tls: bool,
            root_certificates: Optional[bytes],
            private_key: Optional[bytes], certificate_chain: Optional[bytes],
            tls_server_name: Optional[str],
            token: Optional[str]) -> grpc.Channel:
    """A channel to `target` with TLS when asked and the token attached."""
    tls = tls or any(x is not None for x in (
        root_certificates, private_key, certificate_chain, tls_server_name))
    if (private_key is None) != (certificate_chain is None):
        raise errors.InvalidArgument(
            "private_key and certificate_chain: give both or neither")
    if tls and target.startswith("unix:"):
        raise errors.InvalidArgument(
            "tls: only for TCP addresses (unix sockets are local and use the "
            "peer's user instead)")
    if tls:
        if tls_server_name:
            options = options + [("grpc.ssl_target_name_override",
                                  tls_server_name)]
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root_certificates, private_key=private_key,
            certificate_chain=certificate_chain)
        result = grpc.secure_channel(target, credentials, options=options)
    else:
        result = grpc.insecure_channel(target, options=options)
    if token:
        result = grpc.intercept_channel(result, BearerToken(token))
    return result


class _CallDetails(NamedTuple):
    method: str
    timeout: Optional[float]
    metadata: Optional[Sequence[Tuple[str, str]]]
    credentials: Any
    wait_for_ready: Optional[bool]
    compression: Any


class BearerToken(grpc.UnaryUnaryClientInterceptor,
                  grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor,
                  grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer TOKEN`` to every call."""

    def __init__(self, token: str) -> None:
        if not token or any(c.isspace() for c in token):
            raise errors.InvalidArgument(
                "token: expected a non-empty token without whitespace")
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> _CallDetails:
        metadata = list(details.metadata or []) + [self._header]
        return _CallDetails(details.method, details.timeout, metadata,
                            details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any],
                               details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any],
                               details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any],
                                details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

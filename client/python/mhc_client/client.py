"""`Client`: a typed, numpy-first wrapper over the mhc.v1.Mhc service.

Every RPC raises a subclass of :class:`mhc_client.errors.MhcError` on failure.
Calls carry a deadline (``timeout``, per client or per call). Calls that
cannot change daemon state (reads, forward operators, backward operators
that add no parameter gradients) are retried on UNAVAILABLE with a short
backoff, since a transient connection failure then cannot double-apply
anything; everything else is tried exactly once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import (Any, Callable, Dict, Iterable, List, Mapping, NamedTuple,
                    Optional, Sequence, Tuple)

import grpc
import numpy as np

from . import auth, errors, tensors, transfer
from . import native as native_path
from ._proto import (health_pb2, health_pb2_grpc, layer_pb2, service_pb2,
                     service_pb2_grpc, tensor_pb2)
from .cuda_events import SIGNAL_EVENT_METADATA_KEY, WAIT_EVENT_METADATA_KEY
from .benchmark_calls import BenchmarkCalls
from .groups import GroupCalls
from .shm_calls import SharedMemoryCalls
from .training import TrainingCalls
from .ops import OpDef, Ref, op_def
from .spec import LayerInfo, LayerSpec, enum_value

SESSION_METADATA_KEY = "mhc-session-id"
_READ_ONLY_RPCS = frozenset({
    "GetServerInfo", "GetDeterminismReport", "GetLayer", "ListLayers",
    "GetParameters", "GetGradients", "SharedMemoryStatus", "ListCheckpoints",
    "Check", "GetGroup"})


def normalize_address(address: str) -> str:
    """``host:port``, ``[v6]:port``, ``unix:/path`` or any gRPC target."""
    if not address:
        raise errors.InvalidArgument("address: empty")
    if address.startswith("unix:"):
        if len(address) == len("unix:"):
            raise errors.InvalidArgument("address: unix: needs a path")
        return address
    if "://" in address or address.split(":", 1)[0] in ("dns", "ipv4", "ipv6"):
        return address
    host, _, port = address.rpartition(":")
    if not host or not port:
        raise errors.InvalidArgument(
            f"address: expected host:port or unix:/path, got '{address}'")
    return address


# ---------------------------------------------------------------- results


class PreResult(NamedTuple):
    y: np.ndarray
    h_pre: np.ndarray
    h_post: np.ndarray
    h_res: np.ndarray


class PostBackwardResult(NamedTuple):
    df: np.ndarray
    dx: Optional[np.ndarray]  # None with skip_dx
    dh_post: np.ndarray
    dh_res: np.ndarray


class HeadResult(NamedTuple):
    y: np.ndarray
    mix: np.ndarray


class ProjectionResult(NamedTuple):
    h: np.ndarray
    mean_square: np.ndarray


class ScaleResult(NamedTuple):
    h_pre: np.ndarray
    h_post: Optional[np.ndarray]
    logits: Optional[np.ndarray]


class ScaleBackwardResult(NamedTuple):
    dh: Optional[np.ndarray]
    dmean_square: Optional[np.ndarray]


class AggregateBackwardResult(NamedTuple):
    dx: np.ndarray
    dh_pre: np.ndarray


@dataclasses.dataclass
class Device:
    name: str
    backend: str
    description: str


@dataclasses.dataclass
class ServerInfo:
    version: str
    backend: str
    devices: List[Device]
    presets: List[str]
    dtypes: List[str]
    layouts: List[str]
    limits: Dict[str, int]
    draining: bool

    @property
    def has_cuda(self) -> bool:
        return any(d.name.startswith("cuda") for d in self.devices)


class Gradients(Dict[str, np.ndarray]):
    """Gradient arrays by parameter name, plus the tokens they sum over."""

    tokens: int = 0


class Batch:
    """An ordered list of operators for :meth:`Client.execute`.

    ``add(id, kind, layer=..., x=array, h_res=Ref("pre1.h_res"))``: tensor
    arguments are numpy arrays, region views, ``Ref`` names of earlier
    outputs, or TensorRef messages; scalars (skip_dx, ...) go as keywords.
    """

    def __init__(self, dtype: tensors.DTypeLike = None) -> None:
        self.dtype = dtype
        self._ops: List[Tuple[str, str, Dict[str, Any]]] = []

    def add(self, op_id: str, kind: str, **fields: Any) -> "Batch":
        op_def(kind)
        if kind.startswith("expand_combine"):
            raise errors.InvalidArgument(
                "Execute runs ExpandCombine as 'post' / 'post_backward'")
        self._ops.append((op_id, kind, fields))
        return self

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def ops(self) -> List[Tuple[str, str, Dict[str, Any]]]:
        return list(self._ops)


# ----------------------------------------------------------------- client


class Client(BenchmarkCalls, GroupCalls, SharedMemoryCalls, TrainingCalls):
    """A connection to one mhcd.

    Args:
        address: ``host:port`` or ``unix:/path/mhcd.sock``.
        timeout: default deadline of each call, in seconds.
        retries: attempts for calls that are safe to retry (see module doc).
        max_message_bytes: gRPC message limit both ways (the daemon's default).
        bf16: how bf16 outputs come back: ``"auto"`` (ml_dtypes.bfloat16 when
            installed, else uint16 bit patterns), ``"uint16"``, ``"ml_dtypes"``.
        native: whether :meth:`compute_in_place` (the torch layer's calls)
            goes through the C++ extension (see :mod:`mhc_client.native`):
            True forces it, False the pure-Python path; None lets the
            environment variable ``MHC_CLIENT_NATIVE`` decide (default
            auto: native for a local daemon when the extension is built).
        tls: connect with TLS (TCP addresses); implied by the next four.
        root_certificates: PEM of the CA that signed the daemon's
            certificate (None: the system's roots).
        private_key, certificate_chain: PEM of this client's key and
            certificate, for a daemon that requires client certificates.
        tls_server_name: the name the daemon's certificate must carry when it
            is not the address's host.
        token: bearer token sent with every call (None: the one in the file
            ``$MHC_TOKEN_FILE`` names, if set).
    """

    def __init__(self, address: str, *, timeout: float = 60.0,
                 retries: int = 3, max_message_bytes: int = 1 << 30,
                 bf16: str = "auto", native: Optional[bool] = None,
                 tls: bool = False, root_certificates: Optional[bytes] = None,
                 private_key: Optional[bytes] = None,
                 certificate_chain: Optional[bytes] = None,
                 tls_server_name: Optional[str] = None,
                 token: Optional[str] = None) -> None:
        self.address = address
        self.target = normalize_address(address)
        self.timeout = timeout
        self.retries = max(1, retries)
        self.bf16 = bf16
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        self._token = auth.resolve_token(token)
        self._channel = auth.channel(
            self.target, options, tls=tls, root_certificates=root_certificates,
            private_key=private_key, certificate_chain=certificate_chain,
            tls_server_name=tls_server_name, token=self._token)
        self._stub = service_pb2_grpc.MhcStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: Optional[Any] = None  # shm.Session while open
        self._closed = False
        self._max_message_bytes = max_message_bytes
        # The daemon's --max_message_bytes, asked once when first needed.
        self._daemon_message_limit: Optional[int] = None
        self._native_mode = native_path.mode(native)
        # The native connection; False once decided against, None undecided.
        self._native: Any = None
        if self._native_mode == "on":
            self._native = self._open_native()

    # ------------------------------------------------------------ plumbing

    @property
    def is_local(self) -> bool:
        """True for unix-socket targets: the daemon is on this node."""
        return self.target.startswith("unix:")

    @property
    def native(self) -> Optional[native_path.Connection]:
        """The native call path of :meth:`compute_in_place`, or None when
        this client takes the pure-Python one."""
        if self._native is None:
            self._native = self._open_native()
        return self._native or None

    def _open_native(self) -> Any:
        if self._native_mode == "off" or (
                self._native_mode == "auto"
                and (not self.is_local or native_path.load() is None)):
            return False
        return native_path.Connection(self.target, self._max_message_bytes,
                                      self._token or "")

    @property
    def session(self) -> Optional[Any]:
        """The open shared-memory session (:class:`mhc_client.shm.Session`)."""
        return self._session

    def close(self) -> None:
        """Ends the session (releasing its regions) and the channel."""
        if self._closed:
            return
        if self._session is not None:
            self._session.close()
        if self._native:
            self._native.close()
        self._channel.close()
        self._closed = True

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_for_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel connects; raises Unavailable otherwise."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(
                f"could not connect to {self.target} within {timeout:g}s"
            ) from None

    def _metadata(self, extra: Sequence[Tuple[str, str]] = ()
                  ) -> Optional[List[Tuple[str, str]]]:
        metadata = list(extra)
        if self._session is not None and self._session.id:
            metadata.append((SESSION_METADATA_KEY, self._session.id))
        return metadata or None

    def _call(self, rpc: str, request: Any, *, timeout: Optional[float] = None,
              retry: bool = False, stub: Any = None,
              metadata: Sequence[Tuple[str, str]] = (),
              consume: Optional[Callable[[Any], Any]] = None) -> Any:
        """Calls `rpc`; `metadata` goes out next to the session id (e.g. the
        stream-order events of :mod:`mhc_client.cuda_events`). `consume`
        reads a streamed answer (its errors count as the call's)."""
        method: Callable[..., Any] = getattr(stub or self._stub, rpc)
        attempts = self.retries if retry else 1
        delay = 0.05
        for attempt in range(attempts):
            try:
                answer = method(request,
                                timeout=self.timeout if timeout is None else timeout,
                                metadata=self._metadata(metadata))
                return consume(answer) if consume is not None else answer
            except grpc.RpcError as error:
                code = error.code() if hasattr(error, "code") else None
                if code == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 4
                    continue
                raise errors.from_rpc_error(error, rpc) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- server

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", ..."""
        response = self._call("Check",
                               health_pb2.HealthCheckRequest(service=service),
                               timeout=timeout, retry=True, stub=self._health)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def server_info(self) -> ServerInfo:
        r = self._call("GetServerInfo", service_pb2.GetServerInfoRequest(),
                       retry=True)
        limits = {f.name: getattr(r.limits, f.name)
                  for f in r.limits.DESCRIPTOR.fields}
        return ServerInfo(
            version=r.version, backend=r.backend,
            devices=[Device(d.name, d.backend, d.description) for d in r.devices],
            presets=list(r.presets),
            dtypes=[tensors.dtype_name(d) for d in r.dtypes if d],
            layouts=[layer_pb2.Layout.Name(v)[len("LAYOUT_"):].lower()
                     for v in r.layouts if v],
            limits=limits, draining=r.draining)

    def determinism_report(self) -> service_pb2.GetDeterminismReportResponse:
        """The daemon's determinism audit (the proto message, as is)."""
        return self._call("GetDeterminismReport",
                          service_pb2.GetDeterminismReportRequest(), retry=True)

    # ------------------------------------------------------------- layers

    def create_layer(self, name: str, hidden: Optional[int] = None, *,
                     n: Optional[int] = None, preset: str = "",
                     spec: Optional[LayerSpec] = None,
                     seed: Optional[int] = None,
                     parameters: Optional[Mapping[str, Any]] = None,
                     device: str = "", **overrides: Any) -> LayerInfo:
        """Creates a layer from a preset plus overrides.

        Either pass a full ``spec`` or ``hidden`` (C), ``n`` and any
        :class:`LayerSpec` field as a keyword (``sinkhorn_iterations=10``).
        Parameters come from ``seed`` (the initialisation of docs/SPEC.md
        section 5) or are given as float32 arrays by name (phi, alpha, beta,
        gamma, bias).
        """
        if spec is None:
            spec = LayerSpec(hidden=hidden or 0, n=n or 4)
        else:
            spec = dataclasses.replace(spec)
            if hidden is not None:
                spec.hidden = hidden
            if n is not None:
                spec.n = n
        for key, value in overrides.items():
            if not hasattr(spec, key):
                raise errors.InvalidArgument(f"create_layer: unknown field '{key}'")
            setattr(spec, key, value)
        request = layer_pb2.CreateLayerRequest(name=name, preset=preset,
                                               spec=spec.to_proto(),
                                               device=device)
        if parameters is not None and seed is not None:
            raise errors.InvalidArgument("create_layer: give seed or parameters")
        if parameters is not None:
            request.parameters.CopyFrom(_parameters_proto(parameters))
        elif seed is not None:
            request.seed = seed
        return LayerInfo.from_proto(self._call("CreateLayer", request))

    def get_layer(self, name: str) -> LayerInfo:
        return LayerInfo.from_proto(self._call(
            "GetLayer", layer_pb2.GetLayerRequest(name=name), retry=True))

    def list_layers(self) -> List[LayerInfo]:
        response = self._call("ListLayers", layer_pb2.ListLayersRequest(),
                              retry=True)
        return [LayerInfo.from_proto(info) for info in response.layers]

    def delete_layer(self, name: str) -> None:
        self._call("DeleteLayer", layer_pb2.DeleteLayerRequest(name=name))

    def get_parameters(self, layer: str,
                       names: Sequence[str] = ()) -> Dict[str, np.ndarray]:
        """The layer's fp32 parameters by name (all of them by default).

        A layer too large for one message (this client's or the daemon's
        ``max_message_bytes``) is read in pieces (``StreamParameters``).
        """
        request = layer_pb2.GetParametersRequest(layer=layer, names=list(names))
        if self._too_large_for_one_message(layer):
            request.max_chunk_bytes = self._max_chunk_bytes()
            return self._stream_tensors("StreamParameters", request)[0]
        response = self._call("GetParameters", request, retry=True)
        return {k: tensors.from_tensor_ref(v) for k, v in response.tensors.items()}

    def set_parameters(self, layer: str,
                       parameters: Mapping[str, Any]) -> LayerInfo:
        """Replaces any subset of the parameters (all applied or none).

        Values too large for one message (this client's or the daemon's
        ``max_message_bytes``) go in pieces (``SetParametersStream``),
        applied only once every piece arrived.
        """
        proto = _parameters_proto(parameters)
        if (proto.tensors and proto.ByteSize() + transfer.MESSAGE_HEADROOM
                > self._message_limit()):
            pieces = transfer.parameter_chunks(
                layer, proto, transfer.max_chunk_bytes(self._message_limit()))
            return LayerInfo.from_proto(
                self._call("SetParametersStream", pieces))
        request = layer_pb2.SetParametersRequest(layer=layer, parameters=proto)
        return LayerInfo.from_proto(self._call("SetParameters", request))

    def get_gradients(self, layer: str, names: Sequence[str] = ()) -> Gradients:
        """Accumulated parameter gradients; ``.tokens`` says over how many.

        Large layers are read in pieces, as in :meth:`get_parameters`.
        """
        request = layer_pb2.GetGradientsRequest(layer=layer, names=list(names))
        if self._too_large_for_one_message(layer):
            request.max_chunk_bytes = self._max_chunk_bytes()
            gradients, tokens = self._stream_tensors("StreamGradients", request)
            out = Gradients(gradients)
            out.tokens = tokens
            return out
        response = self._call("GetGradients", request, retry=True)
        out = Gradients({k: tensors.from_tensor_ref(v)
                         for k, v in response.gradients.tensors.items()})
        out.tokens = response.gradient_tokens
        return out

    def _message_limit(self) -> int:
        """The smaller of this client's and the daemon's message limits."""
        if self._daemon_message_limit is None:
            limit = self.server_info().limits.get("max_message_bytes", 0)
            self._daemon_message_limit = limit or self._max_message_bytes
        return min(self._max_message_bytes, self._daemon_message_limit)

    def _too_large_for_one_message(self, layer: str) -> bool:
        data = self.get_layer(layer).parameter_count * 4
        return data + transfer.MESSAGE_HEADROOM > self._message_limit()

    def _max_chunk_bytes(self) -> int:
        """The largest piece this client can receive."""
        return transfer.max_chunk_bytes(self._max_message_bytes)

    def _stream_tensors(self, rpc: str, request: Any
                        ) -> Tuple[Dict[str, np.ndarray], int]:
        """A StreamParameters/StreamGradients answer, put back together."""
        return self._call(rpc, request, retry=True, consume=transfer.assemble)

    def zero_gradients(self, layer: str) -> None:
        self._call("ZeroGradients", layer_pb2.ZeroGradientsRequest(layer=layer))

    def convert_layout(self, layer: str, layout: str) -> LayerInfo:
        """Switches the layer to ``"stream_major"`` / ``"stream_minor"``."""
        request = layer_pb2.ConvertLayoutRequest(
            layer=layer, layout=enum_value("layout", layout))
        return LayerInfo.from_proto(self._call("ConvertLayout", request))

    def map_layer_memory(self, layer: str) -> layer_pb2.LayerMemory:
        """The layer's parameters and gradients as one CUDA IPC allocation
        (the proto message: raw_handle, device_id, byte_size, parameters and
        gradients by name as TensorSlice, generation). Only for CUDA layers
        over a unix socket with --allow_shm; :class:`mhc_client.torch.MhcLayer`
        uses it to keep its parameters in place."""
        return self._call("MapLayerMemory",
                          layer_pb2.MapLayerMemoryRequest(layer=layer),
                          retry=True)

    # ------------------------------------------------------------ compute

    def _tensor_ref(self, value: Any,
                    dtype: tensors.DTypeLike) -> tensor_pb2.TensorRef:
        if isinstance(value, tensor_pb2.TensorRef):
            return value
        if isinstance(value, Ref):
            return value.to_proto()
        if self._session is not None and isinstance(value, np.ndarray):
            ref = self._session.tensor_ref(value, dtype)
            if ref is not None:
                return ref
        return tensors.to_tensor_ref(value, dtype)

    def build_request(self, kind: str, layer: str,
                      dtype: tensors.DTypeLike = None,
                      out: Optional[Mapping[str, Any]] = None,
                      **fields: Any) -> Any:
        """The request message of op `kind` (see :meth:`compute`)."""
        spec = op_def(kind)
        request = spec.request(layer=layer)
        act_dtype = dtype
        if act_dtype is None:
            for name in spec.activation_inputs:
                value = fields.get(name)
                if isinstance(value, np.ndarray):
                    act_dtype = tensors.encode(value)[0]
                    break
        for name, value in fields.items():
            if value is None:
                continue
            if name in spec.tensor_inputs:
                wire = act_dtype if name in spec.activation_inputs else tensors.F32
                getattr(request, name).CopyFrom(self._tensor_ref(value, wire))
            elif name == "lead_shape":
                request.lead_shape.extend(int(d) for d in value)
            elif name in spec.request.DESCRIPTOR.fields_by_name:
                setattr(request, name, value)
            else:
                raise errors.InvalidArgument(f"{kind}: unknown argument '{name}'")
        for name, target in (out or {}).items():
            if isinstance(target, tensor_pb2.SharedMemoryRef):
                shm_ref = target
            elif self._session is not None and isinstance(target, np.ndarray):
                shm_ref = self._session.shm_ref(target)
            else:
                shm_ref = None
            if shm_ref is None:
                raise errors.InvalidArgument(
                    f"{kind}: out['{name}'] must be a view of a registered "
                    "shared-memory region (or a SharedMemoryRef)")
            request.output_regions[name].CopyFrom(shm_ref)
        return request

    def decode(self, ref: tensor_pb2.TensorRef) -> np.ndarray:
        """A response tensor: inline bytes, or a view of our own region."""
        if ref.WhichOneof("data") == "shm":
            if self._session is None:
                raise errors.FailedPrecondition(
                    "output in shared memory but no session is open")
            return self._session.view_of(ref)
        return tensors.from_tensor_ref(ref, self.bf16)

    def compute(self, kind: str, layer: str, *, dtype: tensors.DTypeLike = None,
                out: Optional[Mapping[str, Any]] = None,
                timeout: Optional[float] = None,
                **fields: Any) -> Dict[str, np.ndarray]:
        """Runs one operator; returns its outputs by name.

        Args:
            kind: an op name (``pre``, ``post_backward``, ``sinkhorn``, ...).
            dtype: activation dtype on the wire; by default the dtype of the
                activation arrays (float32/float16, bfloat16 or uint16 bits).
                Float arrays given with ``dtype="bf16"`` are rounded.
            out: outputs to write in place into shared memory, by name.
            fields: the request's tensors (numpy arrays, region views) and
                flags (skip_dx, skip_parameter_gradients, lead_shape).
        """
        spec = op_def(kind)
        request = self.build_request(kind, layer, dtype, out, **fields)
        retry = not spec.mutates or bool(
            getattr(request, "skip_parameter_gradients", False))
        response = self._call(spec.rpc, request, timeout=timeout, retry=retry)
        return {f.name: self.decode(value)
                for f, value in response.ListFields()
                if isinstance(value, tensor_pb2.TensorRef)}

    def compute_in_place(self, spec: OpDef, layer: str,
                         tensors: Sequence[native_path.TensorPlace],
                         outputs: Sequence[native_path.OutputPlace],
                         flags: Mapping[str, Any], *, retry: bool,
                         wait_event: int = -1, signal_event: int = -1,
                         timeout: Optional[float] = None) -> bool:
        """Runs one operator whose tensors already lie in the session's
        regions (the torch layer's calls); returns whether it went by the
        native path (see :mod:`mhc_client.native`).

        `tensors`: ``(field, dtype code, shape, region, offset, byte_size)``
        each (region None: an empty tensor); `outputs`: ``(output, region,
        offset, byte_size)`` each, written there in place; `flags`: scalar
        fields such as ``skip_dx``; `wait_event` / `signal_event`: the
        stream-order event indices (-1: none). Raises INTERNAL when an
        output did not come back in place.
        """
        timeout = self.timeout if timeout is None else timeout
        attempts = self.retries if retry else 1
        connection = self.native
        if connection is not None:
            session = self._session
            connection.compute(
                spec.rpc, layer, tensors, outputs, tuple(flags.items()),
                session_id=session.id if session is not None else "",
                wait_event=wait_event, signal_event=signal_event,
                timeout=timeout, attempts=attempts)
            return True
        request = spec.request(layer=layer, **flags)
        for name, dtype, shape, region, offset, nbytes in tensors:
            ref = getattr(request, name)
            ref.dtype = dtype
            ref.shape.extend(shape)
            if region is None:  # an empty tensor: no bytes, no region
                ref.inline_data = b""
            else:
                ref.shm.region = region
                ref.shm.offset = offset
                ref.shm.byte_size = nbytes
        for name, region, offset, nbytes in outputs:
            place = request.output_regions[name]
            place.region = region
            place.offset = offset
            place.byte_size = nbytes
        metadata = []
        if wait_event >= 0:
            metadata.append((WAIT_EVENT_METADATA_KEY, str(wait_event)))
        if signal_event >= 0:
            metadata.append((SIGNAL_EVENT_METADATA_KEY, str(signal_event)))
        response = self._call(spec.rpc, request, timeout=timeout, retry=retry,
                              metadata=metadata)
        _check_in_place(spec.rpc, response, outputs)
        return False

    # Typed wrappers of the fused layer ops -------------------------------

    def pre(self, layer: str, x: Any, **kw: Any) -> PreResult:
        r = self.compute("pre", layer, x=x, **kw)
        return PreResult(r["y"], r["h_pre"], r["h_post"], r["h_res"])

    def pre_keeping_projection(self, layer: str, x: Any, **kw: Any
                               ) -> Tuple[PreResult, ProjectionResult]:
        """Pre of a dynamic layer plus its projection (N + 1 floats per
        token): pass it to ``pre_backward(projection=...)``, which then does
        not recompute it from x."""
        r = self.compute("pre", layer, x=x, keep_projection=True, **kw)
        return (PreResult(r["y"], r["h_pre"], r["h_post"], r["h_res"]),
                ProjectionResult(r["h"], r["mean_square"]))

    def pre_backward(self, layer: str, x: Any, dy: Any, dh_post: Any,
                     dh_res: Any, dx_next: Any = None,
                     skip_parameter_gradients: bool = False,
                     projection: Optional[ProjectionResult] = None,
                     **kw: Any) -> np.ndarray:
        if projection is not None:
            kw.update(h=projection.h, mean_square=projection.mean_square)
        return self.compute("pre_backward", layer, x=x, dy=dy, dh_post=dh_post,
                            dh_res=dh_res, dx_next=dx_next,
                            skip_parameter_gradients=skip_parameter_gradients,
                            **kw)["dx"]

    def post(self, layer: str, f: Any, x: Any, h_post: Any, h_res: Any,
             **kw: Any) -> np.ndarray:
        return self.compute("post", layer, f=f, x=x, h_post=h_post,
                            h_res=h_res, **kw)["x_next"]

    def post_backward(self, layer: str, dx_next: Any, f: Any, x: Any,
                      h_post: Any, h_res: Any, skip_dx: bool = False,
                      skip_parameter_gradients: bool = False,
                      **kw: Any) -> PostBackwardResult:
        r = self.compute("post_backward", layer, dx_next=dx_next, f=f, x=x,
                         h_post=h_post, h_res=h_res, skip_dx=skip_dx,
                         skip_parameter_gradients=skip_parameter_gradients,
                         **kw)
        return PostBackwardResult(r["df"], r.get("dx"), r["dh_post"],
                                  r["dh_res"])

    def expand(self, layer: str, e: Any, **kw: Any) -> np.ndarray:
        return self.compute("expand", layer, e=e, **kw)["x"]

    def expand_backward(self, layer: str, dx: Any, **kw: Any) -> np.ndarray:
        return self.compute("expand_backward", layer, dx=dx, **kw)["de"]

    def head(self, layer: str, x: Any, **kw: Any) -> HeadResult:
        r = self.compute("head", layer, x=x, **kw)
        return HeadResult(r["y"], r["mix"])

    def head_backward(self, layer: str, x: Any, dy: Any,
                      skip_parameter_gradients: bool = False,
                      **kw: Any) -> np.ndarray:
        return self.compute("head_backward", layer, x=x, dy=dy,
                            skip_parameter_gradients=skip_parameter_gradients,
                            **kw)["dx"]

    # Typed wrappers of the single kernels --------------------------------

    def projection(self, layer: str, x: Any, **kw: Any) -> ProjectionResult:
        r = self.compute("projection", layer, x=x, **kw)
        return ProjectionResult(r["h"], r["mean_square"])

    def projection_backward(self, layer: str, x: Any, dh: Any,
                            dmean_square: Any,
                            skip_parameter_gradients: bool = False,
                            **kw: Any) -> np.ndarray:
        return self.compute("projection_backward", layer, x=x, dh=dh,
                            dmean_square=dmean_square,
                            skip_parameter_gradients=skip_parameter_gradients,
                            **kw)["dx"]

    def scale(self, layer: str, h: Any = None, mean_square: Any = None,
              lead_shape: Optional[Sequence[int]] = None,
              **kw: Any) -> ScaleResult:
        r = self.compute("scale", layer, h=h, mean_square=mean_square,
                         lead_shape=lead_shape, **kw)
        return ScaleResult(r["h_pre"], r.get("h_post"), r.get("logits"))

    def scale_backward(self, layer: str, dh_pre: Any, dh_post: Any = None,
                       dlogits: Any = None, h: Any = None,
                       mean_square: Any = None,
                       skip_parameter_gradients: bool = False,
                       **kw: Any) -> ScaleBackwardResult:
        r = self.compute("scale_backward", layer, h=h, mean_square=mean_square,
                         dh_pre=dh_pre, dh_post=dh_post, dlogits=dlogits,
                         skip_parameter_gradients=skip_parameter_gradients,
                         **kw)
        return ScaleBackwardResult(r.get("dh"), r.get("dmean_square"))

    def sinkhorn(self, layer: str, logits: Any, **kw: Any) -> np.ndarray:
        return self.compute("sinkhorn", layer, logits=logits, **kw)["h_res"]

    def sinkhorn_backward(self, layer: str, logits: Any, dh_res: Any,
                          **kw: Any) -> np.ndarray:
        return self.compute("sinkhorn_backward", layer, logits=logits,
                            dh_res=dh_res, **kw)["dlogits"]

    def aggregate(self, layer: str, x: Any, h_pre: Any, **kw: Any) -> np.ndarray:
        return self.compute("aggregate", layer, x=x, h_pre=h_pre, **kw)["y"]

    def aggregate_backward(self, layer: str, x: Any, h_pre: Any, dy: Any,
                           **kw: Any) -> AggregateBackwardResult:
        r = self.compute("aggregate_backward", layer, x=x, h_pre=h_pre, dy=dy,
                         **kw)
        return AggregateBackwardResult(r["dx"], r["dh_pre"])

    def expand_combine(self, layer: str, f: Any, x: Any, h_post: Any,
                       h_res: Any, **kw: Any) -> np.ndarray:
        return self.compute("expand_combine", layer, f=f, x=x, h_post=h_post,
                            h_res=h_res, **kw)["x_next"]

    def expand_combine_backward(self, layer: str, dx_next: Any, f: Any, x: Any,
                                h_post: Any, h_res: Any, **kw: Any
                                ) -> PostBackwardResult:
        r = self.compute("expand_combine_backward", layer, dx_next=dx_next,
                         f=f, x=x, h_post=h_post, h_res=h_res, **kw)
        return PostBackwardResult(r["df"], r.get("dx"), r["dh_post"],
                                  r["dh_res"])

    # ------------------------------------------------------------ batches

    def _execute_request(self, batch: Batch,
                         fetch: Sequence[str]) -> service_pb2.ExecuteRequest:
        request = service_pb2.ExecuteRequest(fetch=list(fetch))
        for op_id, kind, fields in batch.ops:
            fields = dict(fields)
            layer = fields.pop("layer", "")
            out = fields.pop("out", None)
            op = request.ops.add(id=op_id)
            getattr(op, kind).CopyFrom(
                self.build_request(kind, layer, batch.dtype, out, **fields))
        return request

    def execute(self, batch: Batch, fetch: Sequence[str] = (),
                timeout: Optional[float] = None) -> Dict[str, np.ndarray]:
        """Runs the batch's ops in order on one device, in one call.

        Returns the fetched outputs (all outputs when `fetch` is empty) by
        ``"<op id>.<output>"``. Never retried: a batch may add gradients.
        """
        response = self._call("Execute", self._execute_request(batch, fetch),
                              timeout=timeout)
        return {name: self.decode(ref) for name, ref in response.outputs.items()}

    def execute_stream(self, batches: Iterable[Batch],
                       fetch: Sequence[str] = (),
                       timeout: Optional[float] = None
                       ) -> List[Dict[str, np.ndarray]]:
        """Sends every batch on one ExecuteStream; answers come in order."""
        requests = [self._execute_request(b, fetch) for b in batches]
        try:
            responses = list(self._stub.ExecuteStream(
                iter(requests),
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata()))
        except grpc.RpcError as error:
            raise errors.from_rpc_error(error, "ExecuteStream") from None
        return [{name: self.decode(ref) for name, ref in r.outputs.items()}
                for r in responses]


def _check_in_place(rpc: str, response: Any,
                    outputs: Sequence[native_path.OutputPlace]) -> None:
    """INTERNAL unless every output placed in a region came back there."""
    fields = response.DESCRIPTOR.fields_by_name
    for name, region, offset, _ in outputs:
        ref = getattr(response, name) if name in fields else None
        if ref is None or not response.HasField(name) or \
                ref.WhichOneof("data") != "shm" or \
                ref.shm.region != region or ref.shm.offset != offset:
            raise errors.Internal(
                f"output '{name}' did not come back in place (region "
                f"'{region}' at offset {offset})", rpc=rpc)


def _parameters_proto(parameters: Mapping[str, Any]) -> tensor_pb2.Parameters:
    proto = tensor_pb2.Parameters()
    for name, value in parameters.items():
        proto.tensors[name].CopyFrom(
            tensors.to_tensor_ref(np.asarray(value, dtype=np.float32)))
    return proto

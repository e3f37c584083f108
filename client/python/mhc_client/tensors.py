"""numpy <-> TensorRef conversion, including bfloat16.

numpy has no bfloat16. A bf16 tensor is carried either as a ``uint16`` array
of bit patterns (always available) or, when the ``ml_dtypes`` package is
installed, as an ``ml_dtypes.bfloat16`` array; both have the same bytes, so
conversion is a view. Rounding float32 to bf16 is round-to-nearest-even,
like the daemon and the C++ client, so the client and the daemon agree on
every bit of a rounded input.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from . import errors
from ._proto import tensor_pb2

try:  # Optional: a real bfloat16 numpy dtype.
    import ml_dtypes as _ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    BFLOAT16 = None

DTypeLike = Union[str, int, np.dtype, type, None]

F32 = tensor_pb2.DTYPE_F32
F16 = tensor_pb2.DTYPE_F16
BF16 = tensor_pb2.DTYPE_BF16

_NAMES = {
    "f32": F32, "fp32": F32, "float32": F32, "float": F32,
    "f16": F16, "fp16": F16, "float16": F16, "half": F16,
    "bf16": BF16, "bfloat16": BF16,
}
_ITEMSIZE = {F32: 4, F16: 2, BF16: 2}
_BF16_MODES = ("auto", "uint16", "ml_dtypes")


def dtype_code(dtype: DTypeLike) -> int:
    """The proto DType of a name ("bf16", "fp32", ...), numpy dtype or code."""
    if isinstance(dtype, int) and dtype in _ITEMSIZE:
        return dtype
    if isinstance(dtype, str):
        code = _NAMES.get(dtype.lower())
        if code is None:
            raise errors.InvalidArgument(
                f"dtype: expected one of f32, f16, bf16, got '{dtype}'")
        return code
    if dtype is not None:
        np_dtype = np.dtype(dtype)
        if BFLOAT16 is not None and np_dtype == BFLOAT16:
            return BF16
        if np_dtype == np.float16:
            return F16
        if np_dtype == np.float32:
            return F32
    raise errors.InvalidArgument(f"dtype: cannot map {dtype!r} to an mhcd dtype")


def dtype_name(code: int) -> str:
    return {F32: "f32", F16: "f16", BF16: "bf16"}[code]


def itemsize(code: int) -> int:
    return _ITEMSIZE[code]


def bf16_from_float32(values: Any) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even.

    NaNs stay NaN (quiet), infinities stay infinite.
    """
    f = np.ascontiguousarray(values, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_to_float32(bits: Any) -> np.ndarray:
    """bf16 bit patterns (uint16, or ml_dtypes.bfloat16) -> float32, exact."""
    b = np.ascontiguousarray(bits)
    if b.dtype != np.uint16:
        b = b.view(np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_to(values: Any, dtype: DTypeLike) -> np.ndarray:
    """float32 values rounded to `dtype` and widened back to float32.

    What the daemon sees for an activation sent in `dtype`, handy for
    building references.
    """
    code = dtype_code(dtype)
    f = np.asarray(values, dtype=np.float32)
    if code == BF16:
        return bf16_to_float32(bf16_from_float32(f)).reshape(f.shape)
    if code == F16:
        return f.astype(np.float16).astype(np.float32)
    return f.copy()


def to_float32(array: Any) -> np.ndarray:
    """Any array this module returns -> float32 (uint16 is read as bf16)."""
    a = np.asarray(array)
    if a.dtype == np.uint16 or (BFLOAT16 is not None and a.dtype == BFLOAT16):
        return bf16_to_float32(a).reshape(a.shape)
    return a.astype(np.float32)


def encode(array: Any, dtype: DTypeLike = None) -> Tuple[int, np.ndarray]:
    """(dtype code, contiguous array with exactly the wire bytes).

    With `dtype` None the array's own dtype decides: float32, float16,
    ml_dtypes.bfloat16, or uint16 (bf16 bit patterns); float64 and integer
    values are taken as float32. With `dtype` given, values are converted
    (rounded) to it; a uint16 array given for "bf16" is taken as bits.
    """
    a = np.asarray(array)
    if dtype is None:
        if a.dtype == np.uint16:
            code = BF16
        elif (a.dtype == np.float16 or a.dtype == np.float32 or
              (BFLOAT16 is not None and a.dtype == BFLOAT16)):
            code = dtype_code(a.dtype)
        else:
            code = F32
    else:
        code = dtype_code(dtype)
    if code == F32:
        wire = np.ascontiguousarray(a, dtype="<f4")
    elif code == F16:
        wire = np.ascontiguousarray(a, dtype="<f2")
    elif a.dtype == np.uint16:
        wire = np.ascontiguousarray(a)
    elif BFLOAT16 is not None and a.dtype == BFLOAT16:
        wire = np.ascontiguousarray(a).view(np.uint16)
    else:
        wire = bf16_from_float32(a).reshape(a.shape)
    return code, wire


def to_tensor_ref(array: Any, dtype: DTypeLike = None) -> tensor_pb2.TensorRef:
    """An inline TensorRef holding `array` (see :func:`encode` for dtypes)."""
    code, wire = encode(array, dtype)
    return tensor_pb2.TensorRef(dtype=code, shape=list(wire.shape),
                                inline_data=wire.tobytes())


def shm_tensor_ref(dtype: DTypeLike, shape: Sequence[int], region: str,
                   offset: int) -> tensor_pb2.TensorRef:
    """A TensorRef whose bytes lie in a registered shared-memory region."""
    code = dtype_code(dtype)
    elements = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    return tensor_pb2.TensorRef(
        dtype=code, shape=list(shape),
        shm=tensor_pb2.SharedMemoryRef(region=region, offset=offset,
                                       byte_size=elements * itemsize(code)))


def decode_bytes(code: int, shape: Sequence[int], data: Union[bytes, memoryview],
                 bf16: str = "auto") -> np.ndarray:
    """Wire bytes -> numpy array (a copy that the caller owns)."""
    if bf16 not in _BF16_MODES:
        raise errors.InvalidArgument(f"bf16: expected one of {_BF16_MODES}")
    if code == F32:
        np_dtype: np.dtype = np.dtype("<f4")
    elif code == F16:
        np_dtype = np.dtype("<f2")
    elif code == BF16:
        if bf16 == "ml_dtypes" and BFLOAT16 is None:
            raise errors.FailedPrecondition("bf16='ml_dtypes' needs ml_dtypes")
        np_dtype = np.dtype(np.uint16)
    else:
        raise errors.Internal(f"tensor with unknown dtype {code}")
    expected = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if len(data) != expected:
        raise errors.Internal(
            f"tensor bytes: expected {expected} for shape {list(shape)}, "
            f"got {len(data)}")
    out = np.frombuffer(data, dtype=np_dtype).reshape(tuple(shape)).copy()
    if code == BF16 and bf16 != "uint16" and BFLOAT16 is not None:
        out = out.view(BFLOAT16)
    return out


def from_tensor_ref(ref: tensor_pb2.TensorRef, bf16: str = "auto") -> np.ndarray:
    """An inline TensorRef -> numpy array (bf16: see the module docstring)."""
    if ref.WhichOneof("data") not in (None, "inline_data"):
        raise errors.InvalidArgument(
            "from_tensor_ref: the tensor is not inline (it names a "
            "shared-memory region or a batch output); read it from there")
    return decode_bytes(ref.dtype, list(ref.shape), ref.inline_data, bf16)

"""Layers larger than one gRPC message: the pieces (``TensorChunk``) of
``StreamParameters`` / ``StreamGradients`` put back together, and new
values cut into the pieces (``ParameterChunk``) of ``SetParametersStream``.

Both directions send tensor after tensor, each as pieces in order of their
byte offset; every piece names its tensor and its whole shape.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, Tuple

import numpy as np

from . import errors
from ._proto import layer_pb2, tensor_pb2

# Bytes a message carries besides the tensors' data (names, shapes,
# framing); a layer whose data comes within this of the message limit is
# read in pieces.
MESSAGE_HEADROOM = 64 << 10


def max_chunk_bytes(max_message_bytes: int) -> int:
    """The largest piece a client with this message limit can receive."""
    if max_message_bytes > 2 * MESSAGE_HEADROOM:
        return max_message_bytes - MESSAGE_HEADROOM
    return max(max_message_bytes // 2, 4)


def assemble(chunks: Iterable[layer_pb2.TensorChunk]
             ) -> Tuple[Dict[str, np.ndarray], int]:
    """The tensors by name (fp32 arrays) and the gradient token count."""
    buffers: Dict[str, bytearray] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    tokens = 0
    for chunk in chunks:
        data = buffers.get(chunk.name)
        if data is None:
            shapes[chunk.name] = tuple(chunk.shape)
            data = buffers[chunk.name] = bytearray()
        if chunk.offset != len(data):
            raise errors.DataLoss(
                f"tensor '{chunk.name}': piece at byte {chunk.offset} does "
                f"not continue the {len(data)} bytes received")
        data += chunk.data
        tokens = chunk.gradient_tokens
    out: Dict[str, np.ndarray] = {}
    for name, data in buffers.items():
        shape = shapes[name]
        expected = int(np.prod(shape, dtype=np.int64)) * 4
        if len(data) != expected:
            raise errors.DataLoss(
                f"tensor '{name}': the stream ended after {len(data)} of its "
                f"{expected} bytes")
        out[name] = np.frombuffer(data, dtype="<f4").astype(
            np.float32, copy=False).reshape(shape)
    return out, tokens


def parameter_chunks(layer: str, parameters: tensor_pb2.Parameters,
                     chunk_bytes: int) -> Iterator[layer_pb2.ParameterChunk]:
    """The pieces of ``SetParametersStream`` for `parameters` (inline fp32
    tensors): sorted by name, at most `chunk_bytes` data bytes each, the
    layer named in the first."""
    first = True
    for name in sorted(parameters.tensors):
        tensor = parameters.tensors[name]
        data = memoryview(tensor.inline_data)
        offset = 0
        while True:
            size = min(chunk_bytes, len(data) - offset)
            yield layer_pb2.ParameterChunk(
                layer=layer if first else "", name=name,
                shape=list(tensor.shape), dtype=tensor.dtype, offset=offset,
                data=bytes(data[offset:offset + size]))
            first = False
            offset += size
            if offset >= len(data):
                break

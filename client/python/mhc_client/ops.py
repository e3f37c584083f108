"""The compute operators' request/response shapes, from the daemon's op table.

One table drives direct calls (``Client.pre``...) and ``Execute`` batches:
the request message of each op, its tensor slots in the daemon's order, and
which of them are activations (dtype of the request: bf16/fp16/fp32) versus
fp32 mixing values, so the client converts each argument to the right wire
dtype. ``_daemon_tables`` is generated from the daemon's sources.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple, Type

from google.protobuf.message import Message

from . import _daemon_tables
from ._proto import ops_pb2, tensor_pb2


class OpDef(NamedTuple):
    kind: str            # Op oneof field, e.g. "post_backward"
    rpc: str             # Mhc method, e.g. "PostBackward"
    request: Type[Message]
    response: Type[Message]
    tensor_inputs: List[str]   # in the daemon's slot order
    outputs: List[str]
    # Backward ops that add parameter gradients must not be retried.
    mutates: bool
    # Inputs sent in the request's activation dtype (the others are fp32),
    # in slot order.
    activation_inputs: Tuple[str, ...]


def _build() -> Dict[str, OpDef]:
    table: Dict[str, OpDef] = {}
    for kind, entry in _daemon_tables.OPS.items():
        table[kind] = OpDef(
            kind, entry["rpc"], getattr(ops_pb2, entry["request"]),
            getattr(ops_pb2, entry["response"]),
            [name for name, _ in entry["inputs"]],
            [name for name, _ in entry["outputs"]], entry["accumulates"],
            tuple(name for name, dtype in entry["inputs"]
                  if dtype == "activation"))
    # ExpandCombine is Post under another name (not an Op kind of its own).
    post, post_bwd = table["post"], table["post_backward"]
    table["expand_combine"] = post._replace(kind="expand_combine",
                                            rpc="ExpandCombine")
    table["expand_combine_backward"] = post_bwd._replace(
        kind="expand_combine_backward", rpc="ExpandCombineBackward")
    return table


OPS: Dict[str, OpDef] = _build()


def op_def(kind: str) -> OpDef:
    try:
        return OPS[kind]
    except KeyError:
        from . import errors
        raise errors.InvalidArgument(
            f"op: expected one of {sorted(OPS)}, got '{kind}'") from None


class Ref(str):
    """An earlier output of the same Execute batch, ``"<op id>.<output>"``."""

    def to_proto(self) -> tensor_pb2.TensorRef:
        return tensor_pb2.TensorRef(ref=str(self))


def outputs_of(kind: str) -> Optional[List[str]]:
    return OPS[kind].outputs if kind in OPS else None

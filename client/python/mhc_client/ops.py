"""The compute operators' request/response shapes, read from the protos.

One table drives direct calls (``Client.pre``...) and ``Execute`` batches:
the request message of each op and which of its tensor fields are
activations (dtype of the request: bf16/fp16/fp32) versus fp32 mixing
values, so the client converts each argument to the right wire dtype.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Type

from google.protobuf.message import Message

from ._proto import ops_pb2, service_pb2, tensor_pb2

# Activation-shaped tensors; every other tensor field is fp32.
ACTIVATION_FIELDS = frozenset(
    {"x", "y", "f", "e", "dx", "dy", "df", "de", "dx_next", "x_next"})


class OpDef(NamedTuple):
    kind: str            # Op oneof field, e.g. "post_backward"
    rpc: str             # Mhc method, e.g. "PostBackward"
    request: Type[Message]
    response: Type[Message]
    tensor_inputs: List[str]
    outputs: List[str]
    # Backward ops that add parameter gradients must not be retried.
    mutates: bool


def _build() -> Dict[str, OpDef]:
    service = service_pb2.DESCRIPTOR.services_by_name["Mhc"]
    by_input: Dict[str, List[str]] = {}
    for method in service.methods:
        by_input.setdefault(method.input_type.name, []).append(method.name)
    table: Dict[str, OpDef] = {}
    for field in service_pb2.Op.DESCRIPTOR.oneofs_by_name["op"].fields:
        request_desc = field.message_type
        # PostRequest serves both Post and ExpandCombine: Op.post is Post.
        rpc = "".join(part.capitalize() for part in field.name.split("_"))
        method = service.methods_by_name[rpc]
        request = getattr(ops_pb2, request_desc.name)
        response = getattr(ops_pb2, method.output_type.name)
        inputs = [f.name for f in request_desc.fields
                  if f.message_type is not None
                  and f.message_type.name == "TensorRef"]
        outputs = [f.name for f in method.output_type.fields]
        mutates = "skip_parameter_gradients" in request_desc.fields_by_name
        table[field.name] = OpDef(field.name, rpc, request, response, inputs,
                                  outputs, mutates)
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

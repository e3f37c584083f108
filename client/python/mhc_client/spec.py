"""Layer specs and layer info as plain Python values.

Enum fields are lowercase strings (``"stream_major"``, ``"linear"``, ...)
so that user code does not depend on the generated proto modules. In
:meth:`Client.create_layer` every field left ``None`` keeps the preset's
value, exactly as the proto's override semantics say.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from . import errors
from ._daemon_tables import PRESET_SPECS, PRESETS
from ._proto import layer_pb2

# enum field -> (proto prefix, {python name: proto value})
_ENUMS: Dict[str, Dict[str, int]] = {
    "kind": {"mhc": layer_pb2.LAYER_KIND_MHC, "head": layer_pb2.LAYER_KIND_HEAD},
    "layout": {"stream_major": layer_pb2.LAYOUT_STREAM_MAJOR,
               "stream_minor": layer_pb2.LAYOUT_STREAM_MINOR},
    "orientation": {"source_rows": layer_pb2.ORIENTATION_SOURCE_ROWS,
                    "dest_rows": layer_pb2.ORIENTATION_DEST_ROWS},
    "sinkhorn_mode": {"linear": layer_pb2.SINKHORN_MODE_LINEAR,
                      "log": layer_pb2.SINKHORN_MODE_LOG},
    "eps_placement": {"inside": layer_pb2.EPS_PLACEMENT_INSIDE,
                      "outside": layer_pb2.EPS_PLACEMENT_OUTSIDE},
    "matmul_precision": {"ieee": layer_pb2.MATMUL_PRECISION_IEEE,
                         "tf32": layer_pb2.MATMUL_PRECISION_TF32},
}
_OPTIONAL = ("sinkhorn_iterations", "eps_sk", "eps_rms", "eps_pre",
             "post_mult", "dynamic")


def enum_value(field: str, name: str) -> int:
    """The proto value of enum `field`'s member `name` (case-insensitive)."""
    table = _ENUMS[field]
    value = table.get(name.lower())
    if value is None:
        raise errors.InvalidArgument(
            f"{field}: expected one of {sorted(table)}, got '{name}'")
    return value


def enum_name(field: str, value: int) -> Optional[str]:
    for name, v in _ENUMS[field].items():
        if v == value:
            return name
    return None


@dataclasses.dataclass
class LayerSpec:
    """The semantics of a layer (docs/SPEC.md section 1, layer.proto LayerSpec).

    ``hidden`` (C) is required when creating a layer; ``n`` defaults to 4.
    """

    hidden: int = 0
    n: int = 4
    kind: Optional[str] = None            # "mhc" | "head"
    layout: Optional[str] = None          # "stream_major" | "stream_minor"
    orientation: Optional[str] = None     # "source_rows" | "dest_rows"
    sinkhorn_mode: Optional[str] = None   # "linear" | "log"
    sinkhorn_iterations: Optional[int] = None
    eps_sk: Optional[float] = None
    eps_rms: Optional[float] = None
    eps_placement: Optional[str] = None   # "inside" | "outside"
    eps_pre: Optional[float] = None
    post_mult: Optional[float] = None
    dynamic: Optional[bool] = None
    has_gamma: bool = False
    has_post_bias: bool = False
    matmul_precision: Optional[str] = None  # "ieee" | "tf32"

    def to_proto(self) -> layer_pb2.LayerSpec:
        proto = layer_pb2.LayerSpec(n=self.n, hidden=self.hidden,
                                    has_gamma=self.has_gamma,
                                    has_post_bias=self.has_post_bias)
        for field in _ENUMS:
            value = getattr(self, field)
            if value is not None:
                setattr(proto, field, enum_value(field, value))
        for field in _OPTIONAL:
            value = getattr(self, field)
            if value is not None:
                setattr(proto, field, value)
        return proto

    @classmethod
    def from_proto(cls, proto: layer_pb2.LayerSpec) -> "LayerSpec":
        spec = cls(hidden=proto.hidden, n=proto.n or 4,
                   has_gamma=proto.has_gamma,
                   has_post_bias=proto.has_post_bias)
        for field in _ENUMS:
            setattr(spec, field, enum_name(field, getattr(proto, field)))
        for field in _OPTIONAL:
            if proto.HasField(field):
                setattr(spec, field, getattr(proto, field))
        return spec

    def resolved(self, preset: str = PRESETS[0]) -> "LayerSpec":
        """This spec with every field left None taken from `preset`, as the
        daemon resolves a CreateLayer request (itself when none is)."""
        open_fields = {name: value for name, value in PRESET_SPECS[preset].items()
                       if getattr(self, name) is None}
        return dataclasses.replace(self, **open_fields) if open_fields else self

    @property
    def streams(self) -> int:
        return self.n

    @property
    def logits(self) -> int:
        """N = 2n + n*n rows of phi (HEAD layers: n)."""
        return self.n if self.kind == "head" else 2 * self.n + self.n * self.n

    @property
    def width(self) -> int:
        """K = n*C."""
        return self.n * self.hidden


@dataclasses.dataclass
class LayerInfo:
    """A layer as the daemon reports it (GetLayer, CreateLayer, ...)."""

    name: str
    preset: str
    spec: LayerSpec
    device: str
    parameter_count: int
    gradient_tokens: int
    parameters_version: int
    # The daemon's optimizer state: "sgd" / "adamw" ("" before the first
    # OptimizerStep) and the steps taken.
    optimizer_algorithm: str = ""
    optimizer_step: int = 0

    @classmethod
    def from_proto(cls, proto: layer_pb2.LayerInfo) -> "LayerInfo":
        return cls(name=proto.name, preset=proto.preset,
                   spec=LayerSpec.from_proto(proto.spec), device=proto.device,
                   parameter_count=proto.parameter_count,
                   gradient_tokens=proto.gradient_tokens,
                   parameters_version=proto.parameters_version,
                   optimizer_algorithm=proto.optimizer.algorithm,
                   optimizer_step=proto.optimizer.step)

"""Training state: the :class:`Client` methods for the daemon's optimizer
and checkpoints (see docs/api.md and docs/checkpoints.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

from ._proto import checkpoint_pb2, optimizer_pb2
from .spec import LayerInfo


class OptimizerStepResult(NamedTuple):
    """What one :meth:`Client.optimizer_step` did."""

    grad_norm: float  # before clipping; 0 unless clipping or asked for
    clip_coefficient: float  # the gradients' scale (1 without clipping)
    layers: List[LayerInfo]  # after the step, in request order


@dataclasses.dataclass
class CheckpointInfo:
    """A checkpoint file in the daemon's --state_dir."""

    name: str
    bytes: int
    modified_unix_nanos: int


class TrainingCalls:
    """Mixed into :class:`mhc_client.Client` (which provides ``_call``)."""

    def optimizer_step(self, layers: Any, *, learning_rate: float,
                       algorithm: str = "adamw", momentum: float = 0.0,
                       nesterov: bool = False,
                       weight_decay: Optional[float] = None,
                       betas: Optional[Tuple[float, float]] = None,
                       eps: Optional[float] = None,
                       max_grad_norm: float = 0.0,
                       compute_grad_norm: bool = False,
                       zero_gradients: bool = False,
                       reset_state: bool = False,
                       metadata: Sequence[Tuple[str, str]] = ()
                       ) -> OptimizerStepResult:
        """One optimizer step of the daemon over `layers` (a name or a list
        of names, all on one device), from their gradient accumulators.

        ``algorithm``: ``"sgd"`` (``momentum``, ``nesterov``, L2
        ``weight_decay``, default 0) or ``"adamw"`` (``betas``, ``eps``,
        decoupled ``weight_decay``, daemon defaults 0.9, 0.999, 1e-8, 0.01).
        ``max_grad_norm`` > 0 clips by the global L2 norm of all the layers'
        gradients. Each layer keeps its optimizer state in the daemon; a
        layer whose state belongs to the other algorithm is refused
        (FailedPrecondition) unless ``reset_state``. Never retried: a step
        changes the parameters.
        """
        names = [layers] if isinstance(layers, str) else list(layers)
        request = optimizer_pb2.OptimizerStepRequest(
            layers=names, learning_rate=learning_rate,
            max_grad_norm=max_grad_norm, compute_grad_norm=compute_grad_norm,
            zero_gradients=zero_gradients, reset_state=reset_state)
        if algorithm == "sgd":
            if betas is not None or eps is not None:
                raise ValueError("optimizer_step: betas and eps are adamw's")
            request.sgd.momentum = momentum
            request.sgd.nesterov = nesterov
            request.sgd.weight_decay = weight_decay or 0.0
        elif algorithm == "adamw":
            if momentum or nesterov:
                raise ValueError("optimizer_step: momentum and nesterov are "
                                 "sgd's")
            request.adamw.SetInParent()
            if betas is not None:
                request.adamw.beta1, request.adamw.beta2 = betas
            if eps is not None:
                request.adamw.epsilon = eps
            if weight_decay is not None:
                request.adamw.weight_decay = weight_decay
        else:
            raise ValueError(f"optimizer_step: algorithm must be 'sgd' or "
                             f"'adamw', got {algorithm!r}")
        response = self._call("OptimizerStep", request, metadata=metadata)
        return OptimizerStepResult(
            grad_norm=response.grad_norm,
            clip_coefficient=response.clip_coefficient,
            layers=[LayerInfo.from_proto(info) for info in response.layers])

    # -------------------------------------------------------- checkpoints

    def save_checkpoint(self, name: str, layers: Sequence[str] = (), *,
                        gradients: bool = False,
                        optimizer_state: bool = True,
                        timeout: Optional[float] = None
                        ) -> checkpoint_pb2.SaveCheckpointResponse:
        """Writes ``<state_dir>/<name>.safetensors`` atomically: the named
        layers (all by default) with their spec and parameters, their
        gradient accumulators when `gradients`, and their optimizer state
        unless `optimizer_state` is false. Returns the response message
        (name, bytes, layers, seconds). See docs/checkpoints.md."""
        request = checkpoint_pb2.SaveCheckpointRequest(
            name=name, layers=list(layers), include_gradients=gradients,
            skip_optimizer_state=not optimizer_state)
        return self._call("SaveCheckpoint", request, timeout=timeout)

    def load_checkpoint(self, name: str, layers: Sequence[str] = (), *,
                        replace: bool = False, device: str = "",
                        timeout: Optional[float] = None
                        ) -> checkpoint_pb2.LoadCheckpointResponse:
        """Recreates the checkpoint's layers (all by default) bit for bit.
        Existing layers of those names are an error unless `replace`; on
        any error nothing changes. `device` overrides the saved devices.
        Returns the response message (layers as LayerInfo messages, bytes,
        seconds)."""
        request = checkpoint_pb2.LoadCheckpointRequest(
            name=name, layers=list(layers), replace=replace, device=device)
        return self._call("LoadCheckpoint", request, timeout=timeout)

    def list_checkpoints(self) -> List[CheckpointInfo]:
        """The checkpoints in the daemon's --state_dir, newest first."""
        response = self._call("ListCheckpoints",
                              checkpoint_pb2.ListCheckpointsRequest(),
                              retry=True)
        return [CheckpointInfo(c.name, c.bytes, c.modified_unix_nanos)
                for c in response.checkpoints]

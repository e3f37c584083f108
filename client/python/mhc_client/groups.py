"""Data-parallel groups: the :class:`Client` methods over NCCL groups.

A group is a set of replicas of the same layers, one set per rank; a rank is
one CUDA device of one daemon. Rank 0's daemon makes the group
(:meth:`GroupCalls.create_group`) and every other daemon joins it with the
returned ``unique_id`` (:meth:`GroupCalls.join_group`). Then
:meth:`GroupCalls.all_reduce_gradients` sums (or averages) the gradient
accumulators of all the group's layers over every rank in one call, and
:meth:`GroupCalls.broadcast_parameters` copies one rank's parameters to all.
Every daemon of a group must make the same collective calls in the same
order; see docs/api.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Sequence, Union

from ._proto import group_pb2

# How long the client waits beyond the daemon's own deadline for the answer.
_REPLY_MARGIN_S = 30.0

RanksLike = Union[Mapping[int, Sequence[str]], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    group: str
    world_size: int
    unique_id: bytes
    state: str  # "FORMING", "READY", "FAILED"
    error: str
    ranks: List[group_pb2.GroupRank]
    parameter_count: int
    library: str

    @classmethod
    def from_proto(cls, p: group_pb2.GroupInfo) -> "GroupInfo":
        return cls(group=p.group, world_size=p.world_size,
                   unique_id=bytes(p.unique_id),
                   state=group_pb2.GroupInfo.State.Name(p.state),
                   error=p.error, ranks=list(p.ranks),
                   parameter_count=p.parameter_count, library=p.library)


@dataclasses.dataclass(frozen=True)
class CollectiveResult:
    bytes: int
    seconds: float
    bus_bytes_per_second: float


def group_ranks(ranks: RanksLike) -> List[group_pb2.GroupRank]:
    """``{rank: (device, [layers])}`` or a list of ``GroupRank`` protos."""
    if isinstance(ranks, Mapping):
        out = []
        for rank, (device, layers) in sorted(ranks.items()):
            out.append(group_pb2.GroupRank(rank=rank, device=device,
                                           layers=list(layers)))
        return out
    return list(ranks)


class GroupCalls:
    """Mixed into :class:`mhc_client.Client` (which provides ``_call``)."""

    def _group_call(self, rpc: str, request: Any, timeout: float) -> Any:
        return self._call(rpc, request,  # type: ignore[attr-defined]
                          timeout=timeout + _REPLY_MARGIN_S)

    def create_group(self, group: str, world_size: int, ranks: RanksLike, *,
                     timeout: float = 120.0, wait: bool = False) -> GroupInfo:
        """Makes a group with this daemon's ranks (rank 0 among them).

        ``ranks``: ``{rank: (device, [layer, ...])}``, e.g.
        ``{0: ("cuda:0", ["l0", "l1"])}``. With ``wait`` the answer comes
        once the group is READY or FAILED (every member must have joined);
        otherwise at once, FORMING, with the ``unique_id`` to pass on.
        """
        request = group_pb2.CreateGroupRequest(
            group=group, world_size=world_size, ranks=group_ranks(ranks),
            timeout_seconds=timeout, wait=wait)
        return GroupInfo.from_proto(
            self._group_call("CreateGroup", request, timeout))

    def join_group(self, group: str, world_size: int, unique_id: bytes,
                   ranks: RanksLike, *, timeout: float = 120.0,
                   wait: bool = False) -> GroupInfo:
        """Joins rank 0's group with this daemon's (other) ranks."""
        request = group_pb2.JoinGroupRequest(
            group=group, world_size=world_size, unique_id=unique_id,
            ranks=group_ranks(ranks), timeout_seconds=timeout, wait=wait)
        return GroupInfo.from_proto(
            self._group_call("JoinGroup", request, timeout))

    def get_group(self, group: str) -> GroupInfo:
        return GroupInfo.from_proto(self._call(  # type: ignore[attr-defined]
            "GetGroup", group_pb2.GetGroupRequest(group=group), retry=True))

    def all_reduce_gradients(self, group: str, op: str = "sum", *,
                             timeout: float = 120.0) -> CollectiveResult:
        """Sums (``op="sum"``) or averages (``"mean"``) every group layer's
        gradient accumulators over all ranks, in place."""
        ops = {"sum": group_pb2.REDUCE_OP_SUM, "mean": group_pb2.REDUCE_OP_MEAN}
        if op not in ops:
            from .errors import InvalidArgument
            raise InvalidArgument(f"op: expected 'sum' or 'mean', got '{op}'")
        request = group_pb2.AllReduceGradientsRequest(
            group=group, op=ops[op], timeout_seconds=timeout)
        r = self._group_call("AllReduceGradients", request, timeout)
        return CollectiveResult(r.bytes, r.seconds, r.bus_bytes_per_second)

    def broadcast_parameters(self, group: str, root_rank: int = 0, *,
                             timeout: float = 120.0) -> CollectiveResult:
        """Copies rank ``root_rank``'s parameters to every rank's replicas."""
        request = group_pb2.BroadcastParametersRequest(
            group=group, root_rank=root_rank, timeout_seconds=timeout)
        r = self._group_call("BroadcastParameters", request, timeout)
        return CollectiveResult(r.bytes, r.seconds, r.bus_bytes_per_second)

    def leave_group(self, group: str) -> None:
        """Ends this daemon's membership (aborting what still runs)."""
        self._call("LeaveGroup",  # type: ignore[attr-defined]
                   group_pb2.LeaveGroupRequest(group=group))

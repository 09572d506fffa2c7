"""What ranks exchange that the host already knows, exchanged between the hosts: a packed row's
length, a pipeline activation's shape.

Sent as device tensors (NCCL only moves those), each such value costs the receiving host a read
back from its GPU, which waits for every kernel queued before it: megatron's pipeline stages read
each received activation's shape back (and synchronize the device around the exchange) in every
micro-batch and direction, and the allgather dispatcher's row-length agreement read one more.
Over a gloo group of the same ranks the host waits only for the other hosts' messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.common.batch_memo import host_side

_TWINS: dict[tuple[int, ...], object] = {}


def _twinned_groups() -> list:
    """The groups whose values go between the hosts, in the one order every rank makes their twins:
    ``use_local_synchronization`` deadlocks where ranks make overlapping groups in different orders
    (a stage-1 rank's first need is its pipeline group, a stage-0 rank's its expert group)."""
    from megatron.core import parallel_state

    return [
        parallel_state.get_pipeline_model_parallel_group(),
        parallel_state.get_expert_tensor_and_model_parallel_group(),
    ]


def host_twin(group):
    """A gloo group of ``group``'s ranks, made by its members alone (``use_local_synchronization``).
    The first call makes the twins of every group of ``_twinned_groups`` in that order, so ranks
    that first need different ones still make them alike. Made on a gloo run too, where ``group``
    would do, so the code CI runs is the code an NCCL run takes."""
    if not _TWINS:
        for each in [g for g in _twinned_groups() if g is not None]:
            _twin_of(each)
    return _twin_of(group)


def _twin_of(group):
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _TWINS:
        _TWINS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _TWINS[ranks]


def agreed_max(value: int, group) -> int:
    """The largest ``value`` of ``group``'s ranks, agreed between their hosts."""
    tensor = host_side(torch.tensor([value], dtype=torch.long))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host_twin(group))
    return int(tensor)


def shapes_between_hosts(original, run=None):
    """megatron's ``P2PCommunicator._communicate_shapes`` with the shapes sent between the hosts of the
    neighbouring stages (a gloo twin of the pipeline group): the same messages, in the same order,
    with no device tensor to read back and no device synchronize. megatron's own ring exchange is kept."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.config.use_ring_exchange_p2p:
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        group = host_twin(self.pp_group)

        def shape_of(tensor):
            return host_side(torch.tensor(tensor.size(), dtype=torch.int64))

        received, works = {}, []
        # megatron's order: send to prev, receive from prev, send to next, receive from next
        if tensor_send_prev is not None:
            works.append(dist.isend(shape_of(tensor_send_prev), self.prev_rank, group=group))
        if recv_prev:
            received["prev"] = host_side(torch.empty(3, dtype=torch.int64))
            works.append(dist.irecv(received["prev"], self.prev_rank, group=group))
        if tensor_send_next is not None:
            works.append(dist.isend(shape_of(tensor_send_next), self.next_rank, group=group))
        if recv_next:
            received["next"] = host_side(torch.empty(3, dtype=torch.int64))
            works.append(dist.irecv(received["next"], self.next_rank, group=group))
        for work in works:
            work.wait()
        return tuple(received[k].tolist() if k in received else [0, 0, 0] for k in ("prev", "next"))

    return _communicate_shapes

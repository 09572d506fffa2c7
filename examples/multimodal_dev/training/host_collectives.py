"""What ranks exchange that the host already knows, exchanged between the hosts: a packed row's
length, a pipeline activation's shape.

Sent as device tensors (NCCL only moves those), each such value costs the receiving host a read
back from its GPU, which waits for every kernel queued before it: megatron's pipeline stages read
each received activation's shape back (and synchronize the device around the exchange) in every
micro-batch and direction, and the allgather dispatcher's row-length agreement read one more.
Over a gloo group the host waits only for the other hosts' messages. Only where the group is gloo
already, for now (``host_group``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.common.batch_memo import host_side


def host_group(group):
    """``group`` where it is gloo (its collectives run between the hosts), else None.

    An NCCL run would need a gloo twin of each group. Made lazily, at each rank's first need, the
    twins deadlock: ``use_local_synchronization`` requires every rank to create overlapping groups
    in one order, and a fixed order (pipeline, then expert group) still hung at PP=2 x CP=2 on this
    host. Until twins are made with the groups themselves, an NCCL run keeps megatron's device path."""
    return group if dist.get_backend(group) == "gloo" else None


def agreed_max(value: int, group) -> int:
    """The largest ``value`` of ``group``'s ranks: between the hosts on a gloo group, else through a
    device tensor (one read back)."""
    host = host_group(group)
    if host is None:
        tensor = torch.tensor([value], dtype=torch.long, device=torch.cuda.current_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return int(tensor)
    tensor = host_side(torch.tensor([value], dtype=torch.long))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host)
    return int(tensor)


def shapes_between_hosts(original, run=None):
    """megatron's ``P2PCommunicator._communicate_shapes`` with the shapes sent between the hosts of the
    neighbouring stages where the pipeline group is gloo: the same messages, in the same order,
    with no device tensor to read back and no device synchronize. megatron's own ring exchange is kept."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        group = host_group(self.pp_group)
        if self.config.use_ring_exchange_p2p or group is None:
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)

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

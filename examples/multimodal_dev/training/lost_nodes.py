"""A node lost during training, named in one line.

When a node dies, the ranks on the others fail in their next collective with it: at once where its
sockets close (gloo's "Connection closed by peer", NCCL's aborted communicator), or after
``--distributed-timeout-minutes`` where it hangs. The error names a socket, not a node. Each rank
that fails so checks in to the run's store (on node 0, torchrun's) under its node's number and waits
``ROLL_CALL_S`` for the other nodes' ranks, which fail the same way: a node none of whose ranks checks
in is the lost one. Where the store itself is gone, node 0 (which holds it) is.

A rank failing on its own (a bug, a user's mistake) leaves the others alive and waiting, not checking
in; so only errors of a collective that lost its peer start a roll call.
"""

from __future__ import annotations

import datetime
import os
import re
import time

from examples.multimodal_dev.training.run_checks import last_checkpoint, step_in_progress

ROLL_CALL_S = 10.0  # longer than the other nodes' ranks take to fail on the same lost peer
_POLL_S = 0.2
# what a collective says when its peer is gone (gloo) or never answered (gloo, NCCL)
_LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Timed out waiting|collective operation timeout"
    r"|communicator was aborted|Socket Timeout"
)


_SOURCE = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../pair.cc:561] " before what happened


def _causes(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def lost_peer(err: BaseException) -> str | None:
    """The first line of the collective's error where ``err`` is one that lost its peer, else None."""
    import torch.distributed as dist

    for cause in _causes(err):
        if isinstance(cause, dist.DistError) or (isinstance(cause, RuntimeError) and _LOST_PEER.search(str(cause))):
            first = _SOURCE.sub("", str(cause).strip().splitlines()[0])
            return first.split(". ")[0][:200]
    return None


def _nodes() -> tuple[int, int, int]:
    """(this node, nodes, ranks a node) from torchrun's variables."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")) // per_node, per_node


def missing_nodes(store, node: int, nodes: int, wait_s: float = ROLL_CALL_S) -> list[int]:
    """Check in as ``node``, then the nodes none of whose ranks has checked in within ``wait_s``."""
    keys = [f"lost_node_roll_call/node{n}" for n in range(nodes)]
    store.set(keys[node], "here")
    deadline = time.monotonic() + wait_s
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return [n for n, key in enumerate(keys) if not store.check([key])]


def _ranks(node: int, per_node: int) -> str:
    first, last = node * per_node, (node + 1) * per_node - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def one_line(err: BaseException, args) -> str | None:
    """The line for a collective that lost a node: which node, at which step, and what the run keeps."""
    cause = lost_peer(err)
    if cause is None:
        return None
    import torch.distributed as dist

    node, nodes, per_node = _nodes()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=ROLL_CALL_S))
        missing = missing_nodes(store, node, nodes)
    except Exception:  # the store went with its host
        missing = [0]
    named = ", ".join(f"node {n} ({_ranks(n, per_node)})" for n in missing) or "a rank of this run"
    step = step_in_progress()
    during = f" during iteration {step}" if step is not None else ""
    return (
        f"lost {named}{during}: {cause}; node {node} stops too, and {last_checkpoint(args)}, intact: start "
        "run_qwen35_vl.sh on every node again to resume from it"
    )

"""How the nodes of a run meet: torchrun's static rendezvous (node 0 holds the store, ranks numbered
node by node) with a roll call, so that a node which never joins is named.

torchrun's own static rendezvous waits inside the store's constructor until enough nodes have
connected, and on its timeout says only "1/2 clients joined": on 32 nodes, not which one is missing.
Here node 0's store starts without that wait; every node writes its node rank and host into it, and
node 0 waits up to ``JOIN_TIMEOUT`` seconds for all of them. Then it writes a verdict every node
reads: go, or the nodes that never joined, which every node that did join prints and stops on. A node
that cannot reach node 0 in that time names node 0.

The handler is torchrun's registered backend ``BACKEND`` (``--rdzv-backend``), its node rank and
timeout in ``--rdzv-conf``; ranks, store and everything after the meeting are the static
rendezvous's own.
"""

from __future__ import annotations

import datetime
import functools
import socket
import time

BACKEND = "static-roll-call"
DEFAULT_JOIN_TIMEOUT_S = 600  # torchrun's static rendezvous's own
_POLL_S = 0.2
# a node that joined waits for node 0's verdict this much longer than node 0 waits for the nodes: node 0's
# wait began no later than this node's, and it writes the verdict after its wait has ended
_VERDICT_GRACE_S = 30


class NodesMissing(RuntimeError):
    """One line: which nodes did not join, or that node 0 did not answer."""


def _keys(run_id: str, nnodes: int) -> tuple[list[str], str]:
    return [f"{run_id}/roll_call/node{n}" for n in range(nnodes)], f"{run_id}/roll_call/verdict"


def _where(handler) -> str:
    return f"{handler.master_addr}:{handler.master_port} (MASTER_ADDR:MASTER_PORT)"


def _as_node_0(store, handler) -> None:
    """Wait for every node's name; write the verdict (empty: go) and raise where some never came."""
    names, verdict = _keys(handler.run_id, handler.world_size)
    deadline = time.monotonic() + handler.timeout.total_seconds()
    while not store.check(names) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    missing = [n for n, key in enumerate(names) if not store.check([key])]
    if not missing:
        store.set(verdict, "")
        return
    joined = ", ".join(f"node {n} ({store.get(key).decode()})" for n, key in enumerate(names) if n not in missing)
    line = (
        f"node(s) {', '.join(map(str, missing))} of NNODES={handler.world_size} never joined at {_where(handler)} "
        f"within JOIN_TIMEOUT={handler.timeout.total_seconds():g} s (joined: {joined}); start run_qwen35_vl.sh "
        "on each missing node with its NODE_RANK"
    )
    store.set(verdict, line)
    time.sleep(1.0)  # the nodes that joined read the verdict before this store goes
    raise NodesMissing(line)


def _as_other_node(store, handler) -> None:
    _, verdict = _keys(handler.run_id, handler.world_size)
    try:
        store.wait([verdict], handler.timeout + datetime.timedelta(seconds=_VERDICT_GRACE_S))
        said = store.get(verdict).decode()
    except Exception as err:  # its store went away or never answered: node 0 stopped waiting
        raise NodesMissing(
            f"node 0 at {_where(handler)} stopped before every node joined ({str(err).splitlines()[0][:120]})"
        ) from None
    if said:
        raise NodesMissing(said)


def _wait_for_node_0(handler) -> None:
    """Until node 0's store accepts a connection: a plain socket's tries, where the store's own each
    log a C++ stack on the way."""
    deadline = time.monotonic() + handler.timeout.total_seconds()
    while True:
        try:
            socket.create_connection((handler.master_addr, handler.master_port), timeout=1.0).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise NodesMissing(
                    f"node {handler.rank} could not reach node 0 at {_where(handler)} within "
                    f"JOIN_TIMEOUT={handler.timeout.total_seconds():g} s ({err.strerror or err})"
                ) from None
        time.sleep(_POLL_S)


@functools.cache
def handler_class() -> type:
    """The static rendezvous with a roll call (a class made on first use: it imports torch)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class StaticRollCall(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self):
            if self._store is None:
                if self.rank != 0:
                    _wait_for_node_0(self)
                try:
                    store = TCPStore(
                        self.master_addr,
                        self.master_port,
                        self.world_size,
                        self.rank == 0,
                        self.timeout,
                        multi_tenant=True,
                        wait_for_workers=False,
                    )
                except Exception as err:  # node 0 never answered (or its port is taken, on node 0)
                    raise NodesMissing(
                        f"node {self.rank} could not reach node 0 at {_where(self)} within "
                        f"JOIN_TIMEOUT={self.timeout.total_seconds():g} s ({str(err).splitlines()[0][:160]})"
                    ) from None
                names, _ = _keys(self.run_id, self.world_size)
                store.set(names[self.rank], socket.gethostname())
                (_as_node_0 if self.rank == 0 else _as_other_node)(store, self)
                self._store = store
            return super().next_rendezvous()

    return StaticRollCall


def _create(params):
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    timeout = int(params.config.get("timeout", DEFAULT_JOIN_TIMEOUT_S))
    return handler_class()(host, port, int(params.config["rank"]), params.max_nodes, params.run_id, timeout)


def register() -> None:
    """Make ``BACKEND`` a torchrun rendezvous backend in this process, before torchrun creates its
    rendezvous (registering the same creator again is allowed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create)

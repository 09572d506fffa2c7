"""How the nodes of a run meet: torchrun's static rendezvous (node 0 holds the store, ranks numbered
node by node) with a roll call, so that a node which never joins is named.

torchrun's own static rendezvous waits inside the store's constructor until enough nodes have
connected, and on its timeout says only "1/2 clients joined": on 32 nodes, not which one is missing.
Here node 0's store starts without that wait; every node writes its node rank and host into it, and
node 0 waits up to ``JOIN_TIMEOUT`` seconds for all of them. Then it writes a verdict every node
reads: go, or the nodes that never joined, which every node that did join prints and stops on. A node
that cannot reach node 0 in that time names node 0.

Every node also counts itself in under its node rank, so two nodes started with one ``NODE_RANK`` are
named as such (node 0's verdict stops them all) instead of one waiting for a node that never comes. A
second node 0 finds the first one's store on its port, or, on another host, that ``MASTER_ADDR`` is not
its own address.

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


def _claims(store, name_key: str, add: int = 0) -> int:
    """How many nodes have counted themselves in under one node rank (``add``: this one too)."""
    return store.add(f"{name_key}/claims", add)


def _claimed_twice(store, names: list[str]) -> str | None:
    twice = [n for n, key in enumerate(names) if _claims(store, key) > 1]
    if not twice:
        return None
    return (
        f"NODE_RANK={twice[0]} was given to {_claims(store, names[twice[0]])} nodes (one of them "
        f"{store.get(names[twice[0]]).decode()}); give each node its own NODE_RANK, 0 to NNODES-1"
    )


def _where(handler) -> str:
    return f"{handler.master_addr}:{handler.master_port} (MASTER_ADDR:MASTER_PORT)"


def _as_node_0(store, handler) -> None:
    """Wait for every node's name; write the verdict (empty: go) and raise where some never came."""
    names, verdict = _keys(handler.run_id, handler.world_size)
    deadline = time.monotonic() + handler.timeout.total_seconds()
    twice = None
    while not store.check(names) and time.monotonic() < deadline and not (twice := _claimed_twice(store, names)):
        time.sleep(_POLL_S)
    twice = twice or _claimed_twice(store, names)
    if twice:
        store.set(verdict, twice)
        time.sleep(1.0)  # the nodes that joined read the verdict before this store goes
        raise NodesMissing(twice)
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


def _not_this_host(address: str) -> bool:
    """Whether ``address`` (MASTER_ADDR) resolves to addresses none of which is this host's: a node 0
    started elsewhere than where the other nodes will look for it."""
    try:
        resolved = {(info[0], str(info[4][0])) for info in socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False  # unresolvable: the store says so where it connects
    for family, host in resolved:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, 0))
                return False
            except OSError:
                continue
    return True


def _second_node_0(handler, err: Exception) -> NodesMissing:
    """Node 0's store could not listen: where another node 0 of this run holds the port, say so (and
    count this one in, so the first one's verdict stops every node)."""
    from torch.distributed import TCPStore

    said = str(err).splitlines()[0][:160]
    try:
        other = TCPStore(handler.master_addr, handler.master_port, None, False, datetime.timedelta(seconds=5))
        names, _ = _keys(handler.run_id, handler.world_size)
        if other.check([names[0]]):
            _claims(other, names[0], 1)
            return NodesMissing(
                f"NODE_RANK=0: node 0 of this run is already up on {other.get(names[0]).decode()} at "
                f"{_where(handler)}; give each node its own NODE_RANK, 0 to NNODES-1"
            )
    except Exception:  # not a store of this run at that port
        pass
    return NodesMissing(f"node 0 could not listen at {_where(handler)} ({said}); is the port another run's?")


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
                elif _not_this_host(self.master_addr):
                    raise NodesMissing(
                        f"NODE_RANK=0 on {socket.gethostname()}, but MASTER_ADDR={self.master_addr} is another "
                        "host's address: node 0 is the node MASTER_ADDR names; give this node its own NODE_RANK"
                    )
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
                    if self.rank == 0:
                        raise _second_node_0(self, err) from None
                    raise NodesMissing(
                        f"node {self.rank} could not reach node 0 at {_where(self)} within "
                        f"JOIN_TIMEOUT={self.timeout.total_seconds():g} s ({str(err).splitlines()[0][:160]})"
                    ) from None
                names, _ = _keys(self.run_id, self.world_size)
                if _claims(store, names[self.rank], 1) > 1:  # node 0's verdict stops the node that came first
                    raise NodesMissing(
                        f"NODE_RANK={self.rank}: another node ({store.get(names[self.rank]).decode()}) joined with "
                        "it first; give each node its own NODE_RANK, 0 to NNODES-1"
                    )
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

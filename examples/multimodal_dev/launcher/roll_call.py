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

The nodes also agree on the run: the launcher hands each node's settings to its roll call in
``SETTINGS_VARIABLE`` (``launch.py``: the run's variables and the training script's flags, less what is
each node's own); each node writes them and their sha256 beside its name, and node 0 compares every
node's fingerprint with its own before its verdict. A node whose settings differ stops every node on
one line naming the differing settings with both values, before any rank starts. Nodes started by
torchrun directly carry no settings and are not compared.

The handler is torchrun's registered backend ``BACKEND`` (``--rdzv-backend``), its node rank and
timeout in ``--rdzv-conf``; ranks, store and everything after the meeting are the static
rendezvous's own.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import socket
import time

BACKEND = "static-roll-call"
DEFAULT_JOIN_TIMEOUT_S = 600  # torchrun's static rendezvous's own
_POLL_S = 0.2
# a node that joined waits for node 0's verdict this much longer than node 0 waits for the nodes: node 0's
# wait began no later than this node's, and it writes the verdict after its wait has ended
_VERDICT_GRACE_S = 30
SETTINGS_VARIABLE = "ROLL_CALL_SETTINGS"  # this node's run settings as canonical JSON (launch.py sets it)
# Not compared, each rightly a node's own: NODE_RANK; MASTER_ADDR and MASTER_PORT, how this node
# reaches node 0 (having met there, the nodes agree where it counts, and node 0 may name itself
# otherwise than the others name it); JOIN_TIMEOUT, how long this node waits to meet; DRY_RUN and
# GPUS, which plan a run and never reach the join; FORK_RANKS, how this host starts its ranks (by its
# cores and CUDA: the engine each rank runs is the same either way).
# UNCHECKED_VARIABLES, what this node's own environment holds besides the run's settings
PER_NODE = frozenset(
    {"NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "JOIN_TIMEOUT", "DRY_RUN", "GPUS", "FORK_RANKS", "UNCHECKED_VARIABLES"}
)
# ... and the training script's flags for files that one rank (megatron's last) writes alone, on its
# node's disk: where another node would put its copy is that node's business
PER_NODE_FLAGS = frozenset({"--metrics-file", "--tensorboard-dir", "--wandb-save-dir"})
_NAMED = 3  # differing settings one refusal names


class NodesMissing(RuntimeError):
    """One line: which nodes did not join, that node 0 did not answer, or whose settings differ."""


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


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """The training script's flags, each with its values in order (words before any flag under ""),
    less ``PER_NODE_FLAGS``: the same flags given in another order are the same run."""
    flags: dict[str, list[str]] = {}
    name = ""
    for word in argv:
        if word.startswith("--"):
            name, has_value, value = word.partition("=")
            flags.setdefault(name, []).extend([value] if has_value else [])
        else:
            flags.setdefault(name, []).append(word)
    return {k: v for k, v in flags.items() if k not in PER_NODE_FLAGS}


def settings_of(variables: dict, torchrun_argv: list[str]) -> str:
    """What the nodes compare at the join, as canonical JSON: the run's ``variables`` (name -> value)
    less ``PER_NODE``, and the flags of the training script (what follows ``--module MODULE`` in
    torchrun's ``torchrun_argv``: the launcher's flags and the user's)."""
    script = torchrun_argv[torchrun_argv.index("--module") + 2 :] if "--module" in torchrun_argv else torchrun_argv
    settings = {
        "variables": {k: v for k, v in variables.items() if k not in PER_NODE},
        "flags": _flags(list(script)),
    }
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)


def _variable(name: str, value) -> str:
    if value is None:
        return f"{name} unset"
    return f"{name}={int(value) if isinstance(value, bool) else value}"


def _flag(name: str, values: list[str] | None) -> str:
    if values is None:
        return f"no {name}"
    return " ".join([name or "(before any flag)", *values])


def difference(node: int, theirs: dict, ours: dict, also: tuple[int, ...] = ()) -> str:
    """The line that stops the run where node ``node``'s settings (``theirs``, as ``settings_of`` wrote
    them) differ from node 0's (``ours``): the differing variables with both values, or where the
    variables agree, the differing flags; ``also``: other nodes that differ."""
    mine, zeros = theirs.get("variables", {}), ours.get("variables", {})
    named = [
        f"{_variable(k, mine.get(k))} on node {node}, {_variable(k, zeros.get(k))} on node 0"
        for k in sorted(set(mine) | set(zeros))
        if mine.get(k) != zeros.get(k)
    ]
    if not named:  # the variables write most flags: theirs alone where the variables agree
        mine, zeros = theirs.get("flags", {}), ours.get("flags", {})
        named = [
            f"{_flag(k, mine.get(k))} on node {node}, {_flag(k, zeros.get(k))} on node 0"
            for k in sorted(set(mine) | set(zeros))
            if mine.get(k) != zeros.get(k)
        ]
    shown = "; ".join(named[:_NAMED]) + (f"; and {len(named) - _NAMED} more" if len(named) > _NAMED else "")
    others = f"; node(s) {', '.join(map(str, also))} differ too" if also else ""
    return (
        f"node {node}'s settings differ from node 0's: {shown}{others} "
        "(every node runs the script with the same settings)"
    )


def _write_settings(store, name_key: str) -> None:
    """This node's settings and their fingerprint, before its name (node 0 reads them once it sees the
    name); none where the launcher did not start this node."""
    settings = os.environ.get(SETTINGS_VARIABLE)
    if settings:
        store.set(f"{name_key}/settings", settings)
        store.set(f"{name_key}/fingerprint", hashlib.sha256(settings.encode()).hexdigest())


def _disagreement(store, names: list[str]) -> str | None:
    """The line naming the first node whose fingerprint differs from node 0's (None: every node that
    carries settings agrees, or node 0 carries none)."""
    prints = [f"{key}/fingerprint" for key in names]
    if not store.check([prints[0]]):
        return None
    ours = store.get(prints[0])
    differ = [n for n, key in enumerate(prints) if n and store.check([key]) and store.get(key) != ours]
    if not differ:
        return None
    theirs, zeros = (json.loads(store.get(f"{names[n]}/settings")) for n in (differ[0], 0))
    return difference(differ[0], theirs, zeros, tuple(differ[1:]))


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
        disagree = _disagreement(store, names)
        store.set(verdict, disagree or "")
        if disagree:
            time.sleep(1.0)  # the nodes that joined read the verdict before this store goes
            raise NodesMissing(disagree)
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
                _write_settings(store, names[self.rank])
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

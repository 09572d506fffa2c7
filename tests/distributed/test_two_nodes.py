"""Two nodes on this host: two launchers side by side on 127.0.0.1 (``NNODES=2``, ``NODE_RANK`` 0 and 1,
gloo), each starting one rank, train as one node with both ranks does, loss and grad norm bitwise:
data parallelism across the nodes, and tensor and expert parallelism across them; nodes started with
different settings, a node missing or lost, a node saving elsewhere, each stopped on one line."""

import signal
import socket
import threading

import pytest
from launch import NO_EVAL, WarmEngine, run_script

COMMON = dict(MOE=1, SEQ_LEN=256, GBS=4, TRAIN_ITERS=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack_in(output: str) -> bool:
    """A Python traceback or a C++ one (torch's c10d logs its own)."""
    return "Traceback" in output or "frame #" in output


def _nodes(own: tuple[dict, ...] = ({}, {}), started=None, **layout) -> list:
    """The nodes' runs, node 0 first (None for a node not ``started``); each node launched as a user
    launches it, with its NODE_RANK (and ``own``: settings of that node alone)."""
    WarmEngine.get()  # started once, before the launches meet on it
    port, runs = _free_port(), [None] * len(own)

    def node(rank: int) -> None:
        where = dict(NNODES=len(own), NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        runs[rank] = run_script(NO_EVAL, timeout=300, **where, **{**COMMON, **layout, **own[rank]})

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (started or range(len(own)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


@pytest.mark.parametrize(
    "layout",
    [dict(NPROC=1), dict(NPROC=1, TP=2, EP=2, ETP=1)],
    ids=["DP across nodes", "TP and EP across nodes"],
)
def test_two_nodes_train_as_one_node_does(layout):
    nodes = [run.check() for run in _nodes(**layout)]
    one = run_script(NO_EVAL, **COMMON, **{**layout, "NPROC": 2}).check()
    losses = {i: v for run in nodes for i, v in run.losses.items()}  # the rank that logs writes the metrics
    grad_norms = {i: v for run in nodes for i, v in run.grad_norms.items()}
    assert sorted(losses) == [1, 2, 3], [run.output[-3000:] for run in nodes]
    assert losses == one.losses and grad_norms == one.grad_norms, (losses, one.losses, grad_norms, one.grad_norms)
    assert "NNODES=2 NODE_RANK=1" in nodes[1].output  # each launcher said which node it is


def test_nodes_started_with_different_settings_stop_at_the_join_naming_them():
    """Node 1 is started with GBS=8, node 0 with GBS=4: both stop as they meet, on one line naming the
    variable with both values, and no rank starts (no iteration is logged)."""
    nodes = _nodes(({}, dict(GBS=8)), NPROC=1)
    said = "torchrun: node 1's settings differ from node 0's: GBS=8 on node 1, GBS=4 on node 0"
    for run in nodes:
        assert run.returncode != 0 and not _stack_in(run.output), run.output[-3000:]
        last = run.output.strip().splitlines()[-1]  # torchrun's line the last: no rank said anything
        assert last == f"{said} (every node runs the script with the same settings)", run.output[-3000:]
        assert not run.records


def test_a_node_saving_to_a_folder_of_its_own_stops_the_run_at_that_save(tmp_path):
    """Node 1's ranks save to a folder of their own under the path both nodes are given, as a node-local
    disk mounted there would hold its shards (the test hook ``NODE_LOCAL_SAVE``; a CKPT_SAVE of its own
    stops at the join): the checkpoint is split, and every rank stops at that save in one line naming
    the ranks it cannot see, instead of the next run failing to load."""
    shared, local = tmp_path / "shared", tmp_path / "node1_local"
    nodes = _nodes(({}, dict(NODE_LOCAL_SAVE=local)), NPROC=1, CKPT_SAVE=shared)
    for run, unseen in zip(nodes, ("1", "0")):
        assert run.returncode != 0 and "Traceback" not in run.output, run.output[-3000:]
        assert f"does not see the files of rank(s) {unseen}: every node must save to one shared folder" in run.output


def test_a_node_that_never_joins_is_named_by_every_node_that_did():
    """Nodes 0 and 2 of three start, node 1 never does: both stop once JOIN_TIMEOUT has passed, on one
    line naming node 1; a node alone, whose node 0 never answers, names node 0."""
    # node 0 waits long enough for node 2's launch on a busy host; a node alone, shorter
    wait = dict(JOIN_TIMEOUT=15, NPROC=1, GBS=12)
    nodes = _nodes(({}, {}, {}), started=(0, 2), **wait)
    for run in (nodes[0], nodes[2]):
        assert run.returncode != 0 and not _stack_in(run.output), run.output[-3000:]
        assert "torchrun: node(s) 1 of NNODES=3 never joined at 127.0.0.1:" in run.output, run.output[-3000:]
        assert "within JOIN_TIMEOUT=15 s (joined: node 0 (" in run.output and "), node 2 (" in run.output
    (alone,) = [run for run in _nodes(({}, {}), started=(1,), **{**wait, "JOIN_TIMEOUT": 3}) if run is not None]
    assert alone.returncode != 0 and not _stack_in(alone.output), alone.output[-3000:]
    assert "torchrun: node 1 could not reach node 0 at 127.0.0.1:" in alone.output, alone.output[-3000:]


def test_a_node_that_dies_mid_run_is_named_and_the_run_resumes_on_one_node(tmp_path):
    """Node 1 dies as it starts iteration 3 (SIGKILL to all its processes); node 0 stops at once on one
    line naming node 1 and the intact checkpoint of iteration 2, from which the same run resumes on one
    node of two ranks: iterations 3 and 4 as an uninterrupted run on that node trains them, bitwise."""
    ckpt = tmp_path / "ckpt"
    run = dict(NPROC=1, TRAIN_ITERS=4, SAVE_INTERVAL=2, COLLECTIVE_TIMEOUT=2)
    nodes = _nodes(({}, dict(KILL_NODE_AT=3)), CKPT_RESUME=ckpt, **run)
    assert nodes[1].returncode == -signal.SIGKILL, nodes[1].output[-3000:]
    survivor = nodes[0]
    assert survivor.returncode != 0 and not _stack_in(survivor.output), survivor.output[-3000:]
    assert (
        "pretrain_multimodal.py: lost node 1 (rank 1) during iteration 3: " in survivor.output
        and f"node 0 stops too, and the last checkpoint is iteration 2 in {ckpt}, intact" in survivor.output
    ), survivor.output[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = run_script(NO_EVAL, **{**COMMON, **run, "NPROC": 2, "CKPT_RESUME": ckpt}).check()
    straight = run_script(NO_EVAL, **{**COMMON, **run, "NPROC": 2}).check()
    assert sorted(resumed.losses) == [3, 4], resumed.output[-3000:]
    assert resumed.losses == {i: straight.losses[i] for i in (3, 4)}
    assert resumed.grad_norms == {i: straight.grad_norms[i] for i in (3, 4)}

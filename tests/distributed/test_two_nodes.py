"""Two nodes on this host: two launchers side by side on 127.0.0.1 (``NNODES=2``, ``NODE_RANK`` 0 and 1,
gloo), each starting one rank, train as one node with both ranks does, loss and grad norm bitwise:
data parallelism across the nodes, and tensor and expert parallelism across them."""

import socket
import threading

import pytest
from launch import NO_EVAL, WarmEngine, run_script

COMMON = dict(MOE=1, SEQ_LEN=256, GBS=4, TRAIN_ITERS=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(own: tuple[dict, dict] = ({}, {}), **layout) -> list:
    """Both nodes' runs, node 0 first; each node launched as a user launches it, with its NODE_RANK
    (and ``own``: settings of that node alone)."""
    WarmEngine.get()  # started once, before the two launches meet on it
    port, runs = _free_port(), [None, None]

    def node(rank: int) -> None:
        where = dict(NNODES=2, NODE_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        runs[rank] = run_script(NO_EVAL, timeout=300, **where, **COMMON, **layout, **own[rank])

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
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
    nodes = [run.check() for run in _two_nodes(**layout)]
    one = run_script(NO_EVAL, **COMMON, **{**layout, "NPROC": 2}).check()
    losses = {i: v for run in nodes for i, v in run.losses.items()}  # the rank that logs writes the metrics
    grad_norms = {i: v for run in nodes for i, v in run.grad_norms.items()}
    assert sorted(losses) == [1, 2, 3], [run.output[-3000:] for run in nodes]
    assert losses == one.losses and grad_norms == one.grad_norms, (losses, one.losses, grad_norms, one.grad_norms)
    assert "NNODES=2 NODE_RANK=1" in nodes[1].output  # each launcher said which node it is


def test_a_node_saving_to_a_folder_of_its_own_stops_the_run_at_that_save(tmp_path):
    """Node 1 saves to another folder, as a node-local disk at the same path would hold its shards: the
    checkpoint is split, and every rank stops at that save in one line naming the ranks it cannot see,
    instead of the next run failing to load."""
    shared, local = tmp_path / "shared", tmp_path / "node1_local"
    nodes = _two_nodes((dict(CKPT_SAVE=shared), dict(CKPT_SAVE=local)), NPROC=1)
    for run, unseen in zip(nodes, ("1", "0")):
        assert run.returncode != 0 and "Traceback" not in run.output, run.output[-3000:]
        assert f"does not see the files of rank(s) {unseen}: every node must save to one shared folder" in run.output

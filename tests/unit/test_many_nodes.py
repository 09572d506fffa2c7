"""Many nodes before any rank starts: torchrun's multi-node arguments from ``NNODES``, ``NODE_RANK``,
``MASTER_ADDR``; the node count checked against the layout; the SLURM step's defaults; and the
planner's printed command for 397b_a17b on 256 GPUs run as printed through the sbatch script (with
a stand-in ``srun`` for node 5 of 32)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from examples.multimodal_dev.launcher import launch
from examples.multimodal_dev.launcher.from_env import Host
from examples.multimodal_dev.launcher.slurm import first_host, hosts, step_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(env: dict, gpu: bool = False) -> list[str]:
    return launch.prepare({"DRY_RUN": "1", **env}, [], Host(gpu), launch.Launch()).torchrun


def _own(words: list[str], flag: str) -> str:
    """A torchrun argument's value (before the training module)."""
    return words[words.index(flag, 0, words.index("--module")) + 1]


def _node(words: list[str]) -> tuple[str, str, str]:
    """(NNODES, this node's rank, node 0's host) as the torchrun arguments give them."""
    conf = dict(item.split("=") for item in _own(words, "--rdzv-conf").split(","))
    return _own(words, "--nnodes"), conf["rank"], _own(words, "--rdzv-endpoint").rsplit(":", 1)[0]


def test_nodes_reach_torchrun_as_a_static_rendezvous_on_node_0(monkeypatch):
    """The rendezvous torchrun reads from the launcher's arguments: node 0's endpoint, this node's rank,
    the join timeout, and the roll call's backend (registered by ``launcher/torchrun.py``)."""
    from torch.distributed.run import config_from_args, parse_args

    # torchrun sets it in its own process where unset; here it would reach every later launch of the tests
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))

    from examples.multimodal_dev.launcher import roll_call

    words = _torchrun(dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", NPROC="2", TP="2", JOIN_TIMEOUT="30"))
    assert _own(words, "--nproc-per-node") == "2" and "--standalone" not in words
    roll_call.register()
    config, _, _ = config_from_args(parse_args(words))
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (2, 2, roll_call.BACKEND)
    # every node must agree on the port: no free one picked per node
    assert config.rdzv_endpoint == "10.0.0.1:29500"
    assert {k: config.rdzv_configs[k] for k in ("rank", "timeout")} == {"rank": "1", "timeout": "30"}
    # unset, NPROC shares the layout's processes between the nodes, and node 0 waits torchrun's 600 s
    words = _torchrun(dict(NNODES="2", MASTER_ADDR="h", MASTER_PORT="31000", TP="2"))
    assert (_own(words, "--nproc-per-node"), _own(words, "--rdzv-endpoint")) == ("1", "h:31000")
    assert _own(words, "--rdzv-conf") == "rank=0,timeout=600"


@pytest.mark.parametrize(
    "env, message",
    [
        (dict(NNODES="2"), "NNODES=2 needs MASTER_ADDR: the host of node 0, where the nodes meet"),
        (dict(NNODES="2", NODE_RANK="2", MASTER_ADDR="h"), "NODE_RANK=2 must be below NNODES=2"),
        (dict(NNODES="3", TP="2", MASTER_ADDR="h"), "NNODES\\*NPROC=3 is not divisible by TP\\*CP\\*PP=2"),
        (dict(NNODES="2", NPROC="2", MASTER_ADDR="h", GBS="6"), "GBS=6 is not a multiple of MBS\\*DP=8"),
        (dict(NNODES="0"), "NNODES=0 must be a positive integer"),
        (dict(NODE_RANK="-1"), "NODE_RANK=-1 must be a non-negative integer"),
        (
            dict(NNODES="2", NPROC="2", MASTER_ADDR="h", VISION_NPROC="4"),
            "VISION_NPROC=4 leaves no ranks for the language model \\(NNODES\\*NPROC=4\\)",
        ),
    ],
)
def test_a_node_count_that_does_not_fit_the_layout_is_refused_by_name(env, message):
    with pytest.raises(launch.LaunchError, match=message):
        _torchrun(env)


@pytest.mark.parametrize(
    "nodelist, first",
    [("node007", "node007"), ("gpu[017-020]", "gpu017"), ("a[3,5-9]-ib,b1", "a3-ib"), ("x1,x2", "x1")],
)
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_a_slurm_host_list_expands_as_slurm_expands_it():
    assert hosts("node[003-005,9],gpu7") == ["node003", "node004", "node005", "node9", "gpu7"]
    assert hosts("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert hosts("a[08-10]") == ["a08", "a09", "a10"]


@pytest.mark.parametrize(
    "nodelist, said",
    [
        ("node[1-", "unbalanced brackets"),
        ("node1]", "unbalanced brackets"),
        ("node[[1]]", "unbalanced brackets"),
        ("node[3-1]", "holds '3-1', not a number or a rising range"),
        ("node[a]", "holds 'a'"),
        ("node[]", "holds ''"),
        ("x,,y", "not a host list"),
        ("", "not a host list"),
    ],
)
def test_a_malformed_slurm_host_list_is_refused_by_name(nodelist, said):
    step = dict(SLURM_STEP_NUM_NODES="2", SLURM_NODEID="0", SLURM_STEP_NODELIST=nodelist)
    with pytest.raises(launch.LaunchError) as refused:
        launch.prepare({"DRY_RUN": "1", "GBS": "8", **step}, [], Host(False), launch.Launch())
    assert str(refused.value).startswith(f"SLURM_STEP_NODELIST={nodelist}: ") and said in str(refused.value)


def test_a_slurm_host_list_of_another_length_than_the_step_is_refused():
    step = dict(SLURM_STEP_NUM_NODES="4", SLURM_NODEID="0", SLURM_STEP_NODELIST="gpu[1-3]")
    with pytest.raises(ValueError, match=r"gpu\[1-3\] names 3 host\(s\), SLURM_STEP_NUM_NODES=4"):
        step_nodes(step)


def test_a_slurm_step_gives_the_nodes_and_the_variables_override_it():
    step = dict(SLURM_STEP_NUM_NODES="4", SLURM_NODEID="3", SLURM_STEP_NODELIST="gpu[017-020]", SLURM_JOB_ID="9")
    assert step_nodes(step) == dict(NNODES="4", NODE_RANK="3", MASTER_ADDR="gpu017")
    assert step_nodes(dict(SLURM_JOB_ID="9", SLURM_NNODES="4")) == {}  # the batch script itself: not a node
    plan = launch.prepare({"DRY_RUN": "1", "GBS": "8", **step}, [], Host(False), launch.Launch())
    words = plan.torchrun
    assert _node(words) == ("4", "3", "gpu017")
    assert "SLURM step: NNODES=4 NODE_RANK=3 MASTER_ADDR=gpu017 (the variables override)" in plan.said
    words = _torchrun({**step, "GBS": "8", "MASTER_ADDR": "10.1.1.1", "NODE_RANK": "0"})
    assert _node(words)[1:] == ("0", "10.1.1.1")


def test_the_planners_command_for_397b_on_256_gpus_runs_as_printed_under_slurm(tmp_path):
    """The printed line: its settings, then ``sbatch --nodes=32`` of the repository's script. Run as
    sbatch runs it (the script, from the submit directory) with ``srun`` standing in for node 5."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.multimodal_dev.tools.plan_layout", "397b_a17b", "--gpus", "256", "--top", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = done.stdout.strip().splitlines()[-1].split("): ", 1)[1]
    words = shlex.split(line)
    sbatch = words.index("sbatch")
    settings = dict(word.split("=", 1) for word in words[:sbatch])
    assert words[sbatch + 1 : sbatch + 3] == ["--nodes=32", "examples/multimodal_dev/launcher/qwen35_vl.sbatch"]
    assert settings["MODEL_VARIANT"] == "397b_a17b" and settings["NPROC"] == "8"
    srun = tmp_path / "srun"  # node 5 of the step: SLURM's variables, then the task's command
    srun.write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "export SLURM_STEP_NUM_NODES=32 SLURM_NODEID=5 'SLURM_STEP_NODELIST=gpu[001-032]'\nexec \"$@\"\n"
    )
    srun.chmod(0o755)
    env = {**os.environ, **settings, "DRY_RUN": "1", "SLURM_SUBMIT_DIR": ROOT}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    spooled = tmp_path / "slurm_script"  # sbatch runs a copy of the script, from its spool folder
    shutil.copy(os.path.join(ROOT, words[sbatch + 2]), spooled)
    run = subprocess.run(
        ["bash", str(spooled), *words[sbatch + 3 :]], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    torchrun = shlex.split(run.stdout.strip().splitlines()[-1])
    assert (_own(torchrun[1:], "--nproc-per-node"), *_node(torchrun[1:])) == ("8", "32", "5", "gpu001")
    assert "--recompute-granularity" in torchrun  # the planner's extra flags reach the training script


def test_a_collective_that_lost_its_peer_starts_a_roll_call_that_names_the_silent_node():
    import threading

    from torch.distributed import DistBackendError, HashStore

    from examples.multimodal_dev.training.lost_nodes import lost_peer, missing_nodes

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [10.0.0.2]:4141. This is"
    )
    assert lost_peer(RuntimeError(gloo)) == "Connection closed by peer [10.0.0.2]:4141"
    try:
        try:
            raise DistBackendError("NCCL communicator was aborted on rank 3")
        except DistBackendError as err:
            raise ValueError("megatron's wrapper") from err
    except ValueError as wrapped:
        assert lost_peer(wrapped) == "NCCL communicator was aborted on rank 3"
    # a rank's own failure leaves the others waiting in their collective: no roll call for it
    assert lost_peer(RuntimeError("shape mismatch")) is None and lost_peer(ValueError("bad batch")) is None
    store, seen = HashStore(), {}

    def node(n: int) -> None:
        seen[n] = missing_nodes(store, n, nodes=4, wait_s=2.0)

    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 2, 3)]  # node 1 never checks in
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {0: [1], 2: [1], 3: [1]}


NODE = """
import sys
from examples.multimodal_dev.launcher import roll_call
addr, port, rank, nnodes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
try:
    roll_call.handler_class()(addr, port, rank, nnodes, "run", timeout).next_rendezvous()
    print("go")
except roll_call.NodesMissing as err:
    print(err)
"""


def _meet(ranks: tuple[int, ...], nnodes: int, master_addr: str = "127.0.0.1", timeout_s: int = 20) -> list[str]:
    """Each node's roll call, a process of its own as a node's launcher is (node 0's store on a free
    port): the line each node said, in the order of ``ranks`` (started in that order), "go" for a node
    that met the others."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    try:
        for rank in ranks:
            argv = [sys.executable, "-c", NODE, master_addr, str(port), str(rank), str(nnodes), str(timeout_s)]
            nodes.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
            time.sleep(3)  # in the order given: the first of two node 0s holds the port
        return [node.communicate(timeout=timeout_s + 60)[0].strip().splitlines()[-1] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()


def test_two_nodes_given_node_rank_0_are_named_as_such():
    first, second = _meet((0, 0), nnodes=2)
    assert first.startswith("NODE_RANK=0 was given to 2 nodes (one of them "), first
    assert second.startswith("NODE_RANK=0: node 0 of this run is already up on "), second


def test_two_nodes_given_one_node_rank_stop_every_node_naming_it():
    node_0, first_1, second_1 = _meet((0, 1, 1), nnodes=3)
    assert node_0.startswith("NODE_RANK=1 was given to 2 nodes") and first_1 == node_0, (node_0, first_1)
    assert second_1.startswith("NODE_RANK=1: another node ("), second_1


def test_a_node_0_away_from_master_addr_is_refused_by_name():
    (said,) = _meet((0,), nnodes=2, master_addr="192.0.2.1")  # TEST-NET-1: never this host's
    assert said.startswith("NODE_RANK=0 on ") and "MASTER_ADDR=192.0.2.1 is another host's address" in said, said


def _settings(variables: dict, *script: str) -> str:
    from examples.multimodal_dev.launcher import roll_call

    torchrun = ["--nproc-per-node", "1", "--rdzv-conf", "rank=1", "--module", "examples.x", *script]
    return roll_call.settings_of(variables, torchrun)


def test_what_the_nodes_compare_leaves_out_what_is_each_nodes_own():
    """A node's own rank, its way to node 0, its join timeout and the files one rank writes alone are
    not compared; torchrun's own arguments are not either, and flags given in another order agree."""
    import json

    ours = dict(GBS=4, NODE_RANK=0, MASTER_ADDR="node0", MASTER_PORT=None, JOIN_TIMEOUT=600, DRY_RUN=False)
    theirs = {**ours, "NODE_RANK": 1, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 29500, "JOIN_TIMEOUT": 30}
    a = _settings(ours, "--lr", "2e-3", "--log-throughput", "--metrics-file", "/n0/m.jsonl")
    b = _settings(theirs, "--log-throughput", "--lr=2e-3", "--tensorboard-dir", "/n1/tb")
    assert a == b and json.loads(a) == {"variables": {"GBS": 4}, "flags": {"--lr": ["2e-3"], "--log-throughput": []}}
    assert _settings(ours, "--lr", "2e-3") != _settings({**ours, "GBS": 8}, "--lr", "2e-3")


def test_differing_settings_are_named_with_both_values():
    import json

    from examples.multimodal_dev.launcher.roll_call import difference

    def line(theirs: str, ours: str, also=()) -> str:
        return difference(1, json.loads(theirs), json.loads(ours), also)

    end = " (every node runs the script with the same settings)"
    base = dict(GBS=4, MOE=False, CKPT_SAVE="/shared/ckpt", LR="2e-3")
    assert line(_settings({**base, "GBS": 8}), _settings(base)) == (
        f"node 1's settings differ from node 0's: GBS=8 on node 1, GBS=4 on node 0{end}"
    )
    # booleans as the variables are written, an unset one as such; the variables alone where they differ
    changed = {**base, "MOE": True, "CKPT_SAVE": None}
    assert line(_settings(changed, "--foo"), _settings(base), also=(3, 7)) == (
        "node 1's settings differ from node 0's: CKPT_SAVE unset on node 1, CKPT_SAVE=/shared/ckpt on node 0; "
        f"MOE=1 on node 1, MOE=0 on node 0; node(s) 3, 7 differ too{end}"
    )
    # the variables agree: the user's flags that differ, a value, a switch, a flag on one node alone
    theirs = _settings(base, "--lr", "1e-4", "--log-throughput", "--recompute-granularity", "full")
    ours = _settings(base, "--lr", "2e-3", "--use-flash-attn")
    assert line(theirs, ours) == (
        "node 1's settings differ from node 0's: --log-throughput on node 1, no --log-throughput on node 0; "
        "--lr 1e-4 on node 1, --lr 2e-3 on node 0; --recompute-granularity full on node 1, no "
        f"--recompute-granularity on node 0; and 1 more{end}"
    )


def test_node_0_names_the_first_node_whose_fingerprint_differs(monkeypatch):
    """Each node's settings in one store, as the roll call writes them before its name: node 0's verdict
    names node 2 (and node 3, which differs too); a node started by torchrun directly carries none and is
    not compared, and nor is any node where node 0 carries none."""
    from torch.distributed import HashStore

    from examples.multimodal_dev.launcher import roll_call

    def meet(*settings: str | None) -> str | None:
        store, names = HashStore(), [f"run/roll_call/node{n}" for n in range(len(settings))]
        for name, given in zip(names, settings):
            if given is None:
                monkeypatch.delenv(roll_call.SETTINGS_VARIABLE, raising=False)
            else:
                monkeypatch.setenv(roll_call.SETTINGS_VARIABLE, given)
            roll_call._write_settings(store, name)
        return roll_call._disagreement(store, names)

    same, other = _settings(dict(GBS=4)), _settings(dict(GBS=8))
    assert meet(same, None, other, other) == (
        "node 2's settings differ from node 0's: GBS=8 on node 2, GBS=4 on node 0; node(s) 3 differ too "
        "(every node runs the script with the same settings)"
    )
    assert meet(same, same, None) is None and meet(None, same, other) is None

"""Fault injection for training-run tests, loaded by Python at start-up when this folder is on
PYTHONPATH (``tests/launch.py`` puts it there only for a run that asks):

    KILL_DURING_SAVE_AT=N   SIGKILL the whole job (its process group: torchrun, every rank and
                            their helper processes, as when a node dies) right after the shards of
                            iteration N's checkpoint are written, before megatron records it as the
                            latest. Killing one rank alone would orphan megatron's checkpoint-writer
                            manager process, which keeps the job's output pipes open.
    KILL_NODE_AT=N          SIGKILL this node (its launcher's process group, as KILL_DURING_SAVE_AT) as
                            its ranks start iteration N's step: a node that dies mid-run.
    NODE_LOCAL_SAVE=DIR     this node's ranks save into DIR where their --save names the run's folder:
                            a node-local disk mounted at the path every node is given.
    FULL_DISK_AT=N          the shard files of iteration N's save fill the disk: megatron's writer
                            gets ENOSPC after 4 KiB, as from a real full disk.
    RECORD_PIPELINE=DIR     every rank writes DIR/rank<R>.json: its pipeline rank, the parameter
                            names of each model chunk it built, and the shape and dtype of every
                            tensor it sent to another pipeline stage.
    VISION_GRAD_NORMS=FILE  every rank R appends to FILE.R, after each step's gradient finalisation,
                            the squared norms of its vision tower's gradients, TP-split weights
                            ("split") and the others ("whole"): the tower's norm is rank 0's whole
                            plus the split of the ranks of its first vision TP group. Under the
                            distributed optimizer with more than one data-parallel rank ("sharded"),
                            of the rank's shard only: the sum over the tower's ranks (tests/launch.py).
    CUT_VISION_GRAD=1       the vision bridge, or the tower on ranks of its own, hands the language
                            model detached features: no gradient reaches the tower (what a broken
                            backward would do).

    MEGATRON_CPU_FLA=1 with TRITON_INTERPRET=1
                            not a fault: FLA's kernels in a training run on a CPU host, with the two
                            changes Triton's interpreter needs for them (tests/fla_cpu/triton_interpreter.py)
                            made before any kernel runs.

    ENGINE_SERVER=SOCKET    not a fault either: the torchrun launcher hands its launch to the tests' warm
                            engine at SOCKET (tests/warm_engine.py), which imported the engine once.

The training code itself carries no test hooks."""

import os
import sys

# The tests' warm engine: the torchrun launcher (python -m examples.multimodal_dev.launcher.torchrun ...)
# hands its arguments to the server before it imports anything, and ends with the job's status; a server
# that refuses the launch or does not answer has said why, and the launcher starts cold
_TORCHRUN = ["-m", "examples.multimodal_dev.launcher.torchrun"]
if os.environ.get("ENGINE_SERVER") and sys.orig_argv[1:3] == _TORCHRUN:  # as launcher/launch.py execs it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from engine_handover import hand_over

    del sys.path[0]
    _status = hand_over(sys.orig_argv[3:])
    if _status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status)

# A training rank: torchrun's fresh interpreter for one (it sets RANK), or the forkserver every rank forks from
# where the launcher forks them (examples/multimodal_dev/launcher/torchrun.py), or the warm engine's
# launcher, which holds the engine and which that forkserver forks from (tests/warm_engine.py runs this
# file there); the rank reads RANK when it records
_RANK_PROCESS = (
    "RANK" in os.environ
    or any("multiprocessing.forkserver" in arg for arg in sys.orig_argv)
    or "megatron.training" in sys.modules
)
# Every hook is for the ranks alone: the run script's launcher (launcher/launch.py) and the
# launcher start with this folder on PYTHONPATH too, and a hook's imports (megatron-core, Triton) would
# cost each of them seconds

if os.environ.get("KILL_DURING_SAVE_AT") and _RANK_PROCESS:
    import re
    import signal

    from megatron.core import dist_checkpointing

    _save = dist_checkpointing.save

    def _save_then_die(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = _save(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        match = re.search(r"iter_(\d+)", str(checkpoint_dir))
        if match and int(match.group(1)) == int(os.environ["KILL_DURING_SAVE_AT"]):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return result

    dist_checkpointing.save = _save_then_die

if os.environ.get("KILL_NODE_AT") and _RANK_PROCESS:
    import signal

    from megatron.training import training

    _train_step, _steps = training.train_step, [0]

    def _train_step_or_die(*args, **kwargs):
        _steps[0] += 1
        if _steps[0] == int(os.environ["KILL_NODE_AT"]):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return _train_step(*args, **kwargs)

    training.train_step = _train_step_or_die

if os.environ.get("NODE_LOCAL_SAVE") and _RANK_PROCESS:
    from megatron.training import arguments

    _validate_args = arguments.validate_args

    def _validate_args_saving_here(args, *more, **kwargs):
        if args.save:
            args.save = os.environ["NODE_LOCAL_SAVE"]
        return _validate_args(args, *more, **kwargs)

    arguments.validate_args = _validate_args_saving_here

if os.environ.get("FULL_DISK_AT") and _RANK_PROCESS:
    import builtins
    import errno
    import io
    import re

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class _FillingFile(io.FileIO):
        """A shard file on a disk with 4 KiB left: the write that crosses it fails with ENOSPC,
        inside megatron's checkpoint writer as the real disk would."""

        left = 4096

        def write(self, data):
            size = len(memoryview(data))
            if size > _FillingFile.left:
                raise OSError(errno.ENOSPC, "No space left on device", self.name)
            _FillingFile.left -= size
            return super().write(data)

    def _open_on_a_full_disk(file, mode="r", *args, **kwargs):
        match = re.search(r"iter_(\d+)", str(file))
        if "w" in mode and match and int(match.group(1)) == int(os.environ["FULL_DISK_AT"]):
            return _FillingFile(file, mode.replace("b", ""))
        return builtins.open(file, mode, *args, **kwargs)

    filesystem_async.open = _open_on_a_full_disk  # the writer's module-level name for open()

if os.environ.get("RECORD_PIPELINE") and _RANK_PROCESS:  # training ranks only
    import atexit
    import json

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.training import training

    _record = {"chunks": [], "sent": []}
    _communicate, _get_model = p2p_communication.P2PCommunicator._communicate, training.get_model

    def _recording_communicate(self, *args, tensor_send_next=None, tensor_send_prev=None, **kwargs):
        for tensor in (tensor_send_next, tensor_send_prev):
            if tensor is not None:
                _record["sent"].append([list(tensor.shape), str(tensor.dtype)])
        return _communicate(self, *args, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev, **kwargs)

    def _recording_get_model(*args, **kwargs):
        model = _get_model(*args, **kwargs)
        _record["chunks"] = [[name for name, _ in chunk.named_parameters()] for chunk in model]
        _record["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        return model

    def _write():
        if "RANK" not in os.environ:  # the forkserver's own exit: not a rank
            return
        with open(os.path.join(os.environ["RECORD_PIPELINE"], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(_record, f)

    p2p_communication.P2PCommunicator._communicate = _recording_communicate
    training.get_model = _recording_get_model
    atexit.register(_write)

if os.environ.get("VISION_GRAD_NORMS") and _RANK_PROCESS:  # training ranks only
    import json

    from megatron.core.utils import unwrap_model
    from megatron.training import training

    from examples.multimodal_dev.models.common import vision_bridge
    from examples.multimodal_dev.vision_ranks import groups as vision_ranks

    def _sharded(chunk) -> bool:
        """The distributed optimizer reduce-scatters ``chunk``'s gradients over more than one rank
        (else every rank holds them reduced whole)."""
        return any(
            group.ddp_config.use_distributed_optimizer and group.intra_distributed_optimizer_instance_size > 1
            for group in getattr(chunk, "bucket_groups", ())
        )

    def _reduced_parts(chunk, tower):
        """(param, the part of its gradient this rank holds reduced): all of it, or where the gradients
        are sharded, what lies in this rank's shard of its bucket (the rest is a partial sum)."""
        if not _sharded(chunk):
            yield from ((p, getattr(p, "main_grad", p.grad)) for p in tower)
            return
        for group in chunk.bucket_groups:
            size, rank = (
                group.intra_distributed_optimizer_instance_size,
                group.intra_distributed_optimizer_instance_rank,
            )
            for bucket in group.buckets:
                shard = bucket.grad_data.numel() // size
                low, high = rank * shard, (rank + 1) * shard
                for p, (start, end) in bucket.param_to_index.items():
                    if p in tower and max(start, low) < min(end, high):
                        yield p, p.main_grad.view(-1)[max(start, low) - start : min(end, high) - start]

    def _recording(finalize):
        def finalize_and_record(model, *args, **kwargs):
            finalize(model, *args, **kwargs)
            squares = {"split": 0.0, "whole": 0.0, "sharded": False}  # TP-split weights, and the others
            for chunk in model:
                tower = getattr(unwrap_model(chunk), "vision_model", None)
                tower = set(tower.parameters()) if tower is not None else set()
                squares["sharded"] |= _sharded(chunk)
                for p, grad in _reduced_parts(chunk, tower):
                    part = "split" if getattr(p, "tensor_model_parallel", False) else "whole"
                    squares[part] += float(grad.double().pow(2).sum())
            with open(f"{os.environ['VISION_GRAD_NORMS']}.{os.environ['RANK']}", "a") as f:
                f.write(json.dumps(squares) + "\n")

        return finalize_and_record

    # the default finalisation, and the ones a vision tower on its own layout or ranks installs
    training.finalize_model_grads = _recording(training.finalize_model_grads)
    vision_bridge.finalize_model_grads = _recording(vision_bridge.finalize_model_grads)
    vision_ranks.finalize_model_grads = _recording(vision_ranks.finalize_model_grads)

if os.environ.get("CUT_VISION_GRAD") == "1" and _RANK_PROCESS:  # training ranks only
    from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator

    _bridge_communicate = ColocatedBridgeCommunicator.communicate
    ColocatedBridgeCommunicator.communicate = lambda self, tensor: _bridge_communicate(self, tensor.detach())

    from examples.multimodal_dev.vision_ranks.stage import VisionStage  # the tower on ranks of its own

    _stage_forward = VisionStage.forward
    VisionStage.forward = lambda self, *args, **kwargs: _stage_forward(self, *args, **kwargs).detach()

if os.environ.get("MEGATRON_CPU_FLA") == "1" and os.environ.get("TRITON_INTERPRET") == "1" and _RANK_PROCESS:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fla_cpu"))
    import triton_interpreter

    triton_interpreter.install()

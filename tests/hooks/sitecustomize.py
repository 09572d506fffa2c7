"""Fault injection for training-run tests, loaded by Python at start-up when this folder is on
PYTHONPATH (``tests/launch.py`` puts it there only for a run that asks):

    KILL_DURING_SAVE_AT=N   SIGKILL the whole job (its process group: torchrun, every rank and
                            their helper processes, as when a node dies) right after the shards of
                            iteration N's checkpoint are written, before megatron records it as the
                            latest. Killing one rank alone would orphan megatron's checkpoint-writer
                            manager process, which keeps the job's output pipes open.

The training code itself carries no test hooks."""

import os

if os.environ.get("KILL_DURING_SAVE_AT"):
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

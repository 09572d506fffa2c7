"""Fault injection for training-run tests, loaded by Python at start-up when this folder is on
PYTHONPATH (``tests/launch.py`` puts it there only for a run that asks):

    KILL_DURING_SAVE_AT=N   SIGKILL every rank right after the shards of iteration N's checkpoint
                            are written, before megatron records the checkpoint as the latest

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
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = _save_then_die

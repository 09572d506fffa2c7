"""The torch_dist writer's results queue, made by a forked process instead of a spawned one.

megatron-core's checkpoint writer (``FileSystemWriterAsync``, which synchronous saves use too)
reports each rank's writes through a ``multiprocessing`` manager's queue, made on the rank's first
save with the 'spawn' start method. A spawned manager is a new interpreter that imports the
launching module again: torch, megatron-core and this example, about 8 s of CPU for every rank of
a run that saves, all at once on the first save (24 s of a 51 s run at 3 ranks on a 2-core host).
megatron's persistent async worker makes the same queue with 'fork'; ``install()`` does too, at
start, before any thread or process group exists (a fork copies only the calling thread), so the
first save finds the queue made. The manager serves the queue only; it never touches a device.
"""

from __future__ import annotations


def install() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue(mp_mode="fork")

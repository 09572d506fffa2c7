"""The torch_dist writer's results queue, made by a forked process instead of a spawned one.

megatron-core's checkpoint writer (``FileSystemWriterAsync``, which synchronous saves use too)
reports each rank's writes through a ``multiprocessing`` manager's queue, made on the rank's first
save with the 'spawn' start method. A spawned manager is a new interpreter that imports the
launching module again: torch, megatron-core and this example, about 8 s of CPU for every rank of
a run that saves, all at once on the first save (24 s of a 51 s run at 3 ranks on a 2-core host).
megatron's persistent async worker makes the same queue with 'fork'; ``install()`` does too. A
training run calls it at start, before any thread or process group exists (a fork copies only the
calling thread); a model-only save calls it before megatron's writer writes (the HF import writes
through torch's own writer, which needs none). The manager serves the queue only; it
never touches a device.

megatron keeps the queue for the life of the process. A process that writes several checkpoints
(a converter called in-process) may outlive the manager (a test's clean-up, a signal), and every
later save would then stop on "Broken pipe"; ``install()`` replaces a queue whose manager is gone.

A row of ``megatron_changes`` (group ``writer-queue-by-fork``), applied by this call: it sets a value
that the table's applier, which wraps functions once a process, does not fit.
"""

from __future__ import annotations


def install() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        try:
            queue.qsize()  # a call to the manager: fails once it is gone
        except (OSError, EOFError):
            filesystem_async._results_queue = None
    filesystem_async.get_write_results_queue(mp_mode="fork")

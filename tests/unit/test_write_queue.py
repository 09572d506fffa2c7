"""The checkpoint writer's results queue (checkpoint/write_queue.py): made by a forked manager, not a
spawned interpreter, and made again when its manager is gone (a later save would stop on "Broken
pipe")."""

import multiprocessing.context

from megatron.core.dist_checkpointing.strategies import filesystem_async

from examples.multimodal_dev.checkpoint import write_queue


def test_the_queue_comes_from_a_fork_and_a_dead_manager_is_replaced():
    before = filesystem_async._results_queue
    filesystem_async._results_queue = None
    try:
        write_queue.install()
        first = filesystem_async._results_queue
        assert isinstance(first._manager._process, multiprocessing.context.ForkProcess)
        write_queue.install()
        assert filesystem_async._results_queue is first  # a live one is kept

        first._manager._process.kill()
        first._manager._process.join()
        write_queue.install()
        second = filesystem_async._results_queue
        assert second is not first and second._manager._process.is_alive()
        second.put("written")
        assert second.get() == "written"
        second._manager.shutdown()
    finally:
        filesystem_async._results_queue = before

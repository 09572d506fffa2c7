import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The example is the package examples.multimodal_dev (and the device layer megatron.cpu) under the
# repository root: this process imports it from there, and so does every process a test starts
# (torchrun workers, the run script, the tools), through PYTHONPATH. The tests' own helpers
# (hf_reference, launch, ...) import from this folder.
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402  (after the paths above: the tests' helpers import from them)


@pytest.fixture(autouse=True)
def fresh_moe_metrics():
    """megatron-core keeps one MoE metrics tracker a process, sized by the first MoE model that records into
    it; the tests sharing a worker build models of other layer counts (an index past its size otherwise)."""
    yield
    logging_module = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if logging_module is not None:
        logging_module.destroy_moe_metrics_tracker()


@pytest.fixture(scope="session", autouse=True)
def no_writer_manager_outlives_the_session():
    """An in-process checkpoint save (an HF import) forks megatron's writer-queue manager from this
    process (checkpoint/write_queue.py). A pytest-xdist worker ends without running the exit handlers
    that would stop it, so the manager lived on after the run, holding every file the worker had open
    when it forked (1.6 GB resident, seen after CI runs). It is stopped here."""
    yield
    strategies = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(strategies, "_results_queue", None)
    if queue is not None:
        try:
            queue._manager.shutdown()
        except (OSError, EOFError, AttributeError):  # already gone, or not a manager's queue
            pass


@pytest.fixture(scope="session")
def mcore():
    """megatron-core initialised for a single CPU process (gloo, world size 1)."""
    from megatron.cpu.single_process import init_single_process

    init_single_process()


@pytest.fixture(scope="module")
def no_process_group():
    """Meta builds (``planner/meta_builds.py``) make their own fake world; a single-process group of
    another test is put back afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    had = dist.is_initialized()
    if had:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    yield
    if had:
        from megatron.cpu.single_process import init_single_process

        init_single_process()


# The engine tests (marker ``engine``) are the folder tests/distributed.
ENGINE_TESTS = os.path.join(ROOT, "tests", "distributed") + os.sep


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(ENGINE_TESTS):
            item.add_marker(pytest.mark.engine)
    # The tests that wait on the package index go first: a worker that waits on a download lends its
    # core to the other's tests, where at the end of the run it would leave that core idle
    items.sort(key=lambda item: item.get_closest_marker("network") is None)

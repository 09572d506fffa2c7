import pytest
from launch import NO_EVAL, PARALLEL_MODEL, run_script


@pytest.fixture(scope="session")
def parallel_start(tmp_path_factory):
    """One saved checkpoint (one single-process step) that every layout starts from."""
    path = tmp_path_factory.mktemp("parallel") / "start"
    run_script(NO_EVAL, CKPT_SAVE=path, TRAIN_ITERS=1, MBS=4, GBS=8, **PARALLEL_MODEL).check()
    return path

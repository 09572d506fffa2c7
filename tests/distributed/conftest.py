import pytest
from launch import LAYOUT_MODEL, NO_EVAL, run_recording_vision_norms, run_script


@pytest.fixture(scope="session")
def parallel_start(tmp_path_factory):
    """One saved checkpoint (one single-process step) that every layout starts from."""
    path = tmp_path_factory.mktemp("parallel") / "start"
    run_script(NO_EVAL, CKPT_SAVE=path, TRAIN_ITERS=1, **LAYOUT_MODEL).check()
    return path


# The single-process references every layout is held to, run once a session: 3 steps from
# parallel_start, with the tower's grad norm recorded.
@pytest.fixture(scope="session")
def one_process(parallel_start, tmp_path_factory):
    """Micro-batches of 4 samples: (run, vision grad norms)."""
    return run_recording_vision_norms(
        tmp_path_factory.mktemp("one_process"), "single", CKPT_LOAD=parallel_start, TRAIN_ITERS=3, **LAYOUT_MODEL
    )


@pytest.fixture(scope="session")
def one_process_per_sample(parallel_start, tmp_path_factory):
    """Micro-batches of one sample, some with no image: (run, vision grad norms)."""
    return run_recording_vision_norms(
        tmp_path_factory.mktemp("one_process_mbs1"),
        "single",
        CKPT_LOAD=parallel_start,
        TRAIN_ITERS=3,
        **{**LAYOUT_MODEL, "MBS": 1},
    )

"""The checkpoint-save guard: which failures mean a full disk, what it removes, what it reports."""

import errno

import pytest

from examples.multimodal_dev.checkpoint import save_guard


def test_out_of_space_is_recognised_through_wrapping():
    assert save_guard.out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = RuntimeError("CheckpointException ranks:dict_keys([0])")
    wrapped.__cause__ = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4054")
    assert save_guard.out_of_space(wrapped)
    assert not save_guard.out_of_space(OSError(errno.EACCES, "Permission denied"))


def test_failed_save_removes_only_its_own_directory(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")

    class Args:
        save = str(tmp_path)

    def full(iteration, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SystemExit, match=r"no space left on .* while saving iteration 2: removed the partial .*"
                                         r"iter_0000002; the last complete checkpoint is iteration 1"):
        save_guard.guarded(full, lambda: Args)(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_directories_newer_than_the_tracker_are_reported(tmp_path):
    for name in ("iter_0000002", "iter_0000004", "iter_0000006", "other"):
        (tmp_path / name).mkdir()
    assert save_guard.stale_directories(str(tmp_path)) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert save_guard.stale_directories(str(tmp_path)) == ["iter_0000006"]
    assert save_guard.stale_directories(None) == []


def test_incomplete_saves_are_removed_and_complete_ones_kept(tmp_path):
    """A killed save leaves iter_N without DCP's .metadata: removed at the next start. A complete
    checkpoint newer than a tracker rolled back by hand is kept and named."""
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    for name in ("iter_0000002", "iter_0000004", "iter_0000006"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"\0" * 10)
    (tmp_path / "iter_0000006" / ".metadata").write_bytes(b"index")
    lines = save_guard.clear_incomplete_saves(str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000006"]
    assert lines == [f"removed {tmp_path / 'iter_0000004'}: a save that did not finish (newer than "
                     "latest_checkpointed_iteration.txt, no .metadata)",
                     f"{tmp_path / 'iter_0000006'} is complete but newer than latest_checkpointed_iteration.txt; it "
                     "is overwritten when training reaches that iteration"]


def test_a_full_disk_is_recognised_from_what_the_writer_logged(tmp_path):
    """megatron's writer reports its worker's ENOSPC as "error: <class 'OSError'>" and logs the
    text; the guard reads the log line."""
    import logging

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")

    class Args:
        save = str(tmp_path)

    def writer_fails(iteration, *args, **kwargs):
        (tmp_path / "iter_0000002").mkdir()
        logging.getLogger(save_guard._WriterErrors.LOGGER).error(
            "Local worker 0 encountered an error: [Errno 28] No space left on device")
        raise RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")

    def other_failure(iteration, *args, **kwargs):
        raise RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")

    logger = logging.getLogger(save_guard._WriterErrors.LOGGER)
    logger.addHandler(save_guard._writer_errors)
    try:
        with pytest.raises(SystemExit, match=r"while saving iteration 2: removed the partial"):
            save_guard.guarded(writer_fails, lambda: Args)(2)
        assert not (tmp_path / "iter_0000002").exists()
        with pytest.raises(RuntimeError, match="Worker failure"):  # the log of an earlier save does not count
            save_guard.guarded(other_failure, lambda: Args)(3)
    finally:
        logger.removeHandler(save_guard._writer_errors)

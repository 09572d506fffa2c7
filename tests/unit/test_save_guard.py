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
    dcp = BaseException("CheckpointException ranks:dict_keys([0])")  # DCP keeps the writers' errors in failures
    dcp.failures = {0: (OSError(errno.ENOSPC, "No space left on device"), "traceback")}
    assert save_guard.out_of_space(dcp)


def test_failed_save_removes_only_its_own_directory(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")

    with pytest.raises(
        SystemExit,
        match=r"no space left on .* while saving iteration 2: removed the partial .*"
        r"iter_0000002; the last complete checkpoint is iteration 1",
    ):
        with save_guard.full_disk_in_one_line(str(tmp_path), 2):
            raise OSError(errno.ENOSPC, "No space left on device")
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
    assert lines == [
        f"removed {tmp_path / 'iter_0000004'}: a save that did not finish (newer than "
        "latest_checkpointed_iteration.txt, no .metadata)",
        f"{tmp_path / 'iter_0000006'} is complete but newer than latest_checkpointed_iteration.txt; it "
        "is overwritten when training reaches that iteration",
    ]


def test_a_full_disk_is_recognised_from_what_the_writer_logged(tmp_path):
    """megatron's writer reports its worker's ENOSPC as "error: <class 'OSError'>" and logs the
    text; the guard reads the log line."""
    import logging

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")

    def writer_fails():
        (tmp_path / "iter_0000002").mkdir()
        logging.getLogger(save_guard.WriterLog.LOGGER).error(
            "Local worker 0 encountered an error: [Errno 28] No space left on device"
        )
        raise RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")

    def other_failure():
        raise RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")

    logger = logging.getLogger(save_guard.WriterLog.LOGGER)
    save_guard.listen_to_the_writer()
    save_guard.listen_to_the_writer()
    assert logger.handlers.count(save_guard._writer_errors) == 1
    try:
        with pytest.raises(SystemExit, match=r"while saving iteration 2: removed the partial"):
            with save_guard.full_disk_in_one_line(str(tmp_path), 2):
                writer_fails()
        assert not (tmp_path / "iter_0000002").exists()
        with pytest.raises(RuntimeError, match="Worker failure"):  # the log of an earlier save does not count
            with save_guard.full_disk_in_one_line(str(tmp_path), 3):
                other_failure()
    finally:
        logger.removeHandler(save_guard._writer_errors)


def test_the_save_hooks_run_in_order_and_a_full_disk_after_the_save_is_one_line(tmp_path, monkeypatch):
    """save_hooks.py: before-hooks, megatron's save, after-hooks, all inside the full-disk guard."""
    from examples.multimodal_dev.checkpoint import save_hooks

    calls = []

    class Args:
        save = str(tmp_path)

    def after(iteration, args):
        calls.append(("after", iteration, args.save))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_hooks, "BEFORE", (lambda iteration, model, args: calls.append(("before", model)),))
    monkeypatch.setattr(save_hooks, "AFTER", (after,))
    save = save_hooks.with_save_hooks(lambda iteration, model: calls.append(("save", iteration)), get_args=lambda: Args)
    with pytest.raises(
        SystemExit,
        match=r"while saving iteration 3: removed the partial .*iter_0000003; the last "
        r"complete checkpoint is none",
    ):
        save(3, "model")
    assert calls == [("before", "model"), ("save", 3), ("after", 3, str(tmp_path))]

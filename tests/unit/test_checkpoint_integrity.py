"""A damaged latest checkpoint is named before megatron reads it: the file, and the newest earlier
iteration that is whole (a deleted or truncated shard, a deleted or garbage index, a deleted
metadata.json); a whole checkpoint passes."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from examples.multimodal_dev.checkpoint import save_hooks, shard_checksums
from examples.multimodal_dev.checkpoint.integrity import check_resumable, damage


def _iteration(root, n):
    directory = root / f"iter_{n:07d}"
    dcp.save({"weight": torch.arange(4096.0), "bias": torch.ones(8)}, checkpoint_id=str(directory), no_dist=True)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    shard_checksums.record(str(directory), 0)
    (root / "latest_checkpointed_iteration.txt").write_text(str(n))
    return directory


def _overwrite_4k(directory):
    """A failing disk or a broken copy: 4 KiB inside the weight's bytes, the file's length kept."""
    with open(_shard(directory), "r+b") as f:
        f.seek(1024)
        f.write(b"\xa5" * 4096)


def _shard(directory):
    return next(p for p in directory.iterdir() if p.suffix == ".distcp")


def _link_outside(directory):
    """The shard replaced by a link to a file of the user's, long enough to pass as the shard."""
    secret = directory.parent / "secret"
    secret.write_bytes(b"\xa5" * (1 << 16))
    shard = _shard(directory)
    os.remove(shard)
    os.symlink(secret, shard)


DAMAGE = {
    "shard deleted": (lambda d: os.remove(_shard(d)), r"__0_0.distcp is missing"),
    "shard truncated": (
        lambda d: open(_shard(d), "r+b").truncate(100),
        r"__0_0.distcp is truncated \(100 of \d+ bytes\)",
    ),
    "4 KiB overwritten": (_overwrite_4k, r"__0_0.distcp is not the file that was saved \(crc32 \w{8}, saved \w{8}\)"),
    "index deleted": (lambda d: os.remove(d / ".metadata"), r"/.metadata is missing"),
    "index garbage": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), r"/.metadata cannot be read"),
    "metadata.json deleted": (lambda d: os.remove(d / "metadata.json"), r"metadata.json is missing"),
    "shard linked outside": (
        lambda d: _link_outside(d),
        r"__0_0.distcp is a link to .*/secret, outside the checkpoint",
    ),
    "legacy layout": (
        lambda d: (
            [shutil.rmtree(p) if p.is_dir() else os.remove(p) for p in d.iterdir()] and (d / "mp_rank_00").mkdir()
        ),
        r"mp_rank_00 is a legacy megatron checkpoint \(whole pickles\), which this project does not load",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_latest_iteration_names_the_file_and_the_way_back(tmp_path, kind):
    _iteration(tmp_path, 2)
    latest = _iteration(tmp_path, 4)
    check_resumable(str(tmp_path))  # whole
    assert damage(str(latest)) is None
    harm, what = DAMAGE[kind]
    harm(latest)
    with pytest.raises(
        ValueError,
        match=rf"--load {tmp_path}: the latest checkpoint \(iteration 4\) is damaged: "
        rf".*{what}.*; iteration 2 is complete: resume from it by writing 2 into "
        rf".*latest_checkpointed_iteration.txt",
    ):
        check_resumable(str(tmp_path))
    shutil.rmtree(tmp_path / "iter_0000002")
    with pytest.raises(ValueError, match="no earlier iteration in it is complete"):
        check_resumable(str(tmp_path))


def test_a_planted_global_in_the_index_is_refused_as_code_not_called_damage(tmp_path):
    import pickle

    from examples.multimodal_dev.checkpoint.safety import refusal

    class Plant:
        def __reduce__(self):
            return os.system, ("true",)

    latest = _iteration(tmp_path, 2)
    (latest / ".metadata").write_bytes(pickle.dumps(Plant()))
    with pytest.raises(Exception) as err:
        check_resumable(str(tmp_path))
    assert "it names 'posix.system', which is not checkpoint data" in refusal(err.value)


def test_links_inside_the_checkpoint_are_its_own(tmp_path):
    latest = _iteration(tmp_path, 2)
    shard = _shard(latest)
    os.rename(shard, latest / "moved.bin")
    os.symlink("moved.bin", shard)
    assert damage(str(latest)) is None


def test_a_checkpoint_saved_without_checksums_is_read_unchecked(tmp_path):
    latest = _iteration(tmp_path, 2)
    shutil.rmtree(latest / shard_checksums.RECORD_DIR)
    _overwrite_4k(latest)
    assert damage(str(latest)) is None


def test_ranks_check_the_recorded_files_in_shares(tmp_path):
    latest = _iteration(tmp_path, 2)
    names = sorted(shard_checksums.recorded(str(latest)))
    assert names == [".metadata", "__0_0.distcp", "metadata.json"]
    _overwrite_4k(latest)  # the second file: rank 1 of 2 finds it, rank 0 of 2 does not read it
    assert damage(str(latest), 0, 2) is None
    assert "__0_0.distcp is not the file that was saved" in damage(str(latest), 1, 2)


def test_an_async_save_records_its_checksums_when_megatron_finalizes_it(tmp_path):
    """With --async-save the files are written after save_checkpoint returns: the record is made by
    the request's finalize step, after every rank's writes, not by the after-save hook."""

    class Request:
        def __init__(self):
            self.finalize_fns = []

        def add_finalize_fn(self, fn):
            self.finalize_fns.append(fn)

    args = SimpleNamespace(save=str(tmp_path), async_save=True)
    scheduled = []
    schedule = save_hooks.with_checksums_recorded(scheduled.append)
    save_hooks._expect_async_save(2, None, args)
    request = Request()
    schedule(request)
    latest = _iteration(tmp_path, 2)
    shutil.rmtree(latest / shard_checksums.RECORD_DIR)
    save_hooks._record_checksums(2, args)  # the hook leaves an async save alone
    assert scheduled == [request] and not (latest / shard_checksums.RECORD_DIR).exists()
    for fn in request.finalize_fns:
        fn()
    assert sorted(shard_checksums.recorded(str(latest))) == [".metadata", "__0_0.distcp", "metadata.json"]
    schedule(Request())  # the next request (another save's) records nothing of this one

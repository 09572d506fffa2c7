"""A damaged latest checkpoint is named before megatron reads it: the file, and the newest earlier
iteration that is whole (a deleted or truncated shard, a deleted or garbage index, a deleted
metadata.json); a whole checkpoint passes."""

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from examples.multimodal_dev.checkpoint.integrity import check_resumable, damage


def _iteration(root, n):
    directory = root / f"iter_{n:07d}"
    dcp.save({"weight": torch.arange(4096.0), "bias": torch.ones(8)}, checkpoint_id=str(directory), no_dist=True)
    (directory / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / "latest_checkpointed_iteration.txt").write_text(str(n))
    return directory


def _shard(directory):
    return next(p for p in directory.iterdir() if p.suffix == ".distcp")


def _link_outside(directory):
    """The shard replaced by a link to a file of the user's, long enough to pass as the shard."""
    secret = directory.parent / "secret"
    secret.write_bytes(os.urandom(1 << 16))
    shard = _shard(directory)
    os.remove(shard)
    os.symlink(secret, shard)


DAMAGE = {
    "shard deleted": (lambda d: os.remove(_shard(d)), r"__0_0.distcp is missing"),
    "shard truncated": (
        lambda d: open(_shard(d), "r+b").truncate(100),
        r"__0_0.distcp is truncated \(100 of \d+ bytes\)",
    ),
    "index deleted": (lambda d: os.remove(d / ".metadata"), r"/.metadata is missing"),
    "index garbage": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), r"/.metadata cannot be read"),
    "metadata.json deleted": (lambda d: os.remove(d / "metadata.json"), r"metadata.json is missing"),
    "shard linked outside": (
        lambda d: _link_outside(d),
        r"__0_0.distcp is a link to .*/secret, outside the checkpoint",
    ),
    "legacy layout": (
        lambda d: [os.remove(p) for p in d.iterdir()] and (d / "mp_rank_00").mkdir(),
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

"""convert_checkpoint.py against user-reported faults: an export aimed at its own checkpoint, a tensor
saved in two shards, verify on a pair of different models or a mistyped path, invalid JSON, a
damaged tracker, checkpoints this tool must not unpickle, and a disk that fills during an import.
Each is refused in one line naming the flag, file or value, and leaves nothing new behind."""

import errno
import json
import os
import pickle
import shutil

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint

from examples.multimodal_dev.checkpoint import verify as verify_mod
from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.checkpoint.hf_safetensors import INDEX, HFTensorSource
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory, mcore):
    path = tmp_path_factory.mktemp("hf_dense")
    write_hf_checkpoint(path, get_variant("tiny", moe=False, mtp=False), dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(hf_dense, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mg") / "ckpt")
    import_hf(hf_dense, path)
    return path


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"convert_checkpoint {command}: error: "), err
    print(lines[0])
    return lines[0]


def _tree(path) -> dict:
    """Every file under ``path`` with its bytes, and every folder (None): what "nothing changed" compares."""
    out = {}
    for root, dirs, files in os.walk(path):
        out.update({os.path.relpath(os.path.join(root, d), path): None for d in dirs})
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


# ---------------------------------------------------- 1: export onto (or around) its own checkpoint


@pytest.mark.parametrize("where", ["same", "ancestor", "inside", "symlink"])
def test_export_overwrite_never_touches_the_checkpoint(ckpt, tmp_path, capsys, where):
    mg = tmp_path / "runs" / "ckpt"
    shutil.copytree(ckpt, mg)
    before = _tree(tmp_path)
    out = {"same": mg, "ancestor": tmp_path / "runs", "inside": mg / "hf_out", "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        os.symlink(mg, out)
        before = _tree(tmp_path)
    assert main(["export", "--megatron-path", str(mg), "--hf-path", str(out), "--overwrite"]) == 2
    line = _one_error_line(capsys, "export")
    assert f"--hf-path {out}" in line and "Megatron checkpoint" in line, line
    assert _tree(tmp_path) == before, "nothing may be written or removed"


# ---------------------------------------------------------- 2: one tensor in two safetensors files


def _two_shards(path, with_index: bool):
    """``w`` in both files (fp16 in the stale one); the index, if any, names the first file."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"w": torch.ones(3), "a": torch.zeros(2)}, path / "model-a.safetensors")
    save_file({"w": torch.full((3,), 7.0).half(), "b": torch.zeros(2)}, path / "model-b.safetensors")
    if with_index:
        weight_map = {"w": "model-a.safetensors", "a": "model-a.safetensors", "b": "model-b.safetensors"}
        (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text("{}")
    return path


def test_a_tensor_in_two_shards_is_read_from_the_shard_the_index_names(tmp_path):
    source = HFTensorSource(str(_two_shards(tmp_path / "hf", with_index=True)))
    assert torch.equal(source.get("w"), torch.ones(3)) and source.dtypes["w"] == "float32"
    assert source.unconsumed(["w", "a", "b"]) == [] and source.unconsumed(["w"]) == ["a", "b"]


def test_an_index_naming_a_shard_without_the_tensor_is_named(tmp_path):
    hf = _two_shards(tmp_path / "hf", with_index=True)
    (hf / INDEX).write_text(json.dumps({"weight_map": {"w": "model-a.safetensors", "a": "model-b.safetensors"}}))
    with pytest.raises(ValueError, match=r"names tensors their files do not hold: a \(model-b.safetensors\)$"):
        HFTensorSource(str(hf))


def test_a_tensor_in_two_shards_without_an_index_names_both_files(tmp_path, capsys):
    hf = _two_shards(tmp_path / "hf", with_index=False)
    assert main(["import", "--hf-path", str(hf), "--megatron-path", str(tmp_path / "mg")]) == 2
    line = _one_error_line(capsys, "import")
    assert "tensor w is in two files, model-a.safetensors and model-b.safetensors" in line, line
    assert not os.path.exists(tmp_path / "mg")


# ----------------------------------------------------------- 3, 4: verify's inputs checked first


def _copy_with_config(src, dst, **text_changes) -> str:
    shutil.copytree(src, dst)
    config = json.load(open(dst / "config.json"))
    config["text_config"].update(text_changes)
    json.dump(config, open(dst / "config.json", "w"))
    return str(dst)


def test_verify_names_a_different_vocabulary_size(hf_dense, ckpt, tmp_path, capsys):
    vocab = json.load(open(os.path.join(hf_dense, "config.json")))["text_config"]["vocab_size"]
    other = _copy_with_config(hf_dense, tmp_path / "other", vocab_size=vocab + 64)
    assert main(["verify", "--hf-path", other, "--megatron-path", ckpt]) == 2
    line = _one_error_line(capsys, "verify")
    assert f"text.vocab_size {vocab} (checkpoint) vs {vocab + 64} (HF)" in line, line


@pytest.mark.parametrize("flag", ["--hf-path", "--hf-processor-path"])
def test_verify_never_asks_the_hub_for_a_mistyped_local_path(hf_dense, ckpt, tmp_path, monkeypatch, capsys, flag):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError(f"reached transformers with {args} {kwargs}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    paths = {"--hf-path": hf_dense, "--hf-processor-path": hf_dense, flag: "Qwen3.5-9B-typo"}
    assert main(["verify", "--megatron-path", ckpt, "--prompt", "hi", *[a for kv in paths.items() for a in kv]]) == 2
    line = _one_error_line(capsys, "verify")
    assert f"{flag} 'Qwen3.5-9B-typo': no such file or directory" in line and "hf://Qwen3.5-9B-typo" in line, line


def test_verify_loads_local_paths_offline_and_hf_names_from_the_hub(hf_dense, monkeypatch):
    import transformers

    seen = []

    def record(name, **kwargs):
        seen.append((name, kwargs.get("local_files_only")))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record)
    for value in (hf_dense, "hf://Qwen/Qwen3.5-0.8B"):
        with pytest.raises(OSError, match="stop here"):
            verify_mod._hf_model(verify_mod.HFSource(value, "--hf-path"))
    assert seen == [(hf_dense, True), ("Qwen/Qwen3.5-0.8B", False)]


# ------------------------------------------------------------------- 5: invalid JSON is named


@pytest.mark.parametrize(
    "name,text,says",
    [
        ("config.json", "{not json", "not JSON"),
        ("config.json", "[1, 2]", "expected a JSON object"),
        ("config.json", '{"model_type": "qwen3_5"}', "no 'text_config'"),
        (INDEX, "garbage", "not JSON"),
        (INDEX, '{"weight_map": ["model.safetensors"]}', "'weight_map' maps tensor names to file names"),
    ],
)
def test_an_invalid_config_or_index_is_named(hf_dense, tmp_path, capsys, name, text, says):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dense, hf)
    (hf / name).write_text(text)
    assert main(["import", "--hf-path", str(hf), "--megatron-path", str(tmp_path / "mg")]) == 2
    line = _one_error_line(capsys, "import")
    assert str(hf / name) in line and says in line, line
    assert not os.path.exists(tmp_path / "mg")


def test_export_names_an_invalid_hf_config_path(ckpt, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{oops")
    assert (
        main(
            [
                "export",
                "--megatron-path",
                ckpt,
                "--hf-path",
                str(tmp_path / "out"),
                "--hf-config-path",
                str(tmp_path / "bad.json"),
            ]
        )
        == 2
    )
    line = _one_error_line(capsys, "export")
    assert f"{tmp_path / 'bad.json'}: not a valid config.json: not JSON" in line, line
    assert sorted(os.listdir(tmp_path)) == ["bad.json"]


def test_export_names_a_config_of_another_model(ckpt, tmp_path, capsys):
    from examples.multimodal_dev.models.qwen35_vl.configuration import to_hf_config_dict

    (tmp_path / "other.json").write_text(json.dumps(to_hf_config_dict(get_variant("tiny", moe=True, mtp=False))))
    assert (
        main(
            [
                "export",
                "--megatron-path",
                ckpt,
                "--hf-path",
                str(tmp_path / "out"),
                "--hf-config-path",
                str(tmp_path / "other.json"),
            ]
        )
        == 2
    )
    line = _one_error_line(capsys, "export")
    assert f"--hf-config-path {tmp_path / 'other.json'}" in line and "does not describe" in line, line
    assert sorted(os.listdir(tmp_path)) == ["other.json"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["import", "--hf-path", "HF", "--megatron-path", "OUT", "--tp", "0"], "--tp 0: must be at least 1"),
        (["import", "--hf-path", "HF", "--megatron-path", "OUT", "--ep", "-2"], "--ep -2: must be at least 1"),
        (["import", "--hf-path", "FILE", "--megatron-path", "OUT"], "--hf-path FILE: a file; give the Hugging Face"),
        (
            ["export", "--megatron-path", "CKPT", "--hf-path", "OUT", "--max-shard-size-gb", "nan"],
            "--max-shard-size-gb nan: must be a positive finite number",
        ),
        (
            ["verify", "--hf-path", "HF", "--megatron-path", "CKPT", "--atol", "-1"],
            "--atol -1.0: must be a finite number",
        ),
        (
            ["verify", "--hf-path", "HF", "--megatron-path", "CKPT", "--atol", "nan"],
            "--atol nan: must be a finite number",
        ),
    ],
)
def test_numbers_that_cannot_work_are_refused_before_any_work(hf_dense, ckpt, tmp_path, capsys, argv, says):
    (tmp_path / "FILE").write_text("{}")
    paths = {"HF": hf_dense, "CKPT": ckpt, "OUT": str(tmp_path / "out"), "FILE": str(tmp_path / "FILE")}
    assert main([paths.get(a, a) for a in argv]) == 2
    line = _one_error_line(capsys, argv[0])
    assert says.replace("FILE", paths["FILE"]) in line, line
    assert sorted(os.listdir(tmp_path)) == ["FILE"]


# ---------------------------------------------------------------------- 6: a damaged tracker file


def test_export_names_a_damaged_tracker(ckpt, tmp_path, capsys):
    mg = tmp_path / "ckpt"
    shutil.copytree(ckpt, mg)
    (mg / TRACKER).write_text("\x00garbage")
    assert main(["export", "--megatron-path", str(mg), "--hf-path", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys, "export")
    assert f"{mg / TRACKER} holds '\\x00garbage', not an iteration number" in line, line
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# ------------------------------------------------------- 7: checkpoints this tool never unpickles


@pytest.mark.parametrize("layout", ["mp_rank_00/model_optim_rng.pt", "common.pt"])
def test_a_legacy_checkpoint_is_refused_in_one_line(hf_dense, ckpt, tmp_path, capsys, layout):
    mg = tmp_path / "legacy"
    (mg / "iter_0000000" / os.path.dirname(layout)).mkdir(parents=True)
    torch.save({"model": {}}, mg / "iter_0000000" / layout)
    (mg / TRACKER).write_text("0")
    shutil.copy(os.path.join(ckpt, "hf_config.json"), mg / "hf_config.json")
    for command in (["export", "--hf-path", str(tmp_path / "out")], ["verify", "--hf-path", hf_dense]):
        assert main([command[0], "--megatron-path", str(mg), *command[1:]]) == 2
        line = _one_error_line(capsys, command[0])
        assert "is not a torch_dist or fsdp_dtensor checkpoint" in line and layout.split("/")[0] in line, line
    assert not os.path.exists(tmp_path / "out")


class _Plant:
    """Unpickling this runs ``os.system`` (it would create ``path``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_export_refuses_a_planted_pickle_in_one_line(ckpt, tmp_path, capsys):
    mg = tmp_path / "ckpt"
    shutil.copytree(ckpt, mg)
    marker = tmp_path / "ran"
    with open(mg / "iter_0000000" / ".metadata", "wb") as f:
        pickle.dump(_Plant(marker), f)
    assert main(["export", "--megatron-path", str(mg), "--hf-path", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys, "export")
    assert line.endswith(
        f"--megatron-path {mg}: checkpoint refused: {mg / 'iter_0000000' / '.metadata'}: it names "
        "'posix.system', which is not checkpoint data (a checkpoint must never run code)"
    ), line
    assert not marker.exists() and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_export_refuses_a_shard_that_links_outside_the_checkpoint(ckpt, tmp_path, capsys):
    """A downloaded checkpoint whose shard is a link to a file of the user's: its bytes would become
    the exported weights."""
    mg = tmp_path / "ckpt"
    shutil.copytree(ckpt, mg)
    shard = next(p for p in (mg / "iter_0000000").iterdir() if p.suffix == ".distcp")
    secret = tmp_path / "secret"
    secret.write_bytes(b"\xa5" * shard.stat().st_size)
    shard.unlink()
    shard.symlink_to(secret)
    assert main(["export", "--megatron-path", str(mg), "--hf-path", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys, "export")
    assert line.endswith(f"{shard} is a link to {secret}, outside the checkpoint; a checkpoint's files are its own"), (
        line
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "secret"]


def test_export_refuses_a_shard_whose_bytes_changed_since_the_save(ckpt, tmp_path, capsys):
    mg = tmp_path / "ckpt"
    shutil.copytree(ckpt, mg)
    shard = next(p for p in (mg / "iter_0000000").iterdir() if p.suffix == ".distcp")
    with open(shard, "r+b") as f:  # 4 KiB inside the tensors' bytes, the length kept
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xa5" * 4096)
    assert main(["export", "--megatron-path", str(mg), "--hf-path", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys, "export")
    assert f"{shard} is not the file that was saved (crc32 " in line, line
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_verify_refuses_pickled_hf_weights(hf_dense, ckpt, tmp_path, capsys):
    hf = tmp_path / "bin"
    hf.mkdir()
    shutil.copy(os.path.join(hf_dense, "config.json"), hf / "config.json")
    torch.save({"lm_head.weight": torch.zeros(2)}, hf / "pytorch_model.bin")
    assert main(["verify", "--hf-path", str(hf), "--megatron-path", ckpt]) == 2
    line = _one_error_line(capsys, "verify")
    assert "pickled weights (pytorch_model.bin), no *.safetensors" in line, line


# ------------------------------------------------------------------ 8: a disk that fills mid-import


def _full_disk_in_writer(monkeypatch):
    """torch_dist's file writer writes part of a file, then the disk is full."""
    from torch.distributed.checkpoint import filesystem

    def write_then_fail(*args, **kwargs):
        stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "fileno"))  # after the transforms
        stream.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem, "_write_item", write_then_fail)


def _full_disk_at_tracker(monkeypatch):
    """Every tensor written; the tracker is the write that finds the disk full."""
    from examples.multimodal_dev.checkpoint import files

    def fail(path, text):
        open(path + ".tmp", "w").close()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + ".tmp")

    monkeypatch.setattr(files, "write_text_atomic", fail)


@pytest.mark.parametrize("when", ["writer", "tracker"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_during_import_leaves_nothing_new(hf_dense, tmp_path, monkeypatch, capsys, when, existing):
    out = tmp_path / "mg"
    if existing:  # a folder the user made, with a file of their own: kept as it was
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    {"writer": _full_disk_in_writer, "tracker": _full_disk_at_tracker}[when](monkeypatch)
    assert main(["import", "--hf-path", hf_dense, "--megatron-path", str(out)]) == 2
    line = _one_error_line(capsys, "import")
    assert f"--megatron-path {out}: cannot write the checkpoint: No space left on device" in line, line
    assert _tree(tmp_path) == before and os.path.exists(out) == existing

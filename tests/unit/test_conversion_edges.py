"""convert_checkpoint.py at its edges: the hub's per-expert MoE layout both ways, tensors an import
must refuse (a stray dtype, NaN/inf), a corrupt safetensors header, and exports that cannot be
written (a file in the way, a read-only place, a full disk). Every refusal is one line that names
the tensor, file or path, and leaves nothing behind."""

import errno
import json
import os
import re
import shutil
from dataclasses import replace

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint

from examples.multimodal_dev.checkpoint import hf_export
from examples.multimodal_dev.checkpoint.hf_export import export_hf
from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.checkpoint.hf_safetensors import HFTensorSource
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main

LM = "model.language_model.layers."


@pytest.fixture(scope="module")
def hub_moe(tmp_path_factory, mcore):
    """A bf16 MoE checkpoint in the hub layout (one tensor per expert, MTP head included); expert
    FFN 64 against hidden 128, so a gate/down transposition would change a shape."""
    shape = get_variant("tiny", moe=True, mtp=True)
    shape = replace(shape, text=replace(shape.text, moe_ffn_hidden_size=64))
    path = tmp_path_factory.mktemp("hub_moe")
    write_hf_checkpoint(path, shape, experts_per_expert=True)
    return str(path)


@pytest.fixture(scope="module")
def megatron_ckpt(hub_moe, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mg") / "ckpt")
    import_hf(hub_moe, path)
    return path


def _file_tensors(path) -> dict:
    """Every tensor as the files store it (no packing on read): name -> tensor."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    assert out.keys() == index["weight_map"].keys()
    return out


def _assert_same_files(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref), (sorted(set(ours) ^ set(ref)))[:10]
    for name, tensor in ref.items():
        got = ours[name]
        assert (got.shape, got.dtype) == (tensor.shape, tensor.dtype), name
        assert torch.equal(got.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines, err
    assert lines[-1].startswith(f"convert_checkpoint {command}: error: "), err
    print(lines[-1])
    return lines[-1]


def _copy_with(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _edit_tensor(path, name, fn) -> None:
    """Rewrite the shard holding ``name`` with ``fn`` applied to that tensor."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = os.path.join(path, json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"][name])
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = fn(tensors[name]).contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})


# ------------------------------------------------------------------------------ item 3: layouts


def test_hub_layout_moe_round_trip_is_bitwise(hub_moe, megatron_ckpt, tmp_path):
    original = _file_tensors(hub_moe)
    assert original[LM + "0.mlp.experts.3.gate_proj.weight"].shape == (64, 128)
    assert original[LM + "0.mlp.experts.3.down_proj.weight"].shape == (128, 64)
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in original
    assert not [n for n in original if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    export_hf(megatron_ckpt, str(tmp_path / "out"), max_shard_bytes=1 << 20)
    _assert_same_files(_file_tensors(tmp_path / "out"), original)


def test_packed_layout_on_request_and_import_reads_it(hub_moe, megatron_ckpt, tmp_path, capsys):
    assert (
        main(
            [
                "export",
                "--megatron-path",
                megatron_ckpt,
                "--hf-path",
                str(tmp_path / "packed"),
                "--moe-layout",
                "packed",
            ]
        )
        == 0
    )
    packed = _file_tensors(tmp_path / "packed")
    assert not [n for n in packed if re.search(r"\.experts\.\d+\.", n)]
    assert packed[LM + "0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)  # [E, 2F, H]
    assert packed["mtp.layers.0.mlp.experts.down_proj"].shape == (4, 128, 64)  # [E, H, F]
    # packed in, hub layout out: the same bytes as the hub checkpoint we started from
    import_hf(str(tmp_path / "packed"), str(tmp_path / "mg"))
    export_hf(str(tmp_path / "mg"), str(tmp_path / "hub"))
    _assert_same_files(_file_tensors(tmp_path / "hub"), _file_tensors(hub_moe))


# ---------------------------------------------------------------------- item 4: dtypes, NaN/inf


def test_import_refuses_a_tensor_in_another_dtype_unless_allowed(hub_moe, tmp_path, capsys):
    odd = LM + "3.self_attn.o_proj.weight"
    bad = _copy_with(hub_moe, tmp_path / "fp16", lambda d: _edit_tensor(d, odd, lambda t: t.half()))
    out = str(tmp_path / "mg")
    assert main(["import", "--hf-path", bad, "--megatron-path", out]) == 2
    line = _one_error_line(capsys, "import")
    assert f"{odd} is float16" in line and "bfloat16" in line and "--allow-mixed-dtypes" in line, line
    assert "A_log" not in line and "dt_bias" not in line  # fp32 there is how Qwen3.5 ships them
    assert not os.path.exists(out)

    # Without a dtype in config.json the tensors' own majority is the reference.
    def no_config_dtype(d):
        config = json.load(open(d / "config.json"))
        config.pop("dtype", None)
        config["text_config"].pop("dtype", None)
        json.dump(config, open(d / "config.json", "w"))

    no_dtype = _copy_with(bad, tmp_path / "no_dtype", no_config_dtype)
    assert main(["import", "--hf-path", no_dtype, "--megatron-path", out]) == 2
    assert f"{odd} is float16" in _one_error_line(capsys, "import")

    assert main(["import", "--hf-path", bad, "--megatron-path", out, "--allow-mixed-dtypes"]) == 0
    assert "'torch.float16': 16384" in capsys.readouterr().out  # o_proj [128, 128] imported as stored


def test_import_refuses_nan_and_inf_naming_each_tensor(hub_moe, tmp_path, capsys):
    nan_name, inf_name = LM + "1.linear_attn.out_proj.weight", LM + "2.mlp.experts.1.up_proj.weight"

    def poison(d):
        _edit_tensor(d, nan_name, lambda t: t.index_fill(0, torch.tensor([0, 5]), float("nan")))
        _edit_tensor(d, inf_name, lambda t: t.index_fill(1, torch.tensor([3]), float("-inf")))

    bad = _copy_with(hub_moe, tmp_path / "poisoned", poison)
    out = str(tmp_path / "mg")
    assert main(["import", "--hf-path", bad, "--megatron-path", out]) == 2
    err = capsys.readouterr().err
    assert re.search(
        rf"NaN or inf \(2\):\n\s+{re.escape(nan_name)}: 256 NaN, 0 inf\n"
        rf"\s+{re.escape(inf_name)}: 0 NaN, 64 inf",
        err,
    ), err
    assert "Traceback" not in err and not os.path.exists(out)
    print(err)


def test_verify_says_which_weight_is_nan(hub_moe, megatron_ckpt, tmp_path, monkeypatch, capsys):
    from examples.multimodal_dev.checkpoint.streamed_load import CheckpointTensors

    real = CheckpointTensors.read
    poisoned = "language_model.decoder.final_layernorm.weight"

    def read_with_nan(self, names, dtype=None):
        out = real(self, names, dtype)
        if poisoned in out:
            out[poisoned][7] = float("nan")
        return out

    monkeypatch.setattr(CheckpointTensors, "read", read_with_nan)
    assert main(["verify", "--hf-path", hub_moe, "--megatron-path", megatron_ckpt]) == 1
    out = capsys.readouterr().out
    print(out)
    assert re.search(rf"verify: FAIL: .*Megatron .*{re.escape(poisoned)} \(1 NaN, 0 inf\)", out), out


# --------------------------------------------------------------------- item 5: corrupt header


@pytest.mark.parametrize("header_len", [10_000, 1 << 40, (1 << 64) - 1])
def test_a_header_longer_than_its_file_is_named_corrupt(tmp_path, capsys, header_len):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    shard = hf / "model.safetensors"
    shard.write_bytes(
        header_len.to_bytes(8, "little") + b'{"w": {"dtype": "F32", "shape": [1], '
        b'"data_offsets": [0, 4]}}    ' + bytes(4)
    )
    with pytest.raises(ValueError, match=rf"^{re.escape(str(shard))}: corrupt safetensors file: header length"):
        HFTensorSource(str(hf))
    assert main(["import", "--hf-path", str(hf), "--megatron-path", str(tmp_path / "mg")]) == 2
    assert str(shard) in _one_error_line(capsys, "import")


# ------------------------------------------------------------------- item 6: unwritable exports


def _export(megatron_ckpt, out) -> int:
    return main(["export", "--megatron-path", megatron_ckpt, "--hf-path", str(out)])


def test_export_onto_an_existing_file(megatron_ckpt, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_bytes(b"keep me")
    assert _export(megatron_ckpt, target) == 2
    line = _one_error_line(capsys, "export")
    assert f"--hf-path {target}" in line and "not a directory" in line, line
    assert target.read_bytes() == b"keep me" and sorted(os.listdir(tmp_path)) == ["model.bin"]


def _writes_are_refused(directory) -> bool:
    try:
        with open(os.path.join(directory, "probe"), "w"):
            pass
    except PermissionError:
        return True
    os.unlink(os.path.join(directory, "probe"))
    return False


def test_export_into_a_read_only_directory(megatron_ckpt, tmp_path, monkeypatch, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if not _writes_are_refused(parent):  # root ignores the mode: the file system says no instead

            def read_only(path, *args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

            monkeypatch.setattr(hf_export, "write_shard", read_only)
        assert _export(megatron_ckpt, parent / "out") == 2
        line = _one_error_line(capsys, "export")
        assert f"--hf-path {parent / 'out'}" in line, line
        assert re.search("Read-only file system|Permission denied", line), line
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o755)


def test_export_onto_a_full_disk(megatron_ckpt, tmp_path, monkeypatch, capsys):
    def full(path, *args, **kwargs):  # part of a shard written, then the disk is full
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(hf_export, "write_shard", full)
    assert _export(megatron_ckpt, tmp_path / "out") == 2
    line = _one_error_line(capsys, "export")
    assert f"--hf-path {tmp_path / 'out'}" in line and "No space left on device" in line, line
    assert os.listdir(tmp_path) == []

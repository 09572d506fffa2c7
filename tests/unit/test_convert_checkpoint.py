"""convert_checkpoint.py import / export / verify on tiny random checkpoints written by
``save_pretrained`` (bf16 with fp32 ``A_log``/``dt_bias``, sharded with an index, MTP head in its
own shard; MoE experts stored one tensor per expert, as released files do)."""

import json
import os
import re

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint

from examples.multimodal_dev.checkpoint.hf_export import export_hf
from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.checkpoint.hf_safetensors import HFTensorSource
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main

PER_EXPERT = re.compile(r"\.experts\.\d+\.")


@pytest.fixture(scope="module", params=["dense", "moe"])
def hf_checkpoint(request, tmp_path_factory, mcore):
    moe = request.param == "moe"
    path = tmp_path_factory.mktemp(f"hf_{request.param}")
    tensors = write_hf_checkpoint(path, get_variant("tiny", moe=moe, mtp=True), experts_per_expert=moe)
    return request.param, str(path), tensors


def _read_dir(path) -> dict:
    source = HFTensorSource(str(path))
    return {n: source.get(n) for n in sorted(source.names) if not PER_EXPERT.search(n)}


def test_round_trip_is_bitwise_with_dtypes(hf_checkpoint, tmp_path):
    kind, hf_path, written = hf_checkpoint
    info = import_hf(hf_path, str(tmp_path / "mg"))
    assert info["dtypes"].keys() == {"torch.bfloat16", "torch.float32"}  # fp32 A_log / dt_bias kept
    export_hf(str(tmp_path / "mg"), str(tmp_path / "out"), max_shard_bytes=1 << 20)
    original, back = _read_dir(hf_path), _read_dir(tmp_path / "out")
    assert any(n.startswith("mtp.") for n in back) and len(os.listdir(tmp_path / "out")) > 3  # sharded
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    print(
        f"{kind}: {len(back)} tensors bitwise equal after HF -> Megatron -> HF "
        f"({sum(t.dtype == torch.float32 for t in back.values())} fp32, the rest bf16)"
    )


def test_export_loads_in_transformers_without_missing_or_unexpected_keys(hf_checkpoint, tmp_path):
    from examples.multimodal_dev.checkpoint.hf_models import hf_classes

    kind, hf_path, _ = hf_checkpoint
    import_hf(hf_path, str(tmp_path / "mg"))
    export_hf(str(tmp_path / "mg"), str(tmp_path / "out"))
    _, cls = hf_classes("qwen3_5_moe" if kind == "moe" else "qwen3_5")
    _, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_verify_passes_on_import_and_fails_on_a_perturbed_weight(hf_checkpoint, tmp_path, capsys):
    kind, hf_path, written = hf_checkpoint
    assert main(["import", "--hf-path", hf_path, "--megatron-path", str(tmp_path / "good")]) == 0
    assert main(["verify", "--hf-path", hf_path, "--megatron-path", str(tmp_path / "good")]) == 0
    good = capsys.readouterr().out
    assert re.search(r"verify: max_abs_diff=\S+ mean_abs_diff=\S+ cosine=\S+ tokens=80 .*PASS", good), good

    # The same checkpoint with one weight nudged by 1% of its scale, imported, checked against the original.
    from safetensors.torch import save_file

    bad_hf = tmp_path / "bad_hf"
    bad_hf.mkdir()
    for name in os.listdir(hf_path):
        os.symlink(os.path.join(hf_path, name), bad_hf / name)
    index = json.load(open(os.path.join(hf_path, "model.safetensors.index.json")))
    target = "model.language_model.layers.3.self_attn.o_proj.weight"
    shard = index["weight_map"][target]
    tensors = {k: v for k, v in written.items() if index["weight_map"].get(k) == shard}
    tensors[target] = tensors[target] + 0.01 * tensors[target].abs().max()
    os.unlink(bad_hf / shard)
    save_file(tensors, bad_hf / shard)
    assert main(["import", "--hf-path", str(bad_hf), "--megatron-path", str(tmp_path / "bad")]) == 0
    assert main(["verify", "--hf-path", hf_path, "--megatron-path", str(tmp_path / "bad")]) == 1
    bad = capsys.readouterr().out
    print(good, bad)
    assert "FAIL" in bad


def test_import_errors_name_the_problem(hf_checkpoint, tmp_path, capsys):
    kind, hf_path, written = hf_checkpoint
    if kind != "dense":
        pytest.skip("one architecture is enough for the error paths")

    def fails(args, pattern):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err), err

    out = str(tmp_path / "mg")
    fails(["import", "--hf-path", str(tmp_path / "nowhere"), "--megatron-path", out], "no such directory")
    fails(["import", "--hf-path", hf_path, "--megatron-path", out, "--tp", "3"], "--tensor-model-parallel-size 3")

    def copy_with(name, edit):
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(hf_path):
            (d / f).write_bytes(open(os.path.join(hf_path, f), "rb").read())
        edit(d)
        return str(d)

    def llama(d):
        cfg = json.load(open(d / "config.json"))
        json.dump({**cfg, "model_type": "llama"}, open(d / "config.json", "w"))

    fails(["import", "--hf-path", copy_with("llama", llama), "--megatron-path", out], "model_type is 'llama'")

    def truncate(d):
        shard = d / json.load(open(d / "model.safetensors.index.json"))["weight_map"]["lm_head.weight"]
        shard.write_bytes(shard.read_bytes()[:-100])

    fails(["import", "--hf-path", copy_with("cut", truncate), "--megatron-path", out], "truncated safetensors")

    def extra_and_missing(d):
        from safetensors.torch import save_file

        mystery = {"model.language_model.layers.9.mystery.weight": torch.zeros(2, dtype=torch.bfloat16)}
        save_file(mystery, d / "extra.safetensors")
        index = json.load(open(d / "model.safetensors.index.json"))
        index["weight_map"]["model.language_model.layers.9.mystery.weight"] = "extra.safetensors"
        del index["weight_map"]["mtp.fc.weight"]
        json.dump(index, open(d / "model.safetensors.index.json", "w"))
        tensors = {k: v for k, v in written.items() if k.startswith("mtp.") and k != "mtp.fc.weight"}
        save_file(tensors, d / "mtp.safetensors")

    fails(
        ["import", "--hf-path", copy_with("odd", extra_and_missing), "--megatron-path", out],
        r"(?s)absent.*mtp\.fc\.weight.*not consumed.*layers\.9\.mystery\.weight.*not filled.*eh_proj",
    )
    assert not os.path.exists(out), "a failed import must not write anything"


def test_verify_with_a_prompt_and_an_image_through_the_processor(tmp_path, capsys, mcore):
    """``--prompt``/``--image``: real text and a PNG through the checkpoint's own processor."""
    from tiny_processor import build_processor, png_bytes, tiny_shape_for

    processor_dir = build_processor(str(tmp_path / "hf"))
    shape = tiny_shape_for(processor_dir)
    write_hf_checkpoint(tmp_path / "hf", shape, dtype=torch.float32)
    (tmp_path / "receipt.png").write_bytes(png_bytes((64, 48), (200, 180, 40)))
    assert main(["import", "--hf-path", str(tmp_path / "hf"), "--megatron-path", str(tmp_path / "mg")]) == 0
    assert (
        main(
            [
                "verify",
                "--hf-path",
                str(tmp_path / "hf"),
                "--megatron-path",
                str(tmp_path / "mg"),
                "--prompt",
                "total?",
                "--image",
                str(tmp_path / "receipt.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    print(out)
    assert re.search(r"prompt: max_abs_diff=.*\nverify: .*PASS", out), out

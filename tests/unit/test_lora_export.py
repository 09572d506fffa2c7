"""A LoRA run's checkpoint exported to Hugging Face (tiny dense and MoE models, fp32, CPU): merged into
the base by ``convert_checkpoint export``, and as a PEFT adapter by ``export-peft`` that ``peft`` loads
onto transformers' model of the base. Both give our adapted model's logits, Gated DeltaNet layers and
the routed experts included, and the adapter's self-check refuses a wrong mapping.

Tolerance: max |logit diff| <= 1e-5 * max |logit| (fp32). The two sides are different implementations
summing in different orders (fused against split projections, chunked against reference GDN kernels),
and PEFT adds B A x beside W x where the merged model folds it into W; the plain model parity
(tests/unit/test_hf_parity.py) measures ~1e-6 relative at this size. B is drawn so that each
adapter's change is about a tenth of its weight, which still moves the largest logit by about its
own size; with changes as large as the weights themselves the merge's own fp32 rounding (our merged
model against our unmerged one) measured 3.3e-5.

The dense model carries adapters on every target (the vision tower's and the merger's too); the MoE
model, with the MTP head (which stays frozen), on the default ones (every linear of the decoder, each
routed expert its own)."""

import json
import os
import re

import pytest
import torch
from hf_reference import HFMtpHead, build_hf_model, megatron_position_ids
from lora_exports import assert_close, hf_class, image_batch, logits

from examples.multimodal_dev.checkpoint import peft_adapter
from examples.multimodal_dev.checkpoint.files import save_model_checkpoint
from examples.multimodal_dev.checkpoint.hf_conversion import HF_CONFIG
from examples.multimodal_dev.lora import apply as lora
from examples.multimodal_dev.lora.adapter import LoraLinear
from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS, TARGETS
from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.models.megatron_args import one_process_checkpoint_args
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.models.qwen35_vl.hf_mapping import load_hf_into_model
from examples.multimodal_dev.tools.convert_checkpoint import main

RANK, ALPHA, DROPOUT = 4, 8.0, 0.1


def _save(path, shape, model, **lora_args) -> str:
    os.makedirs(path)
    with open(path / HF_CONFIG, "w") as f:
        json.dump(model_of(shape).shape_to_hf(shape), f)
    args = one_process_checkpoint_args(shape, str(path), str(path / HF_CONFIG), **lora_args)
    save_model_checkpoint(args, 1, model)
    return str(path)


@pytest.fixture(scope="module", params=["dense", "moe"])
def lora_run(request, tmp_path_factory, mcore):
    """(kind, shape, base checkpoint, LoRA checkpoint, batch, base logits, adapted logits, adapters):
    a base from transformers' random model, adapters with A and B drawn away from their start."""
    kind = request.param
    shape = get_variant("tiny", moe=kind == "moe", mtp=kind == "moe")  # as the LoRA engine tests train it
    model = build_model(shape).eval()
    hf = build_hf_model(shape)
    mtp = HFMtpHead(hf).checkpoint_state() if shape.text.mtp_num_layers else {}
    load_hf_into_model(model, {**hf.state_dict(), **mtp}, shape)
    root = tmp_path_factory.mktemp(f"lora_export_{kind}")
    base = _save(root / "base", shape, model)
    targets = TARGETS if kind == "dense" else DEFAULT_TARGETS
    lora.apply(model, RANK, ALPHA, DROPOUT, targets, seed=0)
    model.eval()  # the adapters' dropout modules are new: off for the logits
    generator = torch.Generator().manual_seed(11)
    adapted = [m for m in model.modules() if isinstance(m, LoraLinear)]
    with torch.no_grad():
        for m in adapted:  # as a trained adapter: both halves away from their start (see the top for B's size)
            m.lora_A.mul_(1 + torch.rand(m.lora_A.shape, generator=generator))
            m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=generator) / m.lora_B.shape[1] ** 0.5)
    lora_args = dict(
        lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(targets), lora_dropout=DROPOUT, lora_base=base
    )
    tuned = _save(root / "lora", shape, model, **lora_args)
    ids, pixels, grids = image_batch(shape)
    positions = megatron_position_ids(shape, ids, torch.ones_like(ids), grids)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=positions, pixel_values=pixels, image_grid_thw=grids)
        for m in adapted:
            m.lora_B.zero_()
        without = model(input_ids=ids, position_ids=positions, pixel_values=pixels, image_grid_thw=grids)
    return kind, shape, base, tuned, (ids, pixels, grids), without, ours, len(adapted)


def test_merged_export_gives_the_adaptedlogits(lora_run, tmp_path, capsys):
    kind, shape, _, tuned, batch, base, ours, count = lora_run
    assert main(["export", "--megatron-path", tuned, "--hf-path", str(tmp_path / "merged")]) == 0
    assert f"merged {count} LoRA adapters" in capsys.readouterr().out
    hf, info = hf_class(shape).from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_close(f"{kind} merged export", logits(hf, shape, batch), ours, base)


def test_peft_adapter_on_transformers_gives_the_adaptedlogits(lora_run, tmp_path, capsys, monkeypatch):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    kind, shape, base_ckpt, tuned, batch, base, ours, count = lora_run
    monkeypatch.setattr(peft_adapter, "CHECK_BYTES", 1)  # the self-check one expert at a time, as on a large model
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    assert main(["export", "--megatron-path", base_ckpt, "--hf-path", base_dir]) == 0
    assert "merged" not in capsys.readouterr().out
    args = ["export-peft", "--megatron-path", tuned, "--peft-path", adapter_dir, "--base-model-name-or-path", base_dir]
    assert main(args) == 0
    line = capsys.readouterr().out
    print(line)
    assert re.search(rf"export-peft: {count} LoRA adapters as \d+ transformers linears", line), line
    assert f"; trained on {base_ckpt} -> {adapter_dir}" in line  # the base the adapter goes on
    config = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", RANK, ALPHA, "none")
    assert config["base_model_name_or_path"] == base_dir
    gdn = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    assert gdn | {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(config["target_modules"])
    if kind == "moe":  # every routed expert its own adapter, on transformers' 3D expert parameters
        assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
        assert config["lora_dropout"] == 0 and "PEFT's expert adapters take no dropout" in line
    else:
        assert {"qkv", "attn.proj", "linear_fc1", "linear_fc2"} <= set(config["target_modules"])  # the vision tower
        assert not config["target_parameters"] and config["lora_dropout"] == DROPOUT

    peft_model = PeftModel.from_pretrained(hf_class(shape).from_pretrained(base_dir), adapter_dir)
    written = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(peft_model)
    assert loaded.keys() == written.keys()  # PEFT found a place for every tensor and made no other
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    assert_close(f"{kind} PEFT adapter", logits(peft_model, shape, batch), ours, base)


def test_the_self_check_refuses_a_wrong_adapter_mapping(lora_run, tmp_path, monkeypatch, capsys):
    """B of attention's fused qkv cut into q / k / v as plain row blocks, without the per-group
    reordering its weight gets: the adapter would load and run, wrongly; the export refuses it."""
    kind, _, base_ckpt, tuned, *_ = lora_run
    if kind != "dense":
        pytest.skip("one model is enough for the refusals")
    right = peft_adapter.hf_halves

    def unordered(rule, a_list, b_list):
        if not rule.hf[0].endswith("self_attn.q_proj.weight"):
            return right(rule, a_list, b_list)
        sizes = [t.shape[0] for t in rule.to_hf(b_list)]
        return [(a_list[0], b) for b in torch.split(b_list[0], sizes)]

    monkeypatch.setattr(peft_adapter, "hf_halves", unordered)
    out = tmp_path / "adapter"
    assert main(["export-peft", "--megatron-path", tuned, "--peft-path", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the PEFT adapter of \S+self_attn\.q_proj\.weight .* is not the weight's own change", err), err
    assert not os.path.exists(out) and not os.path.exists(f"{out}.partial")

    monkeypatch.setattr(peft_adapter, "hf_halves", right)
    assert main(["export-peft", "--megatron-path", base_ckpt, "--peft-path", str(out)]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err


def test_an_adapter_folder_that_is_a_planted_link_loses_nothing(lora_run, tmp_path, capsys):
    """--peft-path naming a link to a folder of the user's (or the .partial folder planted as one):
    the export stops in one line and the folder's files are as they were."""
    kind, _, _, tuned, *_ = lora_run
    if kind != "dense":
        pytest.skip("one model is enough for the refusals")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for planted, overwrite in (("adapter", []), ("adapter", ["--overwrite"]), ("adapter.partial", [])):
        out = tmp_path / "adapter"
        (tmp_path / planted).symlink_to(mine, target_is_directory=True)
        code = main(["export-peft", "--megatron-path", tuned, "--peft-path", str(out), *overwrite])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
        assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"
        (tmp_path / planted).unlink()


def test_stored_args_and_tensors_that_disagree_are_refused(mcore):
    from types import SimpleNamespace

    from examples.multimodal_dev.checkpoint.lora_checkpoint import attach_adapters, stored_lora

    layer = "language_model.decoder.layers.0.self_attention.in_proj"
    adapters = {f"{layer}.weight": None, f"{layer}.lora_A": None, f"{layer}.lora_B.query": None}
    run = SimpleNamespace(lora_rank=4, lora_alpha=None, lora_targets="in_proj", lora_dropout=0.0)
    assert stored_lora("ck", run, adapters).alpha == 4.0  # the training script's default: scale 1
    assert stored_lora("ck", SimpleNamespace(), {f"{layer}.weight": None}) is None
    with pytest.raises(ValueError, match=r"--megatron-path ck: holds LoRA adapters \(\S+lora_A\) but its stored"):
        stored_lora("ck", SimpleNamespace(lora_rank=0), adapters)
    with pytest.raises(ValueError, match="--megatron-path ck: its stored args have lora_rank 4 but it holds no"):
        stored_lora("ck", run, {f"{layer}.weight": None})
    with pytest.raises(ValueError, match="--megatron-path ck: its stored args have lora_rank 4 but no lora_targets"):
        stored_lora("ck", SimpleNamespace(lora_rank=4), adapters)

    # an adapter the stored targets do not name would be left unread: refused by name
    attention = "language_model.decoder.layers.3.self_attention.linear_qkv"
    model = build_model(get_variant("tiny"))
    with pytest.raises(ValueError, match=rf"do not name: {attention}\.lora_A and 1 more"):
        attach_adapters(
            model,
            stored_lora("ck", run, adapters),
            {**adapters, f"{attention}.lora_A": None, f"{attention}.lora_B": None},
            "ck",
        )


def test_the_optimizers_state_of_an_adapter_is_no_adapter(mcore):
    """A training checkpoint stores each adapter's Adam moments under the adapter's own name behind
    the optimizer's prefix: plain and distributed (fully reshardable) optimizer ``optimizer.state.*``,
    the distributed one's fp32 copy ``optimizer.state.fp32_param.*``, and with two chained optimizers
    (experts over EP) ``chained_N.``. None of them is an adapter the stored targets fail to name."""
    from types import SimpleNamespace

    from examples.multimodal_dev.checkpoint.lora_checkpoint import attach_adapters, stored_lora

    layer = "language_model.decoder.layers.0.self_attention.in_proj"
    model_keys = {f"{layer}.weight": None, f"{layer}.lora_A": None, f"{layer}.lora_B.query": None}
    optimizer = {
        f"{prefix}.{key}": None
        for key in model_keys
        for prefix in (
            "optimizer.state.exp_avg",
            "optimizer.state.exp_avg_sq",
            "optimizer.state.fp32_param",
            "chained_1.optimizer.state.exp_avg",
        )
    }
    run = SimpleNamespace(lora_rank=4, lora_alpha=8, lora_targets="in_proj", lora_dropout=0.0)
    stored = {**model_keys, **optimizer}
    lora = stored_lora("ck", run, stored)
    attach_adapters(build_model(get_variant("tiny")), lora, stored, "ck")  # nothing refused
    with pytest.raises(ValueError, match="its stored args have lora_rank 4 but it holds no adapter tensors"):
        stored_lora("ck", run, {f"{layer}.weight": None, **{k: v for k, v in optimizer.items() if "lora" in k}})

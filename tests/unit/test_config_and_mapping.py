"""Variant table, HF config import/export, registry and mapping round trip."""

import os
import subprocess
import sys

import pytest
import torch
from hf_reference import HFMtpHead, build_hf_model

from examples.multimodal_dev.models import MODEL_REGISTRY, get_model_entry
from examples.multimodal_dev.models.qwen35_vl.configuration import (
    FULL,
    LINEAR,
    VARIANTS,
    from_hf_config,
    get_variant,
    to_hf_config_dict,
)
from examples.multimodal_dev.models.qwen35_vl.factory import validate_parallel
from examples.multimodal_dev.models.qwen35_vl.hf_mapping import hf_to_megatron, megatron_to_hf


def test_variants_are_consistent():
    for name, shape in VARIANTS.items():
        t = shape.text
        assert len(t.layer_types) == t.num_layers, name
        assert set(t.layer_types) <= {LINEAR, FULL} and FULL in t.layer_types, name
        assert sum(t.mrope_section) * 2 == int(t.head_dim * t.partial_rotary_factor), name
        assert shape.vision.out_hidden_size == t.hidden_size, name
    assert VARIANTS["397b_a17b"].text.num_experts == 512 and VARIANTS["27b"].text.ffn_hidden_size == 17408
    assert VARIANTS["proxy"].text.num_layers == 4 and VARIANTS["proxy"].text.layer_types[3] == FULL


@pytest.mark.parametrize("moe", [False, True])
def test_hf_config_round_trip(moe):
    shape = get_variant("tiny", moe=moe, mtp=True)
    assert from_hf_config(to_hf_config_dict(shape)) == shape


def test_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        from_hf_config({"model_type": "llama"})
    with pytest.raises(FileNotFoundError):
        from_hf_config(tmp_path / "missing")


def test_registry():
    assert "qwen35_vl" in MODEL_REGISTRY
    assert get_model_entry("qwen35_vl").shape_fn("tiny") == VARIANTS["tiny"]
    with pytest.raises(KeyError, match="valid: qwen35_vl"):
        get_model_entry("llava")
    with pytest.raises(KeyError, match="valid:"):
        get_variant("1t")


def test_every_seam_of_every_entry_resolves():
    """Each seam the other layers call is the model's own function (or table), typed by ``ModelEntry``;
    an entry missing one is refused when it is built, and a seam asked by a wrong name says so. A seam
    whose module imports torch is imported at its first call, and then gives the real function's answer."""
    import dataclasses

    from examples.multimodal_dev.models import ModelEntry, model_of
    from examples.multimodal_dev.models.qwen35_vl import mrope

    for arch, entry in MODEL_REGISTRY.items():
        assert entry.arch == arch
        for seam in dataclasses.fields(ModelEntry):
            assert getattr(entry, seam.name) is not None, (arch, seam.name)
    assert model_of(VARIANTS["tiny"]) is MODEL_REGISTRY["qwen35_vl"]
    seams = {f.name: getattr(MODEL_REGISTRY["qwen35_vl"], f.name) for f in dataclasses.fields(ModelEntry)}
    with pytest.raises(TypeError, match="build_fn"):
        ModelEntry(**{k: v for k, v in seams.items() if k != "build_fn"})
    with pytest.raises(AttributeError, match="has no attribute 'flops'"):
        get_model_entry("qwen35_vl").flops
    grids = torch.tensor([[2, 4, 4]])
    assert torch.equal(get_model_entry("qwen35_vl").split_video_frames(grids), mrope.split_video_frames(grids))


@pytest.mark.parametrize(
    "reading, imported",
    [
        (
            "from examples.multimodal_dev.models import default_model; "
            "default_model().variants['tiny']; default_model().shape_fn('9b')",
            [],
        ),
        # a dry run prints the planner's layout (launcher/launch.py's plan_lines); mock_mix's
        # conversations are drawn with torch's generator, as the mock dataset draws them
        ("from examples.multimodal_dev.tools import plan_layout; plan_layout.main(['35b_a3b', '--brief'])", ["torch"]),
    ],
    ids=["variant table", "planned layout"],
)
def test_the_launcher_reads_without_megatron(reading, imported):
    """The launcher reads the variants through the registry on every launch, and the planner's
    layout on every dry run: neither imports megatron-core (about 6 s), and the variants not even
    torch (about 2 s)."""
    code = f"import sys; {reading}; print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == str(imported)


def test_parallel_validation_names_flag_and_value():
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 3"):
        validate_parallel(VARIANTS["tiny"], tp=3)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 2 needs an MoE"):
        validate_parallel(get_variant("tiny", moe=False), ep=2)
    validate_parallel(VARIANTS["397b_a17b"], tp=2, cp=2, ep=8)


@pytest.mark.parametrize("moe", [False, True])
def test_mapping_round_trip_is_bitwise(moe):
    shape = get_variant("tiny", moe=moe, mtp=True)
    hf = build_hf_model(shape)
    hf_state = {**hf.state_dict(), **HFMtpHead(hf).checkpoint_state()}
    assert any(k.startswith("mtp.layers.0.") for k in hf_state)
    back = megatron_to_hf(hf_to_megatron(hf_state, shape), shape)
    assert set(back) == set(hf_state) - ({"lm_head.weight"} if shape.text.tie_word_embeddings else set())
    for name, tensor in back.items():
        assert tensor.dtype == hf_state[name].dtype and torch.equal(tensor, hf_state[name]), name

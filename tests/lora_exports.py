"""A LoRA checkpoint as it leaves for transformers (docs/lora.md, "Export"): merged by
``convert_checkpoint export``, and as a PEFT adapter by ``export-peft`` that ``peft`` loads onto
transformers' model of the base. Shared by the tests that build the checkpoint in-process
(tests/unit/test_lora_export.py) and through ``run_qwen35_vl.sh`` (tests/distributed).

Tolerance: max |logit diff| <= 1e-5 * max |logit| in fp32 (tests/unit/test_lora_export.py says why)."""

from __future__ import annotations

import os

import torch
from hf_reference import hf_forward, image_tokens, pixel_values_for

from examples.multimodal_dev.checkpoint.hf_models import hf_classes
from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.models.qwen35_vl.configuration import from_hf_config
from examples.multimodal_dev.tools.convert_checkpoint import main

REL_TOL = 1e-5


def image_batch(shape):
    """(token ids [1, T], pixel values, grids): one 4 x 6 patch image between text tokens."""
    grids = [(1, 4, 6)]
    ids = torch.tensor([[5, 6, *image_tokens(shape, 4, 6), 7, 8, 9, 10, 11, 12, 13, 14]])
    pixels = pixel_values_for(shape, grids, torch.Generator().manual_seed(3))
    return ids, pixels, torch.tensor(grids)


def hf_class(shape):
    return hf_classes(model_of(shape).shape_to_hf(shape)["model_type"])[1]


def logits(hf, shape, batch):
    ids, pixels, grids = batch
    return hf_forward(hf.eval(), shape, ids, torch.ones_like(ids), pixels, grids)


def assert_close(name, theirs, ours, base):
    """``theirs`` within the tolerance of ``ours``, and ``ours`` away from ``base`` by more than 1% of
    the largest logit (the adapters change the model far beyond the tolerance)."""
    diff, scale = (theirs - ours).abs().max().item(), ours.abs().max().item()
    moved = (ours - base).abs().max().item()
    print(f"{name}: max abs diff {diff:.2e} (largest logit {scale:.2f}; the adapters move logits by {moved:.2e})")
    assert moved > 1e3 * REL_TOL * scale, f"{name}: the adapters moved the logits by {moved} only"
    assert diff <= REL_TOL * scale, f"{name}: {diff} > {REL_TOL} * {scale}"


def peft_equals_merged(lora_ckpt, base_hf, out, name: str) -> str:
    """The commands of docs/lora.md on ``lora_ckpt`` (a run's checkpoint, optimizer state and all):
    ``export`` (and ``verify`` of it), ``export-peft`` for the base at ``base_hf``; the base with the
    PEFT adapter loaded by ``peft`` gives the merged export's logits. Returns export-peft's line."""
    import contextlib
    import io

    from peft import PeftModel

    merged, adapter = os.path.join(out, "merged"), os.path.join(out, "adapter")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["export", "--megatron-path", str(lora_ckpt), "--hf-path", merged]) == 0
        assert main(["verify", "--hf-path", merged, "--megatron-path", str(lora_ckpt)]) == 0
        peft_args = ["--peft-path", adapter, "--base-model-name-or-path", str(base_hf)]
        assert main(["export-peft", "--megatron-path", str(lora_ckpt), *peft_args]) == 0
    print(said.getvalue())
    shape = from_hf_config(str(base_hf))
    batch = image_batch(shape)
    base_model = hf_class(shape).from_pretrained(str(base_hf), dtype=torch.float32)
    base = logits(base_model, shape, batch)
    tuned = logits(PeftModel.from_pretrained(base_model, adapter), shape, batch)
    ours = logits(hf_class(shape).from_pretrained(merged, dtype=torch.float32), shape, batch)
    assert_close(name, tuned, ours, base)
    return said.getvalue()

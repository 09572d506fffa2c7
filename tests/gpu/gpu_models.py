"""Models and batches for the GPU model checks (test_model_parity.py, test_te_backend.py): the shapes,
a Megatron model holding a transformers model's weights, collated mock batches on the GPU, and
the error measures. Reuses the CPU parity helpers (tests/hf_reference.py, benchmarks/bench_step.py).

Legend: THD = one packed row [1, T] with cu_seqlens; BSHD = one padded row per sample [B, S].
Logits are compared on real tokens only, in sample order (both layouts list them that way).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from examples.multimodal_dev.data.batch import PackedBatch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the GPU; a CPU in a rehearsal (gpu_results.rehearsal), which runs these checks' code on the torch kernels
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shapes() -> dict:
    """tiny (dense, MoE) and a reduced proxy of realistic width: 35b_a3b's layer dimensions (hidden
    2048, 16 attention heads of 256, 32 GDN value heads of 128, experts of 512) in 4 layers
    (3 GDN + 1 attention) with 8 experts (top-2), a 32k vocabulary and 2 vision blocks."""
    from examples.multimodal_dev.benchmarks.bench_step import bench_shape
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    wide = bench_shape("35b_a3b", num_layers=4, vocab_size=32768, vision_depth=2)
    wide = replace(wide, text=replace(wide.text, num_experts=8, moe_top_k=2))
    return {
        "tiny-dense": get_variant("tiny", moe=False, mtp=False),
        "tiny-moe": get_variant("tiny", moe=True, mtp=False),
        "wide-moe": wide,
    }


# (samples, mock text-length scale) per shape: a few hundred to ~2k tokens, some samples with images.
BATCH = {"tiny-dense": (4, 40), "tiny-moe": (4, 40), "wide-moe": (4, 200)}


def exact_fp32() -> None:
    """No TF32 in cuBLAS matmuls or cuDNN convolutions (the vision patch embedding is a Conv3d)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def hf_reference(shape, seed: int = 0):
    """transformers' model of ``shape`` in fp32 on DEVICE, every weight random (tests/hf_reference.py)."""
    from hf_reference import build_hf_model

    return build_hf_model(shape, seed=seed).to(DEVICE).eval()


def case(shape_name: str, dtype_name: str):
    """(dtype, shape, HF reference model) of one parity case, with fp32 kept exact; skips the
    case when tests/gpu/run.sh's time budget is nearly spent."""
    import gpu_results
    import pytest

    if gpu_results.deadline_left() < 40:
        pytest.skip("out of tests/gpu/run.sh's time budget")
    if gpu_results.rehearsal() and not shape_name.startswith("tiny"):
        pytest.skip("a rehearsal on a CPU runs the tiny shapes")
    dtype, shape = DTYPES[dtype_name], shapes()[shape_name]
    if dtype_name == "fp32":
        exact_fp32()
    return dtype, shape, hf_reference(shape)


def megatron_model(shape, dtype, backend: str, hf_state: dict):
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model
    from examples.multimodal_dev.models.qwen35_vl.hf_mapping import load_hf_into_model

    model = build_model(shape, backend=backend, params_dtype=dtype)
    load_hf_into_model(model, hf_state, shape)  # strict: every tensor lands
    return model.to(DEVICE).eval()


def batches(shape, name: str, seed: int = 0) -> tuple[PackedBatch, PackedBatch]:
    """(THD batch with every sample padded to a multiple of 4, as the collate does for CP=2; BSHD batch)
    of the same mock samples, on the host."""
    from examples.multimodal_dev.benchmarks.bench_step import mock_samples
    from examples.multimodal_dev.data.collate import pack_thd, pad_bshd
    from examples.multimodal_dev.data.sample import VisionTokens

    count, text_tokens = BATCH[name]
    samples = mock_samples(shape, count, text_tokens, seed=seed)
    tokens = VisionTokens.from_shape(shape)
    return pack_thd(samples, tokens, pad_multiple=4), pad_bshd(samples, tokens)


def on_device(batch: PackedBatch, dtype) -> PackedBatch:
    out = batch.to(DEVICE)
    if out.pixel_values is not None:
        out.pixel_values = out.pixel_values.to(dtype)
    return out


def real(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """[N_real, V] logits of the real tokens, in sample order."""
    return logits[~batch.padding_mask.to(logits.device)]


@torch.no_grad()
def megatron_logits(model, batch: PackedBatch) -> torch.Tensor:
    from examples.multimodal_dev.forward_step import packed_seq_params

    logits = model(
        input_ids=batch.tokens,
        position_ids=batch.position_ids,
        attention_mask=None,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.image_grid_thw,
        packed_seq_params=packed_seq_params(batch),
    )
    return real(logits, batch)


@torch.no_grad()
def hf_logits(hf, bshd_host: PackedBatch, shape, dtype) -> torch.Tensor:
    from examples.multimodal_dev.benchmarks.bench_step import hf_inputs

    inputs = hf_inputs(bshd_host, shape.image_token_id)
    inputs.pop("labels")
    inputs = {
        k: (v.to(DEVICE, dtype) if k == "pixel_values" else v.to(DEVICE)) if torch.is_tensor(v) else v
        for k, v in inputs.items()
    }
    return real(hf(**inputs).logits, bshd_host)


def loss_of(model, batch: PackedBatch, backward: bool = False) -> float:
    """Per-token mean loss of the batch (forward_step's loss); with ``backward``, gradients too."""
    from examples.multimodal_dev.forward_step import batch_loss

    with torch.set_grad_enabled(backward):
        loss_sum, count, _ = batch_loss(model, batch)
        loss = loss_sum / count
        if backward:
            loss.backward()
    return loss.item()


def grad_norm(model) -> float:
    return torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None)).item()


def errors(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |diff|, mean |diff|, the reference's max |value| and max |diff| / max(that, 1) (the CPU test's
    measure: tests/unit/test_hf_parity.py)."""
    diff = (ours.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    return {
        "max": diff.max().item(),
        "mean": diff.mean().item(),
        "scale": scale,
        "rel": diff.max().item() / max(scale, 1.0),
    }


def gdn_kernel_source() -> str:
    from megatron.core.ssm.gated_delta_net import gdn

    fn = getattr(gdn, "chunk_gated_delta_rule", None)
    return getattr(fn, "__module__", "none")


def fp32_rounding(shape_name: str) -> dict:
    """How far fp32 logits are from float64 ones at ``shape_name``, for transformers and for this model,
    and this model's from transformers' in each precision (max |diff| / max(|ref|, 1)): the floor under
    the fp32 parity bar. Run on a CPU (transformers' experts on their eager path: grouped_mm has no
    float64); both models keep a few fp32 islands (norms, rotary, router) in float64 too."""
    import copy

    from megatron.cpu.single_process import init_single_process

    if DEVICE.type != "cpu":
        raise SystemExit("fp32_rounding compares with float64 on a CPU host: run it where CUDA is not visible")
    init_single_process()
    shape, hf = shapes()[shape_name], build_hf_reference_cpu(shape_name)
    thd, bshd = batches(shape, shape_name)
    logits = {}
    for dtype in (torch.float32, torch.float64):
        ref = copy.deepcopy(hf).to(dtype)
        ours = megatron_model(shape, dtype, "local", ref.state_dict())
        logits["transformers", dtype] = hf_logits(ref, bshd, shape, dtype).double()
        logits["ours", dtype] = megatron_logits(ours, on_device(thd, dtype)).double()
    pairs = {
        "transformers fp32 vs float64": (("transformers", torch.float32), ("transformers", torch.float64)),
        "ours fp32 vs float64": (("ours", torch.float32), ("ours", torch.float64)),
        "ours vs transformers, fp32": (("ours", torch.float32), ("transformers", torch.float32)),
        "ours vs transformers, float64": (("ours", torch.float64), ("transformers", torch.float64)),
    }
    return {name: errors(logits[a], logits[b])["rel"] for name, (a, b) in pairs.items()}


def build_hf_reference_cpu(shape_name: str):
    """transformers' reference of ``shape_name`` on the CPU with its experts on the eager path."""
    hf = hf_reference(shapes()[shape_name]).cpu()
    configs = [hf.config, *(getattr(hf.config, name) for name in ("text_config", "vision_config"))]
    for config in configs:
        config._experts_implementation = config._experts_implementation_internal = "eager"
    return hf


if __name__ == "__main__":  # python tests/gpu/gpu_models.py wide-moe: the numbers test_model_parity cites
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [tests, os.path.dirname(tests)]  # hf_reference, and the repository
    for name in sys.argv[1:] or list(BATCH):
        for what, rel in fp32_rounding(name).items():
            print(f"{name}: {what}: {rel:.3g}")

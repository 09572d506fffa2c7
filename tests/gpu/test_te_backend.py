"""Check 3: the Transformer Engine backend against the local backend on the same weights.

The weights go local -> TE through a megatron dist checkpoint (both backends write the same keys:
tests/unit/test_checkpoint_keys.py), as a user switching backends would load them. Then, on the
same THD batch: logits, and one training step's loss and gradient norm (forward + backward; the
MoE load-balancing loss is in the gradients). Skipped with the reason where transformer_engine does
not import. Bars: fp32 1e-4 relative (TE's fused kernels sum in other orders); bf16: loss 2e-2,
grad norm 5e-2 relative, logits mean |diff| <= 1e-2 * max |logit|.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_models as gm

CHECK = "TE vs local"
pytestmark = pytest.mark.gpu
BARS = {"fp32": dict(logits=1e-4, loss=1e-4, grad=1e-4), "bf16": dict(logits=1e-2, loss=2e-2, grad=5e-2)}


@pytest.fixture(scope="session")  # session: set up (and skipped) before megatron_gpu starts
def te():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a TE build for another torch / CUDA
        pytest.skip(f"transformer_engine not importable: {type(e).__name__}: {str(e)[:200]}")


def _load_through_checkpoint(source, target, path) -> list:
    """Save ``source``'s sharded state, load it into ``target``; returns target keys left unfilled
    other than TE's ``_extra_state`` (FP8 metadata, not weights)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    path.mkdir(parents=True, exist_ok=True)  # dist_checkpointing.save wants an empty, existing folder
    dist_checkpointing.save(source.sharded_state_dict(), str(path))
    wanted = {k: v for k, v in target.sharded_state_dict().items() if not isinstance(v, ShardedObject)}
    result = target.load_state_dict(dist_checkpointing.load(wanted, str(path)), strict=False)
    return [k for k in result.missing_keys if not k.endswith("_extra_state")] + list(result.unexpected_keys)


def _both_backends(shape_name, dtype_name, tmp_path):
    """(dtype, shape, the local model, the TE model with the local model's weights)."""
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    dtype, shape, hf = gm.case(shape_name, dtype_name)
    local = gm.megatron_model(shape, dtype, "local", hf.state_dict())
    del hf
    te_model = build_model(shape, backend="te", params_dtype=dtype).cuda().eval()
    unfilled = _load_through_checkpoint(local, te_model, tmp_path / "ckpt")
    assert not unfilled, f"TE model tensors not in the local checkpoint: {unfilled[:10]}"
    return dtype, shape, local, te_model


def _compare(local, te_model, thd, dtype_name, record, row: str) -> bool:
    """Logits, then one training step's loss and gradient norm, TE against local; recorded as ``row``."""
    logits = gm.errors(gm.megatron_logits(te_model, thd), gm.megatron_logits(local, thd))
    steps = {}
    for name, model in (("local", local), ("te", te_model)):
        model.train()
        model.zero_grad(set_to_none=True)
        steps[name] = (gm.loss_of(model, thd, backward=True), gm.grad_norm(model))
    loss_rel = abs(steps["te"][0] - steps["local"][0]) / abs(steps["local"][0])
    grad_rel = abs(steps["te"][1] - steps["local"][1]) / abs(steps["local"][1])
    bars = BARS[dtype_name]
    logits_measure = logits["rel"] if dtype_name == "fp32" else logits["mean"] / max(logits["scale"], 1.0)
    ok = logits_measure <= bars["logits"] and loss_rel <= bars["loss"] and grad_rel <= bars["grad"]
    record(
        row,
        "pass" if ok else "fail",
        {
            "logits max": logits["max"],
            "logits rel": logits["rel"],
            "logits mean": logits["mean"],
            "loss local": steps["local"][0],
            "loss te": steps["te"][0],
            "loss rel": loss_rel,
            "grad norm local": steps["local"][1],
            "grad norm te": steps["te"][1],
            "grad norm rel": grad_rel,
        },
        f"bars {bars}",
    )
    return ok


@pytest.mark.parametrize("dtype_name", list(gm.DTYPES))
@pytest.mark.parametrize("shape_name", ["tiny-moe", "wide-moe"])
def test_te_equals_local(shape_name, dtype_name, te, megatron_gpu, record, tmp_path):
    dtype, shape, local, te_model = _both_backends(shape_name, dtype_name, tmp_path)
    thd = gm.on_device(gm.batches(shape, shape_name)[0], dtype)
    ok = _compare(local, te_model, thd, dtype_name, record, f"{shape_name} {dtype_name}")
    del local, te_model
    torch.cuda.empty_cache()
    assert ok


@pytest.mark.parametrize("dtype_name", list(gm.DTYPES))
def test_lora_on_te_equals_local(dtype_name, te, megatron_gpu, record, tmp_path):
    """LoRA adapters (lora/adapter.py) on TE's linears against the local backend's, on the same base
    weights: A drawn from one seed and each linear's name, B set away from zero by name (B = 0 would
    leave the base model). TE's LayerNorm-linears (linear_qkv, in_proj) have the adapter compute
    their norm itself; the gradient norm is the adapters' alone (the base is frozen)."""
    import hashlib

    from examples.multimodal_dev.lora import apply as lora
    from examples.multimodal_dev.lora.adapter import LoraLinear
    from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS

    dtype, shape, local, te_model = _both_backends("tiny-moe", dtype_name, tmp_path)
    for model in (local, te_model):
        lora.apply(model, 8, 16.0, 0.0, DEFAULT_TARGETS, seed=1)
        for name, module in model.named_modules():
            if isinstance(module, LoraLinear):
                seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
                b = torch.randn(module.lora_B.shape, generator=torch.Generator().manual_seed(seed)) * 0.02
                with torch.no_grad():
                    module.lora_B.copy_(b.to(module.lora_B.dtype))
    adapters = [sorted(n for n, m in model.named_modules() if isinstance(m, LoraLinear)) for model in (local, te_model)]
    assert adapters[0] == adapters[1] and adapters[0], "the two backends' adapted linears differ"
    thd = gm.on_device(gm.batches(shape, "tiny-moe")[0], dtype)
    ok = _compare(local, te_model, thd, dtype_name, record, f"LoRA tiny-moe {dtype_name}")
    del local, te_model
    torch.cuda.empty_cache()
    assert ok

"""Whether FLA's gated chunk rule trains right on this GPU, asked of the kernel itself.

FLA refuses its gated chunk backward on Hopper with Triton 3.4.0 up to 3.7.1 (FLA #640: Triton
miscompiles ``chunk_bwd_dqkwg``, reported at 64-wide heads), and torch <= 2.11 pins such a Triton,
so every Hopper run would take the torch chunked rule: correct, and thousands of small kernels a
step. Whether the model's own head width is hit is a question a run can answer in a second: one
packed row at the model's head dims, run by FLA in bf16 as training runs it (its guard lifted for
the call) and by ``megatron.cpu``'s torch kernel in fp32 on the same inputs, the output and all six
gradients compared by RMS ratio against FLA's own test tolerance. Where every one agrees the run
keeps FLA's kernel with its guard lifted; elsewhere it takes the torch kernel, and says which and
why in one line.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

# both sides of FLA's 64-token chunk, a lone token, a longer run
LENGTHS = (1, 63, 64, 65, 127, 500)
HEADS = 4
GRADS = ("q", "k", "v", "g", "beta", "initial_state")
BF16_RMS = 2e-2  # FLA's own test tolerance for the gated rule's db / dg in bf16
_GUARD_MODULE, _GUARD = "fla.ops.common.chunk_o", "TRITON_ABOVE_3_7_1"


def _inputs(key_dim: int, value_dim: int, device, seed: int = 3) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(inputs as megatron-core's GatedDeltaNet passes them, int32 cu_seqlens, the output's gradient):
    q / k l2-normalised, g in fp32 (megatron computes the decay in fp32), the rest bf16, the
    initial state fp32 as FLA keeps states."""
    from .gdn_kernels import l2norm

    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(LENGTHS)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    inputs = {
        "q": l2norm(randn(1, total, HEADS, key_dim)).bfloat16(),
        "k": l2norm(randn(1, total, HEADS, key_dim)).bfloat16(),
        "v": randn(1, total, HEADS, value_dim).bfloat16(),
        "g": torch.nn.functional.logsigmoid(randn(1, total, HEADS) + 2.0),
        "beta": randn(1, total, HEADS).sigmoid().bfloat16(),
        "initial_state": 0.1 * randn(len(LENGTHS), HEADS, key_dim, value_dim),
    }
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(device, torch.int32)
    return inputs, cu, randn(1, total, HEADS, value_dim)


def _output_and_gradients(kernel, inputs: dict, cu, grad_out) -> list[torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    out = kernel(**leaves, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=cu)[0]
    return [out, *torch.autograd.grad(out, list(leaves.values()), grad_out.to(out.dtype))]


def rms_ratio(got: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(got - ref) / RMS(ref), in fp32 (NaN where ``got`` holds one)."""
    diff = got.float() - ref.float()
    return float(diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt().clamp_min(1e-30))


def compare(candidate, key_dim: int, value_dim: int, device="cuda") -> dict[str, float]:
    """``candidate``'s RMS ratio against the torch kernel in fp32, for the output and each gradient."""
    from .gdn_kernels import chunk_gated_delta_rule

    inputs, cu, grad_out = _inputs(key_dim, value_dim, device)
    measured = _output_and_gradients(candidate, inputs, cu, grad_out)
    reference = _output_and_gradients(chunk_gated_delta_rule, {n: t.float() for n, t in inputs.items()}, cu, grad_out)
    return {name: rms_ratio(m, r) for name, m, r in zip(("out", *GRADS), measured, reference)}


@contextlib.contextmanager
def guard_lifted():
    """FLA's Hopper guard off for the block (a module constant its backward reads at call time)."""
    module = importlib.import_module(_GUARD_MODULE)
    before = getattr(module, _GUARD)
    setattr(module, _GUARD, True)
    try:
        yield
    finally:
        setattr(module, _GUARD, before)


def lift_guard() -> None:
    """FLA's Hopper guard off for the rest of the process: the check found its kernel right here."""
    setattr(importlib.import_module(_GUARD_MODULE), _GUARD, True)


def verdict(errors: dict[str, float]) -> tuple[bool, str]:
    """(every tensor within ``BF16_RMS``, a phrase naming the worst): NaN counts as wrong."""
    wrong = [n for n, e in errors.items() if not e <= BF16_RMS]
    worst = max(errors, key=lambda n: errors[n] if errors[n] == errors[n] else float("inf"))
    if wrong:
        return False, f"wrong {', '.join(wrong)} (RMS ratio {errors[worst]:.2g} in {worst}, bar {BF16_RMS:g})"
    return True, f"output and six gradients within RMS ratio {BF16_RMS:g} (worst {errors[worst]:.2g}, {worst})"


def fla_gated_rule_agrees(key_dim: int, value_dim: int) -> tuple[bool, str]:
    """Run FLA's gated chunk rule, guard lifted, against the torch kernel at these head dims on this GPU."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        with guard_lifted():
            errors = compare(chunk_gated_delta_rule, key_dim, value_dim)
    except Exception as err:  # noqa: BLE001 - a kernel that fails to build or run is a verdict too
        return False, f"raised {type(err).__name__}: {str(err)[:160]}"
    return verdict(errors)

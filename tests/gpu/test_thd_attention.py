"""Check: packed (THD) attention on torch's variable-length flash kernel against SDPA per packed
sample, both through ``SDPACoreAttention`` (``--attention-backend auto`` vs ``unfused``), forward
and backward in bf16.

Rows are the attention of the runs this project trains:
    35b_a3b language model   16 query / 2 key-value heads of 256, causal; a row of 8192 tokens
                             holding mixed conversations, and one holding 64 short ones
    vision encoder           16 heads of 72, full attention within each frame (images of 8 to
                             2304 patches)
Measured: error of each kernel against the fp32 per-sample reference on the same bf16-rounded
inputs (max |diff| / max |ref| and RMS ratio, worst of output and q/k/v gradients), and the time of
forward and forward+backward (median of 10 after warm-up). Target: varlen's RMS ratio <= 2e-2 and at
most twice per-sample SDPA's own bf16 error; the speed-up is reported, not asserted.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_results
from gpu_measure import errors, median_ms
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from examples.multimodal_dev.models.common.sdpa_attention import SDPACoreAttention
from examples.multimodal_dev.models.common.varlen_attention import VARLEN, thd_kernel

CHECK = "thd attention"
pytestmark = pytest.mark.gpu
BF16_RMS = 2e-2

CASES = {  # name -> (segment lengths, query heads, key-value heads, head size, causal)
    "35b_a3b mixed conversations": ((1, 63, 200, 700, 1500, 3000, 2728), 16, 2, 256, True),
    "35b_a3b 64 short conversations": ((128,) * 64, 16, 2, 256, True),
    "vision encoder frames": ((2304, 1296, 576, 1024, 64, 8), 16, 16, 72, False),
}


@pytest.fixture(autouse=True)
def _time_budget():
    if gpu_results.deadline_left() < 30:
        pytest.skip("out of tests/gpu/run.sh's time budget")


def _module(backend: AttnBackend, heads: int, groups: int, head_dim: int, causal: bool):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_backend=backend,
        attention_dropout=0.0,
    )
    mask = AttnMaskType.padding_causal if causal else AttnMaskType.no_mask
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=mask)


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_against_sdpa_per_sample(case, record):
    lengths, heads, groups, head_dim, causal = CASES[case]
    kernel, why = thd_kernel(AttnBackend.auto, True, torch.bfloat16, head_dim, 0.0)
    if kernel != VARLEN:
        record(case, "skip", note=f"varlen not used: {why}")
        pytest.skip(why)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to("cuda", torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    total = int(cu[-1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {
        "q": torch.randn(total, heads, head_dim, device="cuda", generator=gen),
        "k": torch.randn(total, groups, head_dim, device="cuda", generator=gen),
        "v": torch.randn(total, groups, head_dim, device="cuda", generator=gen),
    }
    grad_out = torch.randn(total, heads * head_dim, device="cuda", generator=gen)
    bf16 = {n: t.bfloat16().requires_grad_() for n, t in inputs.items()}
    fp32 = {n: t.bfloat16().float().requires_grad_() for n, t in inputs.items()}  # same rounded values
    varlen, per_sample = (_module(b, heads, groups, head_dim, causal) for b in (AttnBackend.auto, AttnBackend.unfused))

    def fwd_bwd(module, args):
        out = module(args["q"], args["k"], args["v"], None, packed_seq_params=params)
        return [out, *torch.autograd.grad(out, list(args.values()), grad_out.to(out.dtype))]

    reference = dict(zip(("out", "dq", "dk", "dv"), fwd_bwd(per_sample, fp32)))
    err = {
        name: errors(fwd_bwd(module, bf16), reference)
        for name, module in (("varlen", varlen), ("per-sample", per_sample))
    }

    def step(module):
        return lambda: fwd_bwd(module, bf16)

    def forward(module):
        def run():
            with torch.no_grad():
                module(bf16["q"], bf16["k"], bf16["v"], None, packed_seq_params=params)

        return run

    times = {
        f"{name} {what} ms": median_ms(make(module))
        for name, module in (("varlen", varlen), ("per-sample", per_sample))
        for what, make in (("fwd", forward), ("fwd+bwd", step))
    }
    ok = err["varlen"]["rms"] <= BF16_RMS and err["varlen"]["rms"] <= 2 * err["per-sample"]["rms"] + 1e-4
    metrics = {
        "tokens": total,
        "segments": len(lengths),
        "varlen max rel": err["varlen"]["rel"],
        "varlen rms": err["varlen"]["rms"],
        "varlen worst": err["varlen"]["worst"],
        "per-sample max rel": err["per-sample"]["rel"],
        "per-sample rms": err["per-sample"]["rms"],
        **times,
        "speed-up fwd+bwd": times["per-sample fwd+bwd ms"] / times["varlen fwd+bwd ms"],
    }
    note = (
        f"bf16 vs the fp32 per-sample reference; target varlen RMS ratio <= {BF16_RMS:g} and <= 2x per-sample's; "
        f"torch {torch.__version__}"
    )
    record(case, "pass" if ok else "fail", metrics, note)
    assert ok, f"{case}: {metrics}"


def test_context_parallel_chunks_in_one_varlen_call(record):
    """CP's one varlen call (models/common/cp_varlen.py): the kernel aligns a causal segment with
    more keys than queries to its last key (the start-up probe), and each CP=2 rank's local chunks
    against their key prefixes equal the whole row's rows (fp32 per-sample reference, bf16 inputs)."""
    from types import SimpleNamespace

    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm

    from examples.multimodal_dev.models.common.varlen_attention import bottom_right_causal

    case = "35b_a3b heads, CP=2, causal"
    if thd_kernel(AttnBackend.auto, True, torch.bfloat16, 256, 0.0)[0] != VARLEN:
        record(case, "skip", note="varlen not used")
        pytest.skip("varlen not used")
    aligned = bottom_right_causal("cuda:0", torch.bfloat16)
    cp, lengths = 2, (4, 64, 1500, 3000)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to("cuda", torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    total, local = int(cu[-1]), int(cu[-1]) // cp
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, 256, device="cuda", generator=gen).bfloat16() for h in (16, 2, 2))
    whole = _module(AttnBackend.unfused, 16, 2, 256, True)(
        q.float(), k.float(), v.float(), None, packed_seq_params=params
    )
    _, to_gathered = _build_thd_cp_a2a_perm(cu.cpu(), cp, total)
    worst = 0.0
    for rank in range(cp):
        module = _module(AttnBackend.auto, 16, 2, 256, True)
        module.cp_size, module.cp_group = cp, SimpleNamespace(rank=lambda rank=rank: rank)
        held = to_gathered[rank * local : (rank + 1) * local].cuda()
        out = module._cp_varlen(q[held], k, v, params, True).float()
        want = whole[held]
        worst = max(worst, float((out - want).square().mean().sqrt() / want.square().mean().sqrt()))
    ok = aligned and worst <= BF16_RMS
    record(
        case, "pass" if ok else "fail", {"bottom-right causal": aligned, "rms ratio": worst}, f"target <= {BF16_RMS:g}"
    )
    assert ok, (aligned, worst)

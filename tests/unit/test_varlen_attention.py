"""Packed (THD) attention kernels of the local backend.

Which kernel a call gets (``thd_kernel``) is tested for every combination of what decides it. The
call into ``torch.nn.attention.varlen.varlen_attn`` (``TorchVarlen``) is tested on this host against
SDPA per packed sample, through ``SDPACoreAttention``, with a stand-in for torch's kernel (it needs
CUDA) that computes attention by its own arithmetic and checks the contract of each of the two
signatures torch has shipped: int32 cu_seqlens on the tensors' device, the longest segment as
max_q / max_k, causality as ``is_causal`` (torch 2.10) or ``window_size`` (later), grouped-query
heads repeated where there is no ``enable_gqa``, and the scale folded into q where there is no
``scale``. The real kernel against per-sample SDPA is tests/gpu/test_thd_attention.py.
"""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from examples.multimodal_dev.models.common import sdpa_attention
from examples.multimodal_dev.models.common import varlen_attention as va
from examples.multimodal_dev.models.common.sdpa_attention import SDPACoreAttention

LENGTHS = (1, 7, 16, 33)
HEADS, HEAD_DIM = 4, 16
FULL = dict(cuda=True, dtype=torch.bfloat16, head_dim=128, dropout=0.0, available=True)


# --- which kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(AttnBackend))
@pytest.mark.parametrize(
    "change,blocker",
    [
        ({}, None),
        ({"cuda": False}, "varlen attention needs a CUDA device"),
        ({"available": False}, f"torch {torch.__version__} has no torch.nn.attention.varlen"),
        ({"dtype": torch.float32}, "varlen attention needs fp16 or bf16 (this run computes attention in float32)"),
        ({"dtype": torch.float16}, None),
        ({"head_dim": 72}, None),  # the vision encoder's
        ({"head_dim": 256}, None),  # the language model's
        ({"head_dim": 320}, "a head size that is a multiple of 8 up to 256 (this one: 320)"),
        ({"head_dim": 60}, "a head size that is a multiple of 8 up to 256 (this one: 60)"),
        ({"dropout": 0.1}, "varlen attention has no dropout (attention dropout 0.1)"),
    ],
)
def test_kernel_choice(backend, change, blocker):
    host = {**FULL, **change}
    wants_varlen = backend in (AttnBackend.flash, AttnBackend.auto)
    if backend == AttnBackend.flash and blocker:
        with pytest.raises(ValueError) as err:
            va.thd_kernel(backend, **host)
        assert str(err.value).startswith("--attention-backend flash on the local backend: ") and blocker in str(
            err.value
        )
        return
    kernel, why = va.thd_kernel(backend, **host)
    if wants_varlen and blocker is None:
        assert (kernel, why) == (va.VARLEN, f"--attention-backend {backend.name}")
    elif wants_varlen:
        assert kernel == va.PER_SAMPLE and blocker in why
    else:
        assert (kernel, why) == (va.PER_SAMPLE, f"--attention-backend {backend.name}")


def test_the_run_line_names_each_part_and_flash_is_refused_up_front():
    language = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=256)
    vision = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    line = va.describe_thd_kernels({"language model": language, "vision encoder": vision})
    if not torch.cuda.is_available():
        assert line == (
            "packed (THD) attention: language model SDPA per packed sample (varlen attention needs a CUDA "
            "device); vision encoder SDPA per packed sample (varlen attention needs a CUDA device)"
        )
        language.attention_backend = AttnBackend.flash
        with pytest.raises(ValueError, match="--attention-backend flash on the local backend: varlen attention needs"):
            va.describe_thd_kernels({"language model": language})
    language.attention_backend = AttnBackend.unfused
    assert (
        va.describe_thd_kernels({"language model": language})
        == "packed (THD) attention: language model SDPA per packed sample (--attention-backend unfused)"
    )


def test_megatron_local_attention_backend_is_one_line():
    from types import SimpleNamespace

    from examples.multimodal_dev.training import backend

    with pytest.raises(ValueError, match="^--attention-backend local is megatron's own --spec local; this model takes"):
        backend.check_attention_backend(SimpleNamespace(attention_backend=AttnBackend.local))
    backend.check_attention_backend(SimpleNamespace(attention_backend=AttnBackend.auto))


# --- the call into torch's kernel ---------------------------------------------------------------


def _reference(q, k, v, cu, causal: bool, scale: float):
    """Attention within each segment by explicit arithmetic (not SDPA); q [t, h, d], k/v [t, h, d]."""
    out = torch.empty_like(q)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * scale
        if causal:
            n = end - start
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[start:end])
    return out


def _check_segments(query, cu_q, cu_k, max_q, max_k, calls):
    assert cu_q.dtype == torch.int32 and cu_q.device == query.device and torch.equal(cu_q, cu_k)
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    calls.append(cu_q.tolist())


def _kernel_2_10(calls):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        _check_segments(query, cu_seq_q, cu_seq_k, max_q, max_k, calls)
        assert key.shape[1] == query.shape[1], "torch 2.10's kernel has no grouped-query heads"
        return _reference(query, key, value, cu_seq_q, is_causal, query.shape[-1] ** -0.5)

    return varlen_attn


def _kernel_later(calls):
    def varlen_attn(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        _check_segments(query, cu_seq_q, cu_seq_k, max_q, max_k, calls)
        assert tuple(window_size) in ((-1, -1), (-1, 0)) and enable_gqa == (key.shape[1] != query.shape[1])
        if enable_gqa:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return _reference(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)

    return varlen_attn


def _attention(backend: AttnBackend, groups: int, scale, causal: bool):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=groups,
        kv_channels=HEAD_DIM,
        attention_backend=backend,
        attention_dropout=0.0,
    )
    mask = AttnMaskType.padding_causal if causal else AttnMaskType.no_mask
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=mask, softmax_scale=scale)


@pytest.mark.parametrize("signature", ["torch 2.10", "later"])
@pytest.mark.parametrize(
    "groups,scale,causal",
    [(HEADS, None, True), (2, None, True), (2, 0.1, True), (HEADS, 0.3, False)],
    ids=["mha", "gqa", "gqa-scale", "full-scale"],
)
def test_varlen_call_equals_sdpa_per_sample(monkeypatch, signature, groups, scale, causal):
    calls = []
    kernel = va.TorchVarlen((_kernel_2_10 if signature == "torch 2.10" else _kernel_later)(calls))
    assert kernel.windowed == kernel.has_scale == kernel.has_gqa == (signature == "later")
    # This host as a CUDA host with torch's kernel: the module takes the varlen branch.
    real_choice = va.thd_kernel
    monkeypatch.setattr(
        sdpa_attention,
        "thd_kernel",
        lambda backend, cuda, dtype, head_dim, dropout: real_choice(
            backend, True, torch.bfloat16, head_dim, dropout, available=True
        ),
    )
    monkeypatch.setattr(sdpa_attention, "torch_varlen", lambda: kernel)

    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS) + 3  # the last sample's CP/SP padding tail sits inside its padded segment
    real = torch.tensor((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32)
    padded = real.clone()
    padded[-1] = total
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded
    )
    # float64: the two kernels' different summation orders stay far below the tolerance
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(total, groups, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )

    def run(module):
        out = module(q, k, v, None, packed_seq_params=params)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        return out, grads

    out, grads = run(_attention(AttnBackend.auto, groups, scale, causal))
    assert calls == [padded.tolist()]  # one call for the whole row, on the padded boundaries
    ref_out, ref_grads = run(_attention(AttnBackend.unfused, groups, scale, causal))  # per-sample SDPA
    assert len(calls) == 1 and out.shape == (total, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if scale is not None and signature == "torch 2.10":
        assert not math.isclose(scale, HEAD_DIM**-0.5)  # the fold into q was exercised


@pytest.mark.parametrize("backend", [AttnBackend.auto, AttnBackend.flash])
def test_a_varlen_kernel_that_raises(monkeypatch, capsys, backend):
    """auto says so once and keeps to per-sample SDPA (same output); flash stops."""
    calls = []

    def broken(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None, enable_gqa=False
    ):
        calls.append(1)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\nmore detail")

    monkeypatch.setattr(va, "_FAILED", [])
    monkeypatch.setattr(va, "torch_varlen", lambda: va.TorchVarlen(broken))
    monkeypatch.setattr(sdpa_attention, "torch_varlen", lambda: va.TorchVarlen(broken))
    real_choice = va.thd_kernel  # a CUDA host in bf16; whether varlen is usable is left to the module
    monkeypatch.setattr(
        sdpa_attention,
        "thd_kernel",
        lambda backend, cuda, dtype, head_dim, dropout: real_choice(backend, True, torch.bfloat16, head_dim, dropout),
    )
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    q, k, v = (torch.randn(12, HEADS, HEAD_DIM, dtype=torch.float64) for _ in range(3))
    module = _attention(backend, HEADS, None, True)
    if backend == AttnBackend.flash:
        with pytest.raises(RuntimeError, match="FlashAttention only supports"):
            module(q, k, v, None, packed_seq_params=params)
        return
    first = module(q, k, v, None, packed_seq_params=params)
    second = module(q, k, v, None, packed_seq_params=params)
    reference = _attention(AttnBackend.unfused, HEADS, None, True)(q, k, v, None, packed_seq_params=params)
    assert calls == [1] and torch.equal(first, reference) and torch.equal(second, reference)
    assert capsys.readouterr().out == (
        "packed (THD) attention: torch's varlen_attn raised RuntimeError: FlashAttention "
        "only supports Ampere GPUs or newer.; SDPA per packed sample from here on "
        "(--attention-backend flash would stop instead)\n"
    )
    assert va.thd_kernel(AttnBackend.auto, True, torch.bfloat16, HEAD_DIM, 0.0)[1].startswith(
        "torch's varlen_attn raised RuntimeError"
    )


# --- context parallelism's one call -------------------------------------------------------------


def _bottom_right_kernel(calls):
    """torch's later varlen_attn with key segments of their own, causal aligned to each segment's
    last key (flash-attention >= 2.1), by explicit arithmetic."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **_):
        assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and len(cu_seq_q) == len(cu_seq_k)
        assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
        calls.append(1)
        out = torch.empty_like(query)
        for qa, qb, ka, kb in zip(
            cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), cu_seq_k[:-1].tolist(), cu_seq_k[1:].tolist()
        ):
            scores = torch.einsum("qhd,khd->hqk", query[qa:qb], key[ka:kb]) * scale
            if tuple(window_size) == (-1, 0):
                keep = torch.arange(kb - ka)[None] <= torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
                scores = scores.masked_fill(~keep, float("-inf"))
            out[qa:qb] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[ka:kb])
        return out

    return varlen_attn


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_context_parallel_queries_in_one_varlen_call_equal_the_whole_row(monkeypatch, cp, causal):
    """Each CP rank's local chunks against their key prefixes, in one call (``cp_varlen.py``): the
    rows of the whole packed row's attention (one process, no CP) that the rank holds, and their
    gradients."""
    from types import SimpleNamespace

    from megatron.core.ssm.gated_delta_net.common import _build_thd_cp_a2a_perm

    calls = []
    monkeypatch.setattr(sdpa_attention, "torch_varlen", lambda: va.TorchVarlen(_bottom_right_kernel(calls)))
    lengths = [2 * cp * n for n in (1, 3, 5)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "qkv"
    )
    whole = _attention(AttnBackend.unfused, HEADS, None, causal)(q, k, v, None, packed_seq_params=params)
    _, to_gathered = _build_thd_cp_a2a_perm(cu, cp, total)  # gathered (rank-major) row -> global position
    local = total // cp
    for rank in range(cp):
        module = _attention(AttnBackend.auto, HEADS, None, causal)
        module.cp_size, module.cp_group = cp, SimpleNamespace(rank=lambda rank=rank: rank)
        held = to_gathered[rank * local : (rank + 1) * local]
        out = module._cp_varlen(q[held], k, v, params, causal)  # k, v: the sample-ordered keys every rank gathers
        torch.testing.assert_close(out, whole[held], rtol=1e-12, atol=1e-12)
        weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad((out * weights).sum(), (q, k, v))
        want = torch.autograd.grad((whole[held] * weights).sum(), (q, k, v), retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert len(calls) == cp  # one call a rank

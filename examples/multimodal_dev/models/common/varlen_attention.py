"""Which kernel computes packed (THD) attention on the local backend, and torch's variable-length one.

Two kernels compute the same thing, causal (or full) attention within each packed segment:

    varlen       ``torch.nn.attention.varlen.varlen_attn``: one flash-attention call over the whole
                 packed row, segments from cu_seqlens (CUDA, fp16/bf16, torch >= 2.10)
    per-sample   one ``F.scaled_dot_product_attention`` call per segment (any host, any dtype)

megatron's ``--attention-backend`` (``TransformerConfig.attention_backend``) picks between them:
``flash`` asks for varlen and is refused up front where it cannot run; ``auto`` (the default) takes
varlen whenever the call can use it; ``fused``, ``unfused`` and ``local`` keep per-sample SDPA.

``varlen_attn`` changed its signature between torch releases (2.10 takes ``is_causal``; later ones
take ``window_size`` and add ``scale`` and ``enable_gqa``): ``TorchVarlen`` reads which one it has
and calls it the same way for every version. Under ``auto``, a varlen call that raises is said
once and the process stays on per-sample SDPA (``varlen_failed``); under ``flash`` it raises.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from megatron.core.transformer.enums import AttnBackend

VARLEN, PER_SAMPLE = "varlen", "per-sample"
_FAILED: list[str] = []  # why torch's varlen_attn raised in this process: auto then keeps to per-sample SDPA
HALF_DTYPES = (torch.float16, torch.bfloat16)  # flash attention has no fp32 kernel
MAX_HEAD_DIM = 256  # and none for wider heads; the head size must also be a multiple of 8


class TorchVarlen:
    """``varlen_attn`` called as ``(q [t, h, d], k/v [t, g, d], cu, max_len, causal, scale)`` on every
    torch that has it."""

    def __init__(self, fn):
        params = inspect.signature(fn).parameters
        self.fn = fn
        self.windowed = "window_size" in params  # else the 2.10 form, with is_causal
        self.has_scale = "scale" in params
        self.has_gqa = "enable_gqa" in params

    def __call__(
        self, q, k, v, cu_seqlens: torch.Tensor, max_len: int, causal: bool, scale: float, cu_k=None, max_k=None
    ):
        """``cu_k`` / ``max_k``: key segments of their own (context parallelism's query chunks against
        their key prefixes); causal is then aligned to each segment's last key (flash's bottom right)."""
        kwargs: dict[str, Any] = {}  # what this torch's varlen_attn takes
        if k.shape[1] != q.shape[1]:
            if self.has_gqa:
                kwargs["enable_gqa"] = True
            else:
                repeat = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.windowed:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        if self.has_scale:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-12):
            q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel's own scale is 1/sqrt(head_dim)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        keys = cu if cu_k is None else cu_k.to(device=q.device, dtype=torch.int32)
        return self.fn(q, k, v, cu, keys, max_len, max_len if max_k is None else max_k, **kwargs)


@functools.lru_cache(maxsize=None)
def bottom_right_causal(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch's varlen kernel aligns causality to each segment's last key when a segment
    has more keys than queries, as flash-attention 2.1 and later do (SDPA's own ``is_causal`` aligns
    to the first): asked once a process, on a segment of 3 queries against 5 keys, against SDPA with
    that mask written out. Context parallelism's single varlen call relies on it."""
    kernel = torch_varlen()
    if kernel is None:
        return False
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, 2, 64, device=device, dtype=dtype, generator=g) for n in (3, 5, 5))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (3, 5))
    got = kernel(q, k, v, cu_q, 3, True, 64**-0.5, cu_k=cu_k, max_k=5)
    keep = torch.arange(5, device=device)[None] <= torch.arange(3, device=device)[:, None] + 2
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=keep, scale=64**-0.5
    )[0].transpose(0, 1)
    return bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))


@functools.lru_cache(maxsize=None)
def torch_varlen() -> TorchVarlen | None:
    """The installed torch's variable-length attention, or None where it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return TorchVarlen(varlen_attn)


def varlen_blocker(
    cuda: bool, dtype: torch.dtype, head_dim: int, dropout: float, available: bool | None = None
) -> str | None:
    """Why a THD attention call with these properties cannot run on varlen (None: it can)."""
    if not cuda:
        return "varlen attention needs a CUDA device"
    if available is None:
        if _FAILED:
            return _FAILED[0]
        available = torch_varlen() is not None
    if not available:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if dtype not in HALF_DTYPES:
        return f"varlen attention needs fp16 or bf16 (this run computes attention in {str(dtype).split('.')[-1]})"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"varlen attention needs a head size that is a multiple of 8 up to {MAX_HEAD_DIM} (this one: {head_dim})"
    if dropout:
        return f"varlen attention has no dropout (attention dropout {dropout})"
    return None


def varlen_failed(err: Exception) -> None:
    """Record (and say, once) that torch's varlen_attn raised: ``auto`` runs per-sample SDPA from now on."""
    if not _FAILED:
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        _FAILED.append(f"torch's varlen_attn raised {type(err).__name__}: {first_line}")
        print(
            f"packed (THD) attention: {_FAILED[0]}; SDPA per packed sample from here on "
            "(--attention-backend flash would stop instead)",
            flush=True,
        )


def thd_kernel(
    backend: AttnBackend, cuda: bool, dtype: torch.dtype, head_dim: int, dropout: float, available: bool | None = None
) -> tuple[str, str]:
    """(kernel, why) for a THD attention call under ``--attention-backend``; ``flash`` where varlen
    cannot run raises ValueError naming the flag."""
    if backend not in (AttnBackend.flash, AttnBackend.auto):
        return PER_SAMPLE, f"--attention-backend {backend.name}"
    blocker = varlen_blocker(cuda, dtype, head_dim, dropout, available)
    if blocker is None:
        return VARLEN, f"--attention-backend {backend.name}"
    if backend == AttnBackend.flash:
        raise ValueError(f"--attention-backend flash on the local backend: {blocker}")
    return PER_SAMPLE, blocker


def config_thd_kernel(config) -> tuple[str, str]:
    """``thd_kernel`` for a model part's TransformerConfig on this host, in the run's parameter dtype."""
    return thd_kernel(
        config.attention_backend,
        torch.cuda.is_available(),
        config.params_dtype,
        config.kv_channels,
        config.attention_dropout,
    )


def describe_thd_kernels(parts: dict) -> str:
    """One line for the start of a local-backend run: the kernel of each part's packed attention
    (``parts``: name -> TransformerConfig)."""
    names = {VARLEN: "torch varlen_attn (flash)", PER_SAMPLE: "SDPA per packed sample"}
    said = []
    for part, config in parts.items():
        kernel, why = config_thd_kernel(config)
        said.append(f"{part} {names[kernel]} ({why})")
    return "packed (THD) attention: " + "; ".join(said)

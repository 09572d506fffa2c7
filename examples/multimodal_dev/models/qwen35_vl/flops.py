"""Model FLOPs of one Qwen3.5-VL micro-batch, counted on the work actually done.

A multiply-add is 2 FLOPs; element-wise work (norms, activations, rotary, gates) is left out,
as is usual for model-FLOPs utilisation. Training FLOPs are 3x the forward (the backward
computes gradients for inputs and for weights); frozen towers are not discounted.

Per token of the language model (H hidden, V vocabulary):
  Gated DeltaNet layer  in_proj 2*H*(2*Kd + 2*Vd + 2*nv) with Kd = nk*dk, Vd = nv*dv (q, k, v, z, b, a)
                        causal conv 2*w*(2*Kd + Vd) (depthwise, kernel w)
                        chunked delta rule, per value head: 6*dk*dv (read the state for the output
                        and for the delta, update it) + 2*c*(dk + dv) (scores and mixing inside a
                        chunk of c = 64 tokens)
                        out_proj 2*Vd*H
  attention layer       qkv 2*H*(2*nh*hd + 2*nkv*hd) (query and output gate, key, value), o_proj
                        2*nh*hd*H; the causal core per sample of L tokens: 2*nh*hd*L*(L+1)
                        (QK^T and AV over the keys each query sees), on real lengths, not padding
  MLP                   dense 6*H*F; MoE router 2*H*E, top_k experts 6*H*Fe each, shared expert
                        6*H*Fs plus its gate 2*H
  output layer          2*H*V; each MTP layer adds eh_proj 4*H*H, one attention layer with its MLP,
                        and the output layer again
Vision tower, per image or video of grid (t, h, w), n = h*w patches per frame, D hidden, I MLP:
  patch embedding 2*P*D per patch (P = C*t_p*p*p); per block qkv 6*D*D, proj 2*D*D, MLP 4*D*I
  per patch and the bidirectional core 4*D*n^2 per frame; patch merger per merged token
  2*(m*D)^2 + 2*m*D*H with m = merge^2.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, SupportsInt

if TYPE_CHECKING:
    from .configuration import Qwen35VLShape, VisionShape

GDN_CHUNK = 64  # chunk length of the chunked gated delta rule (FLA's and the torch kernel's)


@dataclass
class FlopsBreakdown:
    vision: float = 0.0
    gdn: float = 0.0
    attention: float = 0.0
    mlp: float = 0.0
    output: float = 0.0
    mtp: float = 0.0

    @property
    def forward(self) -> float:
        return self.vision + self.gdn + self.attention + self.mlp + self.output + self.mtp

    @property
    def training(self) -> float:
        return 3.0 * self.forward


def _mlp_per_token(t) -> float:
    h = t.hidden_size
    if not t.is_moe:
        return 6.0 * h * t.ffn_hidden_size
    return (
        2.0 * h * t.num_experts
        + t.moe_top_k * 6.0 * h * t.moe_ffn_hidden_size
        + 6.0 * h * t.shared_expert_ffn_hidden_size
        + 2.0 * h
    )


def gdn_layer_flops(t, tokens: int) -> float:
    h, nk, nv, dk, dv = (
        t.hidden_size,
        t.linear_num_key_heads,
        t.linear_num_value_heads,
        t.linear_key_head_dim,
        t.linear_value_head_dim,
    )
    kd, vd = nk * dk, nv * dv
    per_token = (
        2.0 * h * (2 * kd + 2 * vd + 2 * nv)
        + 2.0 * t.linear_conv_kernel_dim * (2 * kd + vd)
        + nv * (6.0 * dk * dv + 2.0 * GDN_CHUNK * (dk + dv))
        + 2.0 * vd * h
    )
    return per_token * tokens


def attention_layer_flops(t, lengths) -> float:
    h, nh, nkv, hd = t.hidden_size, t.num_attention_heads, t.num_kv_heads, t.head_dim
    tokens = sum(lengths)
    projections = (2.0 * h * (2 * nh * hd + 2 * nkv * hd) + 2.0 * nh * hd * h) * tokens
    core = sum(2.0 * nh * hd * n * (n + 1) for n in lengths)
    return projections + core


def vision_flops(v: VisionShape, out_hidden: int, grids: Iterable[Sequence[int]]) -> float:
    d, m = v.hidden_size, v.spatial_merge_size**2
    total = 0.0
    for t, hh, ww in grids:
        n, patches = hh * ww, t * hh * ww
        per_patch_block = 6.0 * d * d + 2.0 * d * d + 4.0 * d * v.intermediate_size
        total += 2.0 * v.patch_dim * d * patches
        total += v.depth * (per_patch_block * patches + t * 4.0 * d * n * n)
        total += (patches // m) * (2.0 * (m * d) ** 2 + 2.0 * m * d * out_hidden)
    return total


def micro_batch_flops(
    shape: Qwen35VLShape, lengths: Iterable[SupportsInt], grids: Iterable[Iterable[SupportsInt]] = ()
) -> FlopsBreakdown:
    """Forward FLOPs of a micro-batch of samples with these real token ``lengths`` (one per
    packed or padded sample) and these vision ``grids`` [(t, h, w), ...]."""
    t = shape.text
    real = [int(n) for n in lengths]
    tokens = sum(real)
    n_full = sum(1 for lt in t.layer_types if lt == "full_attention")
    n_gdn = t.num_layers - n_full
    out = FlopsBreakdown()
    out.vision = vision_flops(shape.vision, t.hidden_size, [tuple(int(x) for x in g) for g in grids])
    out.gdn = n_gdn * gdn_layer_flops(t, tokens)
    out.attention = n_full * attention_layer_flops(t, real)
    out.mlp = t.num_layers * _mlp_per_token(t) * tokens
    out.output = 2.0 * t.hidden_size * t.vocab_size * tokens
    mtp_layer = (
        4.0 * t.hidden_size**2 * tokens
        + attention_layer_flops(t, real)
        + _mlp_per_token(t) * tokens
        + 2.0 * t.hidden_size * t.vocab_size * tokens
    )
    out.mtp = t.mtp_num_layers * mtp_layer
    return out

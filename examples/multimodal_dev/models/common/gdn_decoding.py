"""Cached decoding through megatron-core's ``GatedDeltaNet`` layer: what megatron-core 0.19.2 refuses
(its forward raises on an inference context).

Per sequence a layer carries two states between calls:

    conv       [B, D, W - 1]  the last W - 1 inputs of its depthwise causal conv (D = q, k, v channels)
    recurrent  [B, H, K, V]   the gated delta rule's state (fp32)

A prompt (prefill) runs the layer's own chunked kernel from a zero state and keeps the final one; each
new token then costs one conv step and one recurrent step, whatever the prefix length. Prompts of a
batch are left-padded: padding enters the conv as zeros and writes nothing into the state (no decay,
beta = 0), so a padded row's state is the unpadded row's.

The layer's own projections, q/k preparation, decay, gated norm and output projection run unchanged:
only the sequence mixing is replaced. Tensor parallelism splits heads, so every state is per rank;
context and sequence parallelism are off while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GatedDeltaNetState:
    conv: torch.Tensor  # [B, D, W - 1], the dtype the conv computes in
    recurrent: torch.Tensor  # [B, H, K, V] fp32


def conv_with_state(x_BSD, weight_DW, bias, state_BDW: torch.Tensor | None):
    """SiLU(depthwise causal conv) of ``x`` continued from ``state`` (zeros: the start of a sequence):
    (output [B, S, D] in x's dtype, the new state: the last W - 1 inputs)."""
    width = weight_DW.shape[-1]
    x = x_BSD.float().transpose(1, 2)
    if state_BDW is None:
        state_BDW = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    window = torch.cat([state_BDW.to(x.dtype), x], dim=-1)
    out = F.conv1d(window, weight_DW.float()[:, None, :], None if bias is None else bias.float(), groups=x.shape[1])
    return F.silu(out).transpose(1, 2).to(x_BSD.dtype), window[..., window.shape[-1] - (width - 1) :]


def recurrent_step(q, k, v, g, beta, state, scale: float | None = None):
    """One token of the gated delta rule: q/k [B, 1, H, K], v [B, 1, H, V], g/beta [B, 1, H], state
    [B, H, K, V] -> (o [B, 1, H, V] in q's dtype, the new state). The chunked kernel's recurrence:

        S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = scale S^T q
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_, k_, v_, g_, b_ = (t[:, 0].float() for t in (q, k, v, g, beta))
    state = state * g_.exp()[..., None, None]
    delta = (v_ - torch.einsum("bhkv,bhk->bhv", state, k_)) * b_[..., None]
    state = state + k_[..., :, None] * delta[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q_ * scale)
    return out[:, None].to(q.dtype), state


def cached_forward(layer, hidden_states, context):
    """``layer`` (a megatron-core GatedDeltaNet) over ``hidden_states`` [S, B, H], the tokens at
    ``context.sequence_len_offset`` onwards, continuing the state ``context`` holds for it; returns
    (output [S, B, H], bias) as the layer's forward does. ``context`` is a ``generation.context``
    ``DecodingContext``: the layer's state (``gdn_states``) and which positions are real (``real``)."""
    # megatron's jit_fuser helpers (torch.compile) would recompile for every new prompt shape: a
    # compile costs seconds, a decode step milliseconds
    with torch.compiler.set_stance("force_eager"):
        return _cached_forward(layer, hidden_states, context)


def _cached_forward(layer, hidden_states, context):
    if layer.cp_size > 1 or layer.config.sequence_parallel:
        raise ValueError(
            "decoding with context or sequence parallelism: generation runs with --context-parallel-size 1 "
            "and without --sequence-parallel"
        )
    seq_len, batch, _ = hidden_states.shape
    qkvzba, _ = layer.in_proj(hidden_states)
    qkv, gate, beta, alpha = torch.split(qkvzba.transpose(0, 1), layer.feat_dim_split, dim=-1)
    gate = gate.reshape(batch, seq_len, -1, layer.value_head_dim)
    start = context.sequence_len_offset
    real = context.real[:batch, start : start + seq_len].to(qkv.device)  # [B, S]
    padded = not bool(real.all())
    if padded:
        qkv = qkv * real[..., None].to(qkv.dtype)  # padding enters the conv as zeros
    state = context.gdn_states.get(layer.layer_number)
    bias = layer.conv1d.bias if layer.conv_bias else None
    qkv, conv_state = conv_with_state(qkv, layer.conv1d.weight.squeeze(1), bias, None if state is None else state.conv)
    query, key, value, gate, beta, alpha = layer._prepare_input_for_gated_delta_rule(
        qkv, gate, batch, seq_len, beta, alpha
    )
    g, beta = layer._compute_g_and_beta(layer.A_log, layer.dt_bias, alpha, beta)
    if padded:  # and writes nothing into the state: no decay, no update
        g, beta = g * real[..., None], beta * real[..., None].to(beta.dtype)
    if seq_len == 1 and state is not None:
        out, recurrent = recurrent_step(query, key, value, g, beta, state.recurrent)
    else:
        out, recurrent = layer.gated_delta_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=None if state is None else state.recurrent,
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
    context.gdn_states[layer.layer_number] = GatedDeltaNetState(conv_state, recurrent.float())
    return layer.out_proj(layer._gated_norm_and_a2a(out, gate, None, batch, seq_len, None))

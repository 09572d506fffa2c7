"""Parameters a rank of a launch layout holds, counted from the shape alone (no build): the
layout planner weighs thousands of layouts a second with it. ``meta_builds.rank_build`` builds the
same ranks on the meta device; ``tests/unit/test_meta_builds.py`` holds the two equal, parameter
for parameter in total, at every rank kind of several layouts.

How megatron-core 0.19.2 splits each tensor (TP = tensor parallel, ETP = expert tensor parallel,
EP = expert parallel; the rest replicated on the rank):

  word embeddings, output layer      vocab rows / TP (first stage; last stage; the MTP head also
                                     keeps a copy of the embeddings on the last stage)
  GDN in_proj, conv1d, A_log,        heads / TP (column parallel); out_proj input / TP (row
    dt_bias, out_proj                parallel); A_log and dt_bias are fp32 (``GatedDeltaNetFp32Decay``)
  attention linear_qkv, linear_proj  heads / TP; q/k norms (head_dim) replicated
  dense MLP fc1 / fc2                ffn / TP
  MoE                                E / EP experts a rank, each ffn / ETP (expert parameters:
                                     reduced and sharded over expert DP); router [E, H] and the
                                     shared expert's gate [1, H] replicated; shared expert ffn / TP
  norms, biases of row-parallel      replicated
    linears
  vision tower (first stage)         patch embedding and position table replicated; each block's
                                     qkv / fc1 (with biases) and proj / fc2 split over TP like
                                     the decoder's; the merger's fc1 column- and fc2 row-parallel
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.qwen35_vl.configuration import FULL, Qwen35VLShape
from .pipeline_layout import stage_layers


@dataclass
class StageParams:
    """Parameters of one rank, by the bytes they cost: ``dense`` (bf16 weights, sharded over
    DP x CP), ``fp32`` (fp32 weights, their own main copy), ``expert`` (bf16, over expert DP)."""

    dense: int = 0
    fp32: int = 0
    expert: int = 0
    vision: int = 0  # of ``dense``: the vision tower's share
    mtp: int = 0  # of the three: the MTP head's share (its embeddings copy included)

    @property
    def total(self) -> int:
        return self.dense + self.fp32 + self.expert


def vision_params(shape: Qwen35VLShape, tp: int) -> int:
    v, out = shape.vision, shape.vision.out_hidden_size
    d, i, m = v.hidden_size, v.intermediate_size, v.spatial_merge_size**2
    block = (
        4 * d  # two LayerNorms, weight and bias
        + (3 * d * d + 3 * d) // tp
        + d * d // tp
        + d  # qkv (+ bias), proj (+ replicated bias)
        + (d * i + i) // tp
        + i * d // tp
        + d
    )  # fc1 (+ bias), fc2 (+ replicated bias)
    merger = 2 * d + (m * d * m * d + m * d) // tp + m * d * out // tp + out
    return v.patch_dim * d + d + v.num_position_embeddings * d + v.depth * block + merger


def layer_params(shape: Qwen35VLShape, layer_type: str, tp: int, ep: int, etp: int) -> StageParams:
    t, h = shape.text, shape.text.hidden_size
    out = StageParams()
    if layer_type == FULL:
        q, kv = t.num_attention_heads * t.head_dim, t.num_kv_heads * t.head_dim
        out.dense += h + h * (2 * q + 2 * kv) // tp + 2 * t.head_dim + q * h // tp
    else:
        kd = t.linear_num_key_heads * t.linear_key_head_dim
        vd = t.linear_num_value_heads * t.linear_value_head_dim
        nv = t.linear_num_value_heads
        out.dense += (
            h
            + h * (2 * kd + 2 * vd + 2 * nv) // tp
            + (2 * kd + vd) * t.linear_conv_kernel_dim // tp
            + t.linear_value_head_dim
            + vd * h // tp
        )
        out.fp32 += 2 * nv // tp
    out.dense += h  # pre-MLP norm
    if t.num_experts is not None:  # MoE
        fs = t.shared_expert_ffn_hidden_size
        out.dense += t.num_experts * h + h + 3 * h * fs // tp
        out.expert += t.num_experts // ep * 3 * h * t.moe_ffn_hidden_size // etp
    else:
        out.dense += 3 * h * t.ffn_hidden_size // tp
    return out


def _add(into: StageParams, part: StageParams, times: int = 1) -> None:
    into.dense += part.dense * times
    into.fp32 += part.fp32 * times
    into.expert += part.expert * times


def _adapter(rank: int, kind: str, n_in: int, n_out: int, tp: int) -> int:
    """A LoRA adapter's parameters on one rank: ``A`` [r, in] and ``B`` [out, r], the side the
    weight splits over TP split alike (``lora/adapter.py``)."""
    return rank * (n_in + n_out // tp) if kind == "column" else rank * (n_in // tp + n_out)


def _layer_adapters(shape: Qwen35VLShape, layer_type: str, layout, lora) -> StageParams:
    """Adapters of one decoder layer on a rank: ``dense`` and ``expert`` (the routed experts')."""
    t, h, tp, r = shape.text, shape.text.hidden_size, layout.tp, lora.rank
    linears = []  # (target, column or row, in, out)
    if layer_type == FULL:
        q, kv = t.num_attention_heads * t.head_dim, t.num_kv_heads * t.head_dim
        linears += [("linear_qkv", "column", h, 2 * q + 2 * kv), ("linear_proj", "row", q, h)]
    else:
        kd = t.linear_num_key_heads * t.linear_key_head_dim
        vd = t.linear_num_value_heads * t.linear_value_head_dim
        out = 2 * kd + 2 * vd + 2 * t.linear_num_value_heads
        linears += [("in_proj", "column", h, out), ("out_proj", "row", vd, h)]
    ffn = t.shared_expert_ffn_hidden_size if t.is_moe else t.ffn_hidden_size  # the shared expert's, or dense
    linears += [("linear_fc1", "column", h, 2 * ffn), ("linear_fc2", "row", ffn, h)]
    out = StageParams(dense=sum(_adapter(r, k, i, o, tp) for n, k, i, o in linears if n in lora.targets))
    if t.is_moe:
        f, etp = t.moe_ffn_hidden_size, layout.etp
        per_expert = (_adapter(r, "column", h, 2 * f, etp) if "linear_fc1" in lora.targets else 0) + (
            _adapter(r, "row", f, h, etp) if "linear_fc2" in lora.targets else 0
        )
        out.expert = t.num_experts // layout.ep * per_expert
    return out


def _vision_adapters(shape: Qwen35VLShape, tp: int, lora) -> int:
    v, r = shape.vision, lora.rank
    d, i, md = v.hidden_size, v.intermediate_size, v.spatial_merge_size**2 * v.hidden_size
    block = {
        "vision.linear_qkv": ("column", d, 3 * d),
        "vision.linear_proj": ("row", d, d),
        "vision.linear_fc1": ("column", d, i),
        "vision.linear_fc2": ("row", i, d),
    }
    merger = {
        "vision.merger.linear_fc1": ("column", md, md),
        "vision.merger.linear_fc2": ("row", md, v.out_hidden_size),
    }
    return sum(
        _adapter(r, *linear, tp) * times
        for table, times in ((block, v.depth), (merger, 1))
        for name, linear in table.items()
        if name in lora.targets
    )


def adapter_params(shape: Qwen35VLShape, layout, pp_rank: int, lora) -> StageParams:
    """LoRA adapters (``lora``: ``lora.targets.LoraSettings``) on any rank of stage ``pp_rank``:
    the parameters that train, all of them bf16 (``dense``, or ``expert`` for the routed experts')."""
    t = shape.text
    chunks = stage_layers(t.num_layers, layout.pp, layout.vp, layout.first, layout.last)[pp_rank]
    kinds = {kind: _layer_adapters(shape, kind, layout, lora) for kind in set(t.layer_types)}
    out = StageParams()
    for chunk in chunks:
        for i in chunk:
            _add(out, kinds[t.layer_types[i]])
    if pp_rank == 0:
        out.vision = _vision_adapters(shape, layout.tp, lora)
        out.dense += out.vision
    return out


def stage_params(shape: Qwen35VLShape, layout, pp_rank: int) -> StageParams:
    """Parameters of any rank of pipeline stage ``pp_rank`` (every rank of a stage holds the same
    counts: TP and EP shards are equal). ``layout``: ``meta_builds.Layout``."""
    t, h, tp = shape.text, shape.text.hidden_size, layout.tp
    chunks = stage_layers(t.num_layers, layout.pp, layout.vp, layout.first, layout.last)[pp_rank]
    out = StageParams()
    kinds = {kind: layer_params(shape, kind, tp, layout.ep, layout.etp) for kind in set(t.layer_types)}
    for chunk in chunks:
        for i in chunk:
            _add(out, kinds[t.layer_types[i]])
    embedding = t.vocab_size * h // tp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if first:
        out.vision = vision_params(shape, tp)
        out.dense += out.vision + embedding
    if last:
        # megatron builds an output layer on the last stage even when tied (pp > 1), a copy
        # kept equal by the embedding group's all-reduce; with one stage it is the embedding itself,
        # and with the MTP head the head's copy of the embeddings (below)
        out.dense += h + (0 if t.tie_word_embeddings and (first or t.mtp_num_layers) else embedding)
        if t.mtp_num_layers:
            mtp = StageParams()
            _add(mtp, kinds.get(FULL) or layer_params(shape, FULL, tp, layout.ep, layout.etp), t.mtp_num_layers)
            mtp.dense += t.mtp_num_layers * (3 * h + 2 * h * h // tp)  # enorm, hnorm, final norm, eh_proj
            mtp.dense += 0 if first else embedding  # the head's own copy of the word embeddings
            _add(out, mtp)
            out.mtp = mtp.total
    return out

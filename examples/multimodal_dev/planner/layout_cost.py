"""What one launch layout costs: memory per rank of every pipeline stage and the time of a step.

Memory of a rank (GiB), for a bf16 run with megatron's distributed optimizer:
  weights, gradients, optimizer   ``rank_params.stage_params``, exact against the meta-device
                                  builds (``meta_builds.rank_memory``'s rule: bf16 weights, fp32
                                  gradient buffer, fp32 main copy + Adam moments sharded over
                                  DP x CP, experts' over expert DP; unsharded without the
                                  distributed optimizer)
    under Megatron-FSDP           (``Layout.fsdp``, ``optim_grads_params``) the weights and the fp32
                                  gradients sharded as the optimizer state is, plus what is held
                                  whole (``fsdp_units``; not checked against a build): two FSDP
                                  units' bf16 weights (the largest decoder layer or vision block of
                                  the stage, running and prefetched), one unit's fp32 gradient
                                  before its reduce-scatter (or the word embeddings' / output
                                  layer's, if larger), and the parameters in no unit (embeddings,
                                  output layer, the tower's patch embedding and merger, the MTP
                                  head's projection) in bf16 for the whole step: megatron-core keeps
                                  those gathered
  activations                     ``activation_memory.micro_batch_activations`` of the mix's
                                  median row, times the micro-batches a stage holds at the
                                  schedule's peak: 1F1B keeps min(PP - p, m) on stage p; the
                                  interleaved schedule (VP chunks) keeps min(m VP, 2 (PP - p - 1) +
                                  (VP - 1) PP + 1) chunks of 1/VP of the stage (megatron's warm-up
                                  count); recompute adds one layer's working set once. The GPU
                                  kernels' terms (TE, FLA, flash attention), bf16
  usable                          the GPU's memory less ``reserve`` (CUDA context, NCCL buffers,
                                  allocator fragmentation)

Time of a step (seconds), on the busiest stage, nothing assumed hidden unless said:
  compute        the stage's training FLOPs of a micro-batch (``flops.py``; recompute adds the
                 forward again) / (TP x CP) at ``efficiency`` of the GPU's peak
  TP / SP        per decoder layer and micro-batch 4 all-gathers + 4 reduce-scatters (forward and
                 backward) of the stage's [tokens / CP, H] activations (the vision tower's too)
  CP             Gated DeltaNet's head all-to-alls (q, k, v in; output back; twice for the
                 backward) and attention's K/V ring (P2P, CP - 1 hops, K/V and dK/dV)
  EP             per MoE layer 4 all-to-alls (dispatch, combine; forward and backward) of the
                 routed copies [tokens x top_k, H] of the rank's tokens
  PP             one activation forward and one gradient back per micro-batch and stage boundary,
                 and the bubble: (m + (PP - 1) / VP) micro-batch times of the busiest stage
  DP             the distributed optimizer's reduce-scatter (fp32 gradients) and all-gather (bf16
                 weights), overlapped with the last micro-batch's backward and the first's forward
                 (``--overlap-grad-reduce --overlap-param-gather``): only what sticks out counts.
                 Under Megatron-FSDP, on every micro-batch: an all-gather of the units' bf16
                 weights before the forward (less what the forward share of the micro-batch, 1/3,
                 hides), and another plus the reduce-scatter of all fp32 gradients in the backward
                 (less the backward share, 2/3); the parameters in no unit are gathered once a step,
                 with the first forward
  imbalance      the pipeline time times the slowest DP rank's FLOPs over the mean
                 (``layout_mix.Mix.imbalance``, the loader's dealing of rows by FLOPs)
A collective over a group moves (n - 1) / n of its bytes per GPU at the group's link: NVLink when
the group's ranks share a node (megatron's rank order: TP fastest, then CP, DP, PP; experts ETP,
EP, expert DP), the network otherwise; an all-to-all splits its bytes by where its peers are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..models import model_of
from ..models.qwen35_vl.configuration import FULL
from ..models.qwen35_vl.flops import FlopsBreakdown
from .activation_memory import micro_batch_activations
from .launch_layout import Layout
from .pipeline_layout import stage_layers
from .rank_params import StageParams, adapter_params, layer_params, stage_params, vision_params

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """Peak dense bf16 TFLOP/s, memory, and the bandwidth a collective achieves per GPU (GB/s, one
    direction): NVLink within a node, the network across nodes (one NIC per GPU). Link figures are
    80 % of the nominal ones, about what NCCL's bus bandwidth reaches at large messages."""

    name: str
    peak_tflops: float
    memory_gib: float
    nvlink_gbs: float
    network_gbs: float
    gpus_per_node: int = 8


HARDWARE = {
    # NVLink 4: 450 GB/s a direction; 8 x 400 Gb/s ConnectX-7 (50 GB/s a GPU)
    "h100": Hardware("H100 SXM 80GB", 989.0, 80, 360.0, 40.0),
    "h200": Hardware("H200 SXM 141GB", 989.0, 141, 360.0, 40.0),
    # NVLink 5: 900 GB/s a direction; 400 Gb/s a GPU
    "b200": Hardware("B200 180GB", 2250.0, 180, 720.0, 40.0),
}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    mbs: int = 1
    recompute: str | None = None

    def describe(self) -> str:
        return (
            self.layout.describe() + f", MBS={self.mbs}" + (f", recompute {self.recompute}" if self.recompute else "")
        )


@dataclass
class StageMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float  # of the micro-batches in flight
    per_micro_batch: float
    in_flight: float
    vision: float  # of weights + grads + optimizer + activations: the vision tower's
    mtp: float  # the MTP head's
    recompute_saves: float  # activations recompute leaves out (0 without it)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclass
class StepTime:
    compute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0  # point-to-point and bubble
    dp: float = 0.0  # what the overlap leaves
    imbalance: float = 0.0  # the slowest DP rank's extra time
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.pp + self.dp + self.imbalance


def _link(hw: Hardware, size: int, stride: int) -> float:
    """Seconds per byte of a ring collective over ``size`` ranks ``stride`` apart."""
    on_node = size * stride <= hw.gpus_per_node
    return 1.0 / ((hw.nvlink_gbs if on_node else hw.network_gbs) * 1e9)


def _all_to_all(hw: Hardware, size: int, stride: int) -> float:
    """Seconds per byte sent by one rank of an all-to-all: peers on the node at NVLink, the rest on the network."""
    per_node = max(1, min(size, hw.gpus_per_node // stride)) if stride < hw.gpus_per_node else 1
    local = (per_node - 1) / (size - 1) if size > 1 else 1.0
    return local / (hw.nvlink_gbs * 1e9) + (1 - local) / (hw.network_gbs * 1e9)


def in_flight(layout, pp_rank: int, micro_batches: int) -> float:
    """Micro-batches of a full stage whose activations stage ``pp_rank`` holds at its peak."""
    pp, vp = layout.pp, layout.vp or 1
    if vp == 1:
        return min(pp - pp_rank, micro_batches)
    chunks = min(micro_batches * vp, 2 * (pp - pp_rank - 1) + (vp - 1) * pp + 1)
    return chunks / vp


def state_bytes(params: StageParams, layout, distributed_optimizer: bool = True, adapters=None) -> tuple:
    """(weights, gradients, optimizer state) bytes of a rank's parameters: bf16 weights (fp32 for
    the fp32 ones), one fp32 gradient each, Adam's two fp32 moments plus an fp32 main copy of each
    bf16 parameter, sharded over DP x CP (experts: expert DP) by the distributed optimizer, and
    under Megatron-FSDP the weights and gradients too (what FSDP holds whole: ``fsdp_held_bytes``).
    ``adapters`` (LoRA's, bf16): ``params`` are frozen, only the adapters have gradients and state."""
    sharded = distributed_optimizer or layout.fsdp
    dense = layout.dense_shards if sharded else 1
    expert = layout.expert_dp if sharded else 1
    if adapters is not None:
        return (
            2 * (params.dense + params.expert) + 4 * params.fp32 + 2 * adapters.total,
            4 * adapters.total,
            12 * adapters.dense / dense + 12 * adapters.expert / expert,
        )
    optimizer = 12 * params.dense / dense + 8 * params.fp32 / dense + 12 * params.expert / expert
    if layout.fsdp:
        return (
            2 * params.dense / dense + 4 * params.fp32 / dense + 2 * params.expert / expert,
            4 * (params.dense + params.fp32) / dense + 4 * params.expert / expert,
            optimizer,
        )
    return 2 * (params.dense + params.expert) + 4 * params.fp32, 4 * params.total, optimizer


@dataclass(frozen=True)
class FsdpUnits:
    """A stage's parameters as Megatron-FSDP groups them: its units are transformer layers (the
    decoder's, the MTP head's, the vision tower's blocks), gathered whole one at a time; what is in
    no unit stays gathered (megatron-core keeps non-unit buckets, "persistently allocated")."""

    largest: StageParams  # the largest unit of the stage
    outside: int  # bf16 parameters in no unit
    largest_outside: int  # its largest tensor: the word embeddings or output layer [vocab / TP, H]


def fsdp_units(shape, layout, pp_rank: int) -> FsdpUnits:
    """``rank_params``' per-layer counts of stage ``pp_rank`` (its ``layer_params`` and ``vision_params``, the
    same counts ``stage_params`` sums); what is in no unit is the stage's total less its units'."""
    t, tp = shape.text, layout.tp
    chunks = stage_layers(t.num_layers, layout.pp, layout.vp, layout.first, layout.last)[pp_rank]
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    kinds = Counter(t.layer_types[i] for c in chunks for i in c)
    units = [(layer_params(shape, kind, tp, layout.ep, layout.etp), n) for kind, n in kinds.items()]  # (one, how many)
    if last and t.mtp_num_layers:
        units.append((layer_params(shape, FULL, tp, layout.ep, layout.etp), t.mtp_num_layers))
    if first:
        no_blocks = vision_params(replace(shape, vision=replace(shape.vision, depth=0)), tp)
        units.append(
            (StageParams(dense=(vision_params(shape, tp) - no_blocks) // shape.vision.depth), shape.vision.depth)
        )
    in_units = sum(unit.total * n for unit, n in units)
    largest = max((unit for unit, _ in units), key=lambda unit: unit.total)
    embeddings = t.vocab_size * t.hidden_size // tp if first or last else 0
    return FsdpUnits(largest, stage_params(shape, layout, pp_rank).total - in_units, embeddings)


def fsdp_held_bytes(units: FsdpUnits) -> tuple[float, float]:
    """(weights, gradients) bytes Megatron-FSDP holds whole besides its shards: two units' bf16
    weights (the one running, the one prefetched) and the parameters in no unit; one unit's fp32
    gradient before its reduce-scatter, or the largest tensor in no unit's if larger."""
    unit = units.largest
    weights = 2 * (2 * (unit.dense + unit.expert) + 4 * unit.fp32) + 2 * units.outside
    return weights, 4 * max(unit.total, units.largest_outside)


def stage_memory(
    shape,
    cand: Candidate,
    rows,
    micro_batches: int,
    distributed_optimizer: bool = True,
    lora=None,
    vision_chunk_patches: int = 0,
):
    """[StageMemory of every pipeline stage] for micro-batches of ``rows`` (``layout_mix.Row``s);
    ``lora`` (``lora.targets.LoraSettings``): a LoRA run, the base frozen; ``vision_chunk_patches``:
    the tower run in chunks of at most that many patches."""
    lay, t = cand.layout, shape.text
    lengths = [n for r in rows for n in r.lengths]
    grids = [g for r in rows for g in r.grids]
    kw = dict(
        dtype_bytes=2,
        tp=lay.tp,
        sp=lay.tp > 1,
        cp=lay.cp,
        etp=lay.etp,
        kernels="gpu",
        vision_chunk_patches=vision_chunk_patches,
    )
    act = micro_batch_activations(shape, lengths, grids, recompute=cand.recompute, **kw)
    plain = micro_batch_activations(shape, lengths, grids, recompute=None, **kw) if cand.recompute else act
    if lora and not lora.trains_vision:  # a frozen tower without adapters keeps nothing for a backward
        act, plain = (replace(a, vision=0.0, vision_recompute_working=0.0) for a in (act, plain))
    out = []
    for p, chunks in enumerate(stage_layers(t.num_layers, lay.pp, lay.vp, lay.first, lay.last)):
        sp = stage_params(shape, lay, p)
        layers = [i for c in chunks for i in c]
        n_attn = sum(t.layer_types[i] == FULL for i in layers)
        first, last = p == 0, p == lay.pp - 1
        flight = in_flight(lay, p, micro_batches)
        per_mb = act.stage(len(layers) - n_attn, n_attn, first, last)
        saves = (plain.stage(len(layers) - n_attn, n_attn, first, last) - per_mb) * flight if cand.recompute else 0.0

        adapters = adapter_params(shape, lay, p, lora) if lora else None
        w, g, o = state_bytes(sp, lay, distributed_optimizer, adapters)
        if lay.fsdp and not adapters:
            held_w, held_g = fsdp_held_bytes(fsdp_units(shape, lay, p))
            w, g = w + held_w, g + held_g
        vision_adapters = StageParams(dense=adapters.vision) if adapters else None
        vision = sum(state_bytes(StageParams(dense=sp.vision), lay, distributed_optimizer, vision_adapters))
        vision += act.vision * flight if first else 0.0
        mtp_share = sp.mtp / sp.total if sp.total else 0.0
        own = 2 * sp.mtp if adapters else (w + g + o) * mtp_share  # frozen under LoRA: bf16 weights alone
        mtp = own + (act.mtp * flight if last else 0.0)  # its parameters' share
        working = act.working(first, last)  # one layer (or vision chunk) recomputed at a time; 0 without
        activations = (per_mb - working) * flight + working
        out.append(StageMemory(w, g, o, activations, per_mb, flight, vision, mtp, saves))
    return out


def decoder_layer_flops(shape, fb, layers) -> float:
    """Forward FLOPs of these decoder ``layers`` out of a micro-batch's ``FlopsBreakdown``: each
    layer its kind's mean of the attention or Gated DeltaNet FLOPs, and the MLP's mean."""
    t = shape.text
    n_attn_all = sum(lt == FULL for lt in t.layer_types)
    attention, gdn = fb.attention / max(n_attn_all, 1), fb.gdn / max(t.num_layers - n_attn_all, 1)
    n_attn = sum(t.layer_types[i] == FULL for i in layers)
    return n_attn * attention + (len(layers) - n_attn) * gdn + len(layers) * (fb.mlp / t.num_layers)


@dataclass(frozen=True)
class _MicroBatchWork:
    """What every stage's time of one micro-batch reads: its FLOPs, its tokens, and how often each
    part of the model runs over them."""

    flops: FlopsBreakdown  # forward
    local_tokens: float  # a TP group's tokens (each TP rank 1/TP of them under SP)
    act_bytes: float  # bf16 [local_tokens, H] activations
    vision_tokens: int  # the micro-batch's patches
    passes: int  # forward, input gradient (, weight gradient)
    recompute: float  # the decoder's passes grow by the forward run again in the backward
    vision_passes: int


def _micro_batch_work(shape, cand: Candidate, lengths, grids, lora, vision_chunk_patches: int) -> _MicroBatchWork:
    """The micro-batch's FLOPs, tokens and passes. A LoRA run needs no weight gradient (2 passes,
    not 3) and a tower without adapters runs forward only; a chunked tower, like recompute, runs
    its forward again in the backward."""
    lay = cand.layout
    fb = model_of(shape).micro_batch_flops(shape, lengths, grids)
    passes = 2 if lora else 3  # forward, input gradient (, weight gradient)
    recompute = (passes + 1) / passes if cand.recompute else 1.0  # the forward runs again in the backward
    chunked = vision_chunk_patches and sum(t * h * w for t, h, w in grids) / lay.cp > vision_chunk_patches
    vision_passes = 1 if lora and not lora.trains_vision else passes + (1 if cand.recompute or chunked else 0)
    local_tokens = sum(lengths) / lay.cp
    return _MicroBatchWork(
        flops=fb,
        local_tokens=local_tokens,
        act_bytes=local_tokens * shape.text.hidden_size * 2,
        vision_tokens=sum(tt * hh * ww for tt, hh, ww in grids),
        passes=passes,
        recompute=recompute,
        vision_passes=vision_passes,
    )


def _stage_flops(shape, lay, work: _MicroBatchWork, p: int, layers: list[int]) -> float:
    """Training FLOPs of a micro-batch on stage ``p``: its decoder layers, the tower on the first
    stage, the output layer and MTP head on the last."""
    fb = work.flops
    flops = decoder_layer_flops(shape, fb, layers) * work.passes * work.recompute
    if p == 0:
        flops += fb.vision * work.vision_passes
    if p == lay.pp - 1:
        flops += (fb.output + fb.mtp) * work.passes
    return flops


def _tp_seconds(shape, lay, hw: Hardware, work: _MicroBatchWork, p: int, n_layers: int) -> float:
    """SP's 4 all-gathers + 4 reduce-scatters per layer of ``n_layers`` (the MTP head's included),
    and on the first stage per block of the vision tower."""
    ring, tp_link = (lay.tp - 1) / lay.tp, _link(hw, lay.tp, 1)
    tp = 8 * ring * work.act_bytes * n_layers * tp_link
    if p == 0:
        tp += 8 * ring * work.vision_tokens * shape.vision.hidden_size * 2 * shape.vision.depth * tp_link
    return tp


def _cp_seconds(t, lay, hw: Hardware, work: _MicroBatchWork, n_gdn: int, n_attn: int) -> float:
    """Gated DeltaNet's head all-to-alls and attention's K/V ring over the CP group."""
    cp = 0.0
    if lay.cp > 1:
        kd = t.linear_num_key_heads * t.linear_key_head_dim
        vd = t.linear_num_value_heads * t.linear_value_head_dim
        a2a = (lay.cp - 1) / lay.cp * _all_to_all(hw, lay.cp, lay.tp)
        cp += n_gdn * 2 * work.local_tokens * (2 * kd + 2 * vd) / lay.tp * 2 * a2a
        kv = work.local_tokens * 2 * t.num_kv_heads * t.head_dim / min(lay.tp, t.num_kv_heads) * 2
        cp += n_attn * 3 * (lay.cp - 1) * kv * _link(hw, lay.cp, lay.tp)
    return cp


def _ep_seconds(t, lay, hw: Hardware, work: _MicroBatchWork, moe_layers: int) -> float:
    """Per MoE layer 4 all-to-alls (dispatch, combine; forward and backward) of the routed copies."""
    if not (t.is_moe and lay.ep > 1):
        return 0.0
    ep_link = _all_to_all(hw, lay.ep, lay.etp)
    return (
        moe_layers * 4 * (lay.ep - 1) / lay.ep * work.local_tokens / lay.tp * t.moe_top_k * t.hidden_size * 2 * ep_link
    )


def _p2p_seconds(lay, hw: Hardware, work: _MicroBatchWork) -> float:
    """One activation forward and one gradient back per micro-batch (and virtual stage) boundary."""
    if lay.pp <= 1:
        return 0.0
    stage_span = lay.tp * lay.cp * lay.dp
    pp_link = 1.0 / ((hw.nvlink_gbs if stage_span < hw.gpus_per_node else hw.network_gbs) * 1e9)
    return 2 * work.act_bytes / lay.tp * pp_link * (lay.vp or 1)


def _stage_seconds(shape, lay, hw: Hardware, flop_rate: float, work: _MicroBatchWork, p: int, layers) -> dict:
    """Seconds of one micro-batch on stage ``p`` (holding decoder ``layers``), by part."""
    t = shape.text
    n_attn = sum(t.layer_types[i] == FULL for i in layers)
    with_mtp = len(layers) + (t.mtp_num_layers if p == lay.pp - 1 else 0)
    return dict(
        compute=_stage_flops(shape, lay, work, p, layers) / (lay.tp * lay.cp) / flop_rate,
        tp=_tp_seconds(shape, lay, hw, work, p, with_mtp),
        cp=_cp_seconds(t, lay, hw, work, len(layers) - n_attn, n_attn),
        ep=_ep_seconds(t, lay, hw, work, with_mtp),
        p2p=_p2p_seconds(lay, hw, work),
    )


def _dp_not_hidden(shape, lay, hw: Hardware, lora, per_mb: float) -> float:
    """Seconds of the distributed optimizer's reduce-scatter (fp32 gradients) and all-gather (bf16
    weights) of the heaviest stage that the last micro-batch's backward and the first's forward
    do not hide."""
    dense_n, expert_n = lay.dense_shards, lay.expert_dp
    trained = (lambda p: adapter_params(shape, lay, p, lora)) if lora else (lambda p: stage_params(shape, lay, p))
    heaviest = max((trained(p) for p in range(lay.pp)), key=lambda s: s.total)
    dense_link = _link(hw, dense_n, lay.tp)
    expert_link = _link(hw, expert_n, lay.etp * lay.ep)
    dp_bytes = [(heaviest.dense + heaviest.fp32) * (dense_n - 1) / dense_n, heaviest.expert * (expert_n - 1) / expert_n]
    reduce_scatter = 4 * (dp_bytes[0] * dense_link + dp_bytes[1] * expert_link)
    all_gather = 2 * (dp_bytes[0] * dense_link + dp_bytes[1] * expert_link)
    backward = per_mb * 2 / 3
    return max(0.0, reduce_scatter - backward) + max(0.0, all_gather - (per_mb - backward))


def _fsdp_not_hidden(shape, lay, hw: Hardware, per_mb: float, micro_batches: int) -> float:
    """Seconds of Megatron-FSDP's collectives of the heaviest stage that compute does not hide, on
    every micro-batch: the units' bf16 weights all-gathered before the forward (against its third
    of the micro-batch) and again in the backward with the reduce-scatter of every fp32 gradient
    (against its two thirds); the parameters in no unit gathered once, with the first forward."""
    dense_n, expert_n = lay.dense_shards, lay.expert_dp
    p = max(range(lay.pp), key=lambda p: stage_params(shape, lay, p).total)
    heaviest, outside = stage_params(shape, lay, p), fsdp_units(shape, lay, p).outside
    dense_link = (dense_n - 1) / dense_n * _link(hw, dense_n, lay.tp)
    expert_link = (expert_n - 1) / expert_n * _link(hw, expert_n, lay.etp * lay.ep)
    unit_gather = (2 * (heaviest.dense - outside) + 4 * heaviest.fp32) * dense_link + 2 * heaviest.expert * expert_link
    outside_gather = 2 * outside * dense_link
    reduce_scatter = 4 * (heaviest.dense + heaviest.fp32) * dense_link + 4 * heaviest.expert * expert_link
    forward, backward = per_mb / 3, per_mb * 2 / 3
    first_forward = max(0.0, unit_gather + outside_gather - forward)
    later_forwards = max(0.0, unit_gather - forward) * (micro_batches - 1)
    return first_forward + later_forwards + max(0.0, unit_gather + reduce_scatter - backward) * micro_batches


def step_time(
    shape,
    cand: Candidate,
    rows,
    micro_batches: int,
    dp_imbalance: float,
    hw: Hardware,
    efficiency: float,
    lora=None,
    vision_chunk_patches: int = 0,
) -> StepTime:
    """Seconds of one training step (``micro_batches`` micro-batches of ``rows`` per pipeline).
    ``lora``: a LoRA run. Its frozen weights need no weight gradient, so the backward is the input
    gradient alone (2 forward-sized passes, not 3; the adapters' own are negligible), a tower
    without adapters runs forward only (nothing flows back into it), and the distributed
    optimizer moves the adapters' gradients and weights alone. ``vision_chunk_patches``: the chunked
    tower runs its forward again in the backward (as recompute does)."""
    lay, t = cand.layout, shape.text
    lengths = [n for r in rows for n in r.lengths]
    grids = [g for r in rows for g in r.grids]
    work = _micro_batch_work(shape, cand, lengths, grids, lora, vision_chunk_patches)
    flop_rate = hw.peak_tflops * 1e12 * efficiency
    stages = [
        _stage_seconds(shape, lay, hw, flop_rate, work, p, [i for c in chunks for i in c])
        for p, chunks in enumerate(stage_layers(t.num_layers, lay.pp, lay.vp, lay.first, lay.last))
    ]
    busiest = max(stages, key=lambda s: sum(s.values()))
    per_mb = sum(busiest.values())
    out = StepTime()
    for key in ("compute", "tp", "cp", "ep"):
        setattr(out, key, busiest[key] * micro_batches)
    bubble = (lay.pp - 1) / (lay.vp or 1) * per_mb if lay.pp > 1 else 0.0
    out.pp = busiest["p2p"] * micro_batches + bubble
    out.imbalance = (dp_imbalance - 1.0) * per_mb * micro_batches
    if lay.fsdp:
        out.dp = _fsdp_not_hidden(shape, lay, hw, per_mb, micro_batches)
    else:
        out.dp = _dp_not_hidden(shape, lay, hw, lora, per_mb)
    out.parts = dict(
        busiest_stage=stages.index(busiest),
        bubble=bubble,
        flops=work.flops.training * micro_batches * lay.dp,
        vision_flops=work.flops.vision * 3 * micro_batches * lay.dp,
    )
    return out

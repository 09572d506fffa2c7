"""Bytes of activations one rank keeps for the backward of one micro-batch, by model part.

What is counted: every tensor autograd saves for backward (``ctx.save_for_backward`` and the
saved operands of ordinary ops), once per storage (a saved view holds its whole storage), weights
left out. ``tests/unit/test_activation_memory.py`` measures exactly that on CPU and checks every
part within 10% (at tp = 1 it matches within 12 bytes: the loss scalars).

Legend: T tokens of the micro-batch's row(s) (packed: every sample padded to the collate's
multiple of 2cp, x tp under SP; padded: samples x ``padded_to``); L_i its segments (packed
samples, or padded rows); Tl = T/cp this rank's tokens; Tn = Tl/tp under sequence parallelism,
else Tl (the norm/residual region and the column-parallel linears' saved input). b the model's
bytes per value (4 fp32, 2 bf16): many saved tensors are fp32 whatever b is (the 4s below).
H hidden; nh / ng query / KV heads of hd channels (ng never below 1 per rank), rd = hd x rotary
fraction; nk / nv GDN key / value heads of dk / dv, Kd = nk dk, Vd = nv dv, Dc = 2Kd + Vd, w conv
width; F dense FFN; E experts, k top-k, Fe / Fs expert / shared FFN, R = Tn x etp x k routed
tokens (balanced routing: what a rank's experts see whatever EP is); V vocabulary. Head and FFN
counts are this rank's: /tp (experts' FFN /etp); the GDN interior runs on all T tokens with
heads /(tp cp) (its all-to-all). Vision: P patches of this rank: under CP the frames (an image,
or one temporal patch of a video) its deal gives the rank with the most patches (the model's deal:
``work_deal.deal`` by FLOPs); D hidden (D' = D/tp per rank), I MLP /tp, hv heads /tp,
dh = D/heads.

kernels="torch" (what a CPU host runs, measured): torch norms keep their fp32 input (a copy
in bf16), the fp32 normalised product and rsqrt: norm(n, c) = 8nc + 4n + 4c.
  embedding  8T ids + T image-token mask (with images) + 8Tl CP split index (cp > 1)
  vision     b P (C t p^2) pixels + 4 bilinear taps x (8P + bP)
             per block: 2 x [4PD + 8P (+8D bf16)] LayerNorms + 2bPD (qkv, fc1 inputs) + 7bPD'
             (rotated q, k; v as a view of the whole qkv output: 3; out; proj input) + 4bP dh
             rotary cos/sin + 4P hv softmax stats + 2bPI (GELU input, fc2 input)
             merger 2bPD + 2bPD' + 2bP
  gdn_layer  norm(Tn, H) + bTnH; conv 4Dc sum(L_i + w - 1) + 4T Dc (+16T packed, +4Dc w bf16);
             l2norm (4 fp32 | 8 bf16) T 2Kd + 8T nk; gates 8T nv + bT nv; gated out-norm 16T Vd
             + 4T nv + bT Vd; out_proj input bTl Vd; the chunk kernel (fp32, C = 64, M = sum
             ceil(L_i / C) chunks): 4M nv (a C^2 + c C dk + d C dv + 3C + 1 + dk dv) + 16T,
             (a, c, d) = (5, 6, 3) when dk + dv <= C (one triangular solve) else (6, 7, 3);
             dk dv: the state entering each chunk, which the scan's backward reads
  attention  norm(Tn, H) + bTnH + norm(Tl nh, hd) + norm(Tl ng, hd) (fp32: the whole qkv output
             4Tl(2nh + 2ng)hd instead of the k copy) + 4bTl rd rotary + SDPA bTl nh hd (q, out)
             x 2 + 2bT nh hd (k, v repeated to nh heads; all-gathered: full T, under CP) + 4Tl nh
             + output gate bTl nh hd (packed only: the per-sample outputs' concatenation)
             + 4Tl nh hd (fp32 sigmoid) + proj input bTl nh hd
  mlp_layer  norm(Tn, H) + bTnH + dense 5bTl F (fc1 output 2F, silu, x_linear + 0, product);
             MoE router 28Tn k + 4Tn E + Tn + (b + 1)Tn E + 8E + 12, experts bR(H + 1 + 6Fe), shared
             5bTl Fs + bTn(H + 1)
  output     norm(Tn, H) + bTnH + 4Tl V (fp32 softmax, even in bf16) + 13Tl (targets, masks)
  mtp        per layer: 3 norm(Tn, H) + 2bTnH (eh_proj input) + attention + mlp, and outside
             what recompute would rerun 8Tl ids + bTnH (its half of the output layer's input)
             + 4Tl V + 17Tl

kernels="gpu" (derived from the sources, not measured): Transformer Engine's fused
norm + linear keeps its input, its b-byte output and fp32 rsigma (2bnc + 4n; a LayerNorm +4n);
TE norms keep input and rsigma; ``TEDotProductAttention`` (flash / cuDNN) keeps q, k, v (not
repeated), out and fp32 softmax_lse; TE's fused rotary keeps only the shared table; megatron's
fused SwiGLU keeps its input. Flash-linear-attention (these three measured on CPU under Triton's
interpreter, to the byte, fp32 and bf16): ``causal_conv1d`` keeps its input, a view that holds
in_proj's whole output bT(2Kd + 2Vd + 2nv) (silu is recomputed), ``l2norm`` its output and fp32
rstd, ``ChunkGatedDeltaRuleFunction.forward`` q, k, v (q, k repeated to nv heads by megatron
when nv > nk), g (fp32 chunk cumsum), beta and A ([T, nv, 64] in k's dtype): no per-chunk C x C
products, unlike the torch kernel. megatron's ``jit_fuser`` helpers (gates, gated out-norm,
output gate) run under torch.compile on a GPU host and are taken to keep their inputs (and the
norm's fp32 rstd). Experts, SequentialMLP or the grouped GEMMs of ``models/common/grouped_experts.py``
(which save the same tensors): fc1 output 2Fe, product, scaled product per routed token.

The torch kernels lay a packed row's tokens out in chunks once a micro-batch (16T + 8n: each token's
chunk and place, the sequence order), and every GDN layer keeps that one layout; and every layer
keeps the same two C x C masks (made once a process, 2C^2): ``gdn_shared``.

vision_chunk_patches=N (``--vision-chunk-patches``): the tower runs over chunks of whole frames of at
most N patches, each under recompute: it keeps its pixels (b P C t p^2), and while one chunk is
recomputed it saves what one pass over that chunk saves, pixels left out (a view of those kept);
the largest chunk counts.

recompute="full" (uniform, 1 layer): a decoder (or MTP) layer keeps its input bTnH (in
``gdn_layer`` / ``attention_layer``; ``mlp_layer`` 0; MTP keeps two: hidden and embeddings);
``per_stage`` the table and mask every checkpoint shares (4Tl rd + Tl); the vision tower shares
megatron's recompute flags (``models/common/config_from_args.py``), so each block keeps bPD plus
the blocks' shared rotary 4P dh. While one layer is recomputed in backward it saves its plain
bytes again (``*_recompute_working``), less its kept input where its first norm saves that very
tensor (torch fp32, and TE).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..models import model_of
from ..models.common.work_deal import deal

CHUNK = 64  # the GDN kernels' chunk length (torch and FLA)
KERNELS = ("torch", "gpu")


@dataclass(frozen=True)
class ActivationBreakdown:
    """Bytes one rank keeps for the backward of one micro-batch, by part."""

    vision: float  # vision tower incl. patch merger (first stage)
    embedding: float  # word embedding output / merge of image features (first stage)
    gdn_layer: float  # ONE Gated DeltaNet layer's mixer part incl. its input norm
    attention_layer: float  # ONE gated attention layer's mixer part incl. its input norm
    mlp_layer: float  # ONE decoder layer's MLP (dense or MoE) incl. its pre-MLP norm
    output: float  # final norm + output layer + loss (last stage)
    mtp: float  # the MTP head, all its layers (last stage); 0 without MTP
    recompute_working: float  # recompute: saved while ONE decoder layer is recomputed (0 without)
    per_stage: float = 0.0  # once per stage: the recompute checkpoints' shared rotary table and mask
    gdn_shared: float = 0.0  # once per stage with GDN layers: the torch kernels' masks and packed layout
    vision_recompute_working: float = 0.0  # saved while one ViT block is recomputed (first stage)
    mtp_recompute_working: float = 0.0  # saved while one MTP layer is recomputed (last stage)

    def working(self, first: bool, last: bool) -> float:
        """Bytes live on top of the kept ones while the stage's largest layer is recomputed."""
        return max(
            self.recompute_working,
            self.vision_recompute_working if first else 0.0,
            self.mtp_recompute_working if last else 0.0,
        )

    def stage(self, n_gdn: int, n_attention: int, first: bool, last: bool) -> float:
        """Bytes of a pipeline stage holding these layers: its parts, plus the working set once."""
        layers = n_gdn * (self.gdn_layer + self.mlp_layer) + n_attention * (self.attention_layer + self.mlp_layer)
        ends = (self.vision + self.embedding if first else 0.0) + (self.output + self.mtp if last else 0.0)
        shared = self.per_stage + (self.gdn_shared if n_gdn else 0.0)
        return layers + ends + shared + self.working(first, last)


def _norm(n, c):
    """A torch norm over n rows of c: fp32 input (or copy), fp32 normalised product, rsqrt, 1 + w."""
    return 8 * n * c + 4 * n + 4 * c


def _segments(lengths, padded_to, multiple):
    """The row's segments as the kernels see them: samples padded to ``multiple``, or rows."""
    if padded_to is None:
        return [-(-n // multiple) * multiple for n in lengths]
    if max(lengths) > padded_to:
        raise ValueError(f"padded_to {padded_to} is shorter than a sample of {max(lengths)} tokens")
    return [padded_to] * len(lengths)


def _chunks(segments) -> int:
    """Chunks of the GDN scan: every sequence padded to whole chunks, at least one."""
    return sum(max(1, -(-n // CHUNK)) for n in segments)


def _gdn(t, T, Tl, Tn, segs, b, tp, cp, packed, gpu):
    h, w = t.hidden_size, t.linear_conv_kernel_dim
    nk, nv = t.linear_num_key_heads / (tp * cp), t.linear_num_value_heads / (tp * cp)
    dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
    kd, vd, dc = nk * dk, nv * dv, (2 * nk * dk + nv * dv)
    out_proj = b * Tl * t.linear_num_value_heads / tp * dv
    if gpu:
        repeat = 2 * b * T * nv * dk if nv > nk else 0.0  # else q, k are views of l2norm's output
        in_proj = b * T * (dc + vd + 2 * nv)  # FLA's conv saves its input: a view of in_proj's whole output
        return (
            2 * b * Tn * h
            + 4 * Tn
            + in_proj
            + b * T * 2 * kd
            + 8 * T * nk
            + repeat
            + b * T * vd
            + 2 * b * T * nv
            + 4 * T * nv
            + b * T * nv * CHUNK  # alpha, beta; FLA g, A
            + 2 * b * T * vd
            + 4 * T * nv
            + out_proj
        )  # gated norm: kernel output, gate, rstd
    bf16 = b < 4
    conv = 4 * dc * sum(n + w - 1 for n in segs) + 4 * T * dc + (16 * T if packed else 0) + (4 * dc * w if bf16 else 0)
    l2norm = (8 if bf16 else 4) * T * 2 * kd + 8 * T * nk  # fp32 input (cast twice in bf16), rsqrt
    gates = 8 * T * nv + b * T * nv + 8 * nv  # softplus input and output, sigmoid beta, exp(A_log)
    out_norm = 16 * T * vd + 4 * T * nv + 4 * dv + b * T * vd  # norm, fp32 gate, silu(gate), normed
    a, c, d = (5, 6, 3) if dk + dv <= CHUNK else (6, 7, 3)
    kernel = 4 * _chunks(segs) * nv * (a * CHUNK**2 + c * CHUNK * dk + d * CHUNK * dv + 3 * CHUNK + 1 + dk * dv) + (
        0 if packed else _chunk_layout(T, segs)  # packed: one layout for every layer (gdn_shared)
    )
    return _norm(Tn, h) + b * Tn * h + conv + l2norm + gates + kernel + out_norm + out_proj


def _chunk_layout(T, segs) -> float:
    """The torch kernel's step-major chunk layout: each token's chunk and place in it, the sequence order."""
    return 16 * T + 8 * len(segs)


def _attention(t, T, Tl, Tn, b, tp, cp, packed, gpu):
    h, hd = t.hidden_size, t.head_dim
    nh, ng = t.num_attention_heads / tp, max(1.0, t.num_kv_heads / tp)
    q, kv = Tl * nh * hd, Tl * ng * hd
    if gpu:  # fused norm+qkv; q/k norms; flash q, k, v, out, lse; gate; proj input
        return (
            2 * b * Tn * h + 4 * Tn + b * (q + kv) + 4 * Tl * (nh + ng) + b * (2 * q + 2 * kv) + 4 * Tl * nh + 2 * b * q
        )
    k_norm = _norm(Tl * ng, hd) if b < 4 else 4 * Tl * (2 * nh + 2 * ng) * hd + 4 * kv + 4 * Tl * ng + 4 * hd
    rotary = 4 * b * Tl * int(hd * t.partial_rotary_factor)
    sdpa = 2 * b * q + 2 * b * (T if cp > 1 else Tl) * nh * hd + 4 * Tl * nh  # the CP path gathers k, v
    gate = (b * q if packed else 0) + 4 * q
    return _norm(Tn, h) + b * Tn * h + _norm(Tl * nh, hd) + k_norm + rotary + sdpa + gate + b * q


def _mlp(t, Tl, Tn, b, tp, etp, gpu):
    h = t.hidden_size
    norm = b * Tn * h + 4 * Tn if gpu else _norm(Tn, h)
    if not t.is_moe:
        f = t.ffn_hidden_size / tp
        return 2 * b * Tn * h + 4 * Tn + 3 * b * Tl * f if gpu else norm + b * Tn * h + 5 * b * Tl * f
    e, k = t.num_experts, t.moe_top_k
    fe, fs = t.moe_ffn_hidden_size / etp, t.shared_expert_ffn_hidden_size / tp
    routed = Tn * etp * k
    router = 28 * Tn * k + 4 * Tn * e + Tn + (b + 1) * Tn * e + 8 * e + 12  # top-k x2, softmaxes, masks
    experts = b * routed * (h + 1 + (4 if gpu else 6) * fe)  # permuted tokens and probs, the GLU
    shared = (3 if gpu else 5) * b * Tl * fs + b * Tn * (h + 1)  # its GLU, and its sigmoid gate
    return norm + b * Tn * h + router + experts + shared


def rank_frames(shape, grids, cp: int) -> list[tuple]:
    """The frames the CP rank with the most patches encodes (all items when cp is 1)."""
    if cp == 1 or not grids:
        return list(grids)
    v = shape.vision
    frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
    flops = model_of(shape).vision_flops
    owned = deal([flops(v, v.out_hidden_size, [f]) for f in frames], cp)
    return [frames[i] for i in max(owned, key=lambda items: sum(frames[i][1] * frames[i][2] for i in items))]


def chunk_patches(frames, patches: int) -> list[int]:
    """Patches of each chunk of whole frames of at most ``patches`` (``vision_encoder.frame_chunks``)."""
    chunks, held = [], 0
    for t, h, w in frames:
        for _ in range(t):
            if held and held + h * w > patches:
                chunks.append(held)
                held = 0
            held += h * w
    return chunks + ([held] if held else [])


def _vision(v, grids, b, tp, gpu):
    """(stem + merger, one block, patches) of this rank's ``grids``."""
    p = sum(t * h * w for t, h, w in grids)
    if not p:
        return 0.0, 0.0, 0.0
    d, dl, i, hv = v.hidden_size, v.hidden_size / tp, v.intermediate_size / tp, v.num_heads / tp
    stem = b * p * v.patch_dim + 4 * (8 * p + b * p)
    if gpu:
        block = 2 * (2 * b * p * d + 8 * p) + 5 * b * p * dl + 4 * p * hv + 2 * b * p * i
        return stem + 2 * b * p * d + 2 * b * p * dl + 8 * p, block, p
    norms = 2 * (4 * p * d + 8 * p + (8 * d if b < 4 else 0))
    block = norms + 2 * b * p * d + 7 * b * p * dl + 4 * b * p * d / v.num_heads + 4 * p * hv + 2 * b * p * i
    return stem + 2 * b * p * d + 2 * b * p * dl + 2 * b * p, block, p


def _vision_saved(v, frames, b, tp, gpu, recompute, reuses: bool) -> tuple[float, float]:
    """(kept through the forward, saved while one block is recomputed) of the tower over ``frames``."""
    stem_merger, block, p = _vision(v, frames, b, tp, gpu)
    if not p:
        return 0.0, 0.0
    if recompute is None:
        return stem_merger + v.depth * block, 0.0
    dh = v.hidden_size / v.num_heads
    return stem_merger + v.depth * b * p * v.hidden_size + 4 * p * dh, block - (
        b * p * v.hidden_size if reuses else 0.0
    )


def _check_request(lengths, recompute, kernels) -> None:
    """Refuse a kernel set, recompute setting or empty micro-batch the model of bytes does not know."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    if recompute not in (None, "full"):
        raise ValueError(f"recompute {recompute!r}: expected None or 'full' (megatron's uniform, 1 layer)")
    if not lengths:
        raise ValueError("lengths: a micro-batch has at least one sample")


def _rank_vision_saved(shape, grids, b, tp, cp, gpu, recompute, vision_chunk_patches) -> tuple[float, float]:
    """(kept, saved while one block is recomputed) of the tower over this rank's frames; chunked, it
    keeps only the pixels and saves the largest chunk's bytes while that chunk is recomputed."""
    v = shape.vision
    frames = rank_frames(shape, grids, cp)
    vision, vision_working = _vision_saved(v, frames, b, tp, gpu, recompute, reuses=gpu or b == 4)
    patches = sum(t * h * w for t, h, w in frames)
    if vision_chunk_patches and patches > vision_chunk_patches:  # kept: the pixels; one chunk at a time
        largest = max(chunk_patches(frames, vision_chunk_patches))
        kept, working = _vision_saved(v, [(1, largest, 1)], b, tp, gpu, recompute, reuses=gpu or b == 4)
        vision, vision_working = b * patches * v.patch_dim, kept + working - b * largest * v.patch_dim
    return vision, vision_working


def _under_recompute(plain: ActivationBreakdown, t, b, Tl, Tn, sp, gpu, mtp_layer, mtp_outer) -> ActivationBreakdown:
    """``plain`` under full recompute: each decoder (and MTP) layer keeps its input alone, and one
    layer's plain bytes are saved again while it is recomputed."""
    kept = b * Tn * t.hidden_size  # a checkpointed layer's input
    mask = 0 if sp else Tl  # the padding mask (the model drops it under SP)
    reused = kept if gpu or b == 4 else 0.0  # the recomputed first norm saves the kept input itself
    return replace(
        plain,
        gdn_layer=kept,
        attention_layer=kept,
        mlp_layer=0.0,
        mtp=t.mtp_num_layers * (2 * kept + mask + mtp_outer),  # hidden, embeddings, rolled mask
        recompute_working=max(plain.gdn_layer, plain.attention_layer) + plain.mlp_layer - reused,
        per_stage=4 * Tl * int(t.head_dim * t.partial_rotary_factor) + mask,
        gdn_shared=0.0,
        mtp_recompute_working=mtp_layer - 2 * reused if t.mtp_num_layers else 0.0,
    )


def micro_batch_activations(
    shape,
    lengths,
    grids=(),
    *,
    dtype_bytes=2,
    tp=1,
    sp=False,
    cp=1,
    etp=1,
    recompute=None,
    padded_to=None,
    kernels="torch",
    vision_chunk_patches=0,
) -> ActivationBreakdown:
    """Bytes per part of a micro-batch of samples of these real token ``lengths`` and images of
    these ``grids`` [(t, h, w)]: packed (THD) or, with ``padded_to``, padded rows (BSHD)."""
    _check_request(lengths, recompute, kernels)
    t, b, gpu = shape.text, dtype_bytes, kernels == "gpu"
    segs = _segments([int(n) for n in lengths], padded_to, (2 * cp if cp > 1 else 1) * (tp if sp else 1))
    T = float(sum(segs))
    Tl = T / cp
    Tn = Tl / tp if sp else Tl
    grids = [tuple(int(x) for x in g) for g in grids]
    vision, vision_working = _rank_vision_saved(shape, grids, b, tp, cp, gpu, recompute, vision_chunk_patches)
    gdn = _gdn(t, T, Tl, Tn, segs, b, tp, cp, padded_to is None, gpu)
    attention = _attention(t, T, Tl, Tn, b, tp, cp, padded_to is None, gpu)
    mlp = _mlp(t, Tl, Tn, b, tp, etp, gpu)
    h, vocab = t.hidden_size, t.vocab_size / tp
    norm = b * Tn * h + 4 * Tn if gpu else _norm(Tn, h)
    output = norm + b * Tn * h + 4 * Tl * vocab + 13 * Tl
    mtp_layer = 3 * norm + 2 * b * Tn * h + attention + mlp  # what its checkpoint reruns
    mtp_outer = 8 * Tl + b * Tn * h + 4 * Tl * vocab + 17 * Tl  # rolled ids, its output layer and loss
    embedding = 8 * T + (T if grids else 0) + (8 * Tl if cp > 1 else 0)
    plain = ActivationBreakdown(
        vision,
        embedding,
        gdn,
        attention,
        mlp,
        output,
        t.mtp_num_layers * (mtp_layer + mtp_outer),
        0.0,
        gdn_shared=0.0 if gpu else 2 * CHUNK**2 + (_chunk_layout(T, segs) if padded_to is None else 0.0),
        vision_recompute_working=vision_working,
    )
    if recompute is None:
        return plain
    return _under_recompute(plain, t, b, Tl, Tn, sp, gpu, mtp_layer, mtp_outer)

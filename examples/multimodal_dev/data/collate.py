"""Collate: contract samples -> one micro-batch (``batch.PackedBatch``), THD-packed (default) or
BSHD-padded.

THD (``pack_thd``): every sample is right-padded to a multiple of ``pad_multiple`` and laid end to
end in one row (pad: input 0, label IGNORE_INDEX, loss mask 0, padding mask True); MRoPE positions
restart at 0 for every sample; ``cu_seqlens`` holds the real-token boundaries and
``cu_seqlens_padded`` the padded ones (what the kernels index by). Images and videos are
concatenated in packing order. BSHD (``pad_bshd``): rows [B, S] padded on the right to the longest
sample (rounded up to ``pad_multiple``), no ``cu_seqlens*``. Right padding never influences real
tokens under causal attention and the causal Gated DeltaNet, so no attention mask is needed. Every
tensor's layout: the legend of batch.py.

Both fill ``stats`` (``batch.BatchStats``): samples, real tokens, padded tokens, the padding
fraction and the real per-sample lengths (for FLOPs accounting).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from examples.multimodal_dev.models import get_model_entry
from examples.multimodal_dev.models.common.batch_memo import mapped

from .batch import BatchStats, PackedBatch
from .sample import IGNORE_INDEX, VISION_KINDS, VisionTokens


def pad_multiple_for(cp: int = 1, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Per-sample length multiple: 2*cp so zigzag context parallelism splits every sample into
    2*cp equal chunks, times tp under sequence parallelism so every chunk splits across TP."""
    multiple = 2 * cp if cp > 1 else 1
    return multiple * tp if sequence_parallel else multiple


def _round_up(n: torch.Tensor, multiple: int) -> torch.Tensor:
    return (n + multiple - 1) // multiple * multiple


def _vision_inputs(samples, tokens_1T: torch.Tensor, tokens: VisionTokens):
    """(the micro-batch's pixel and grid fields by name: the samples' keys, which are PackedBatch's
    field names too; the grid of every vision run of the packed row in reading order: images and
    video frames interleaved as the conversations have them)."""
    fields = {}
    for _, pixel_field, grid_field in VISION_KINDS:
        grids = torch.cat([s[grid_field].reshape(-1, 3) for s in samples])
        fields[grid_field] = grids if grids.shape[0] else None
        fields[pixel_field] = torch.cat([s[pixel_field] for s in samples]) if grids.shape[0] else None
    none = torch.zeros(0, 3, dtype=torch.long)
    images = fields["image_grid_thw"] if fields["image_grid_thw"] is not None else none
    model = get_model_entry(tokens.arch)
    frames = model.split_video_frames(fields["video_grid_thw"]) if fields["video_grid_thw"] is not None else none
    runs, n_img, n_vid = model.run_grids(tokens_1T, images, frames, tokens.image, tokens.video, where="the micro-batch")
    # run_grids refuses too few grids; a grid left over would shift every later image's pixels
    # onto the wrong placeholders of a later micro-batch's model call, so refuse too many too
    for what, used, listed, field in (
        ("images", n_img, len(images), "image_grid_thw"),
        ("videos", n_vid, len(frames), "video frames in video_grid_thw"),
    ):
        if listed > used:
            raise ValueError(
                f"{what}: the micro-batch has {used} placeholder runs but {field} lists {listed}; "
                "the processor's token expansion and the grids disagree"
            )
    return fields, runs


def _stats(lengths: torch.Tensor, total: int) -> BatchStats:
    real = int(lengths.sum())
    return BatchStats(
        samples=int(lengths.numel()),
        real_tokens=real,
        padded_tokens=total,
        pad_fraction=1.0 - real / max(total, 1),
        lengths=lengths.tolist(),
    )


def _padding_mask(total: int, real_positions: torch.Tensor) -> torch.Tensor:
    mask = torch.ones(total, dtype=torch.bool)
    mask[real_positions] = False
    return mask.unsqueeze(0)


def pack_thd(samples: list[dict], tokens: VisionTokens, pad_multiple: int = 1) -> PackedBatch:
    lengths = torch.tensor([s["input_ids"].numel() for s in samples], dtype=torch.long)
    padded = _round_up(lengths, pad_multiple)
    cu_padded = torch.nn.functional.pad(torch.cumsum(padded, 0), (1, 0))
    total = int(cu_padded[-1])
    # Destination of every real token: its sample's padded start + its index inside the sample.
    real_starts = torch.repeat_interleave(cu_padded[:-1], lengths)
    local = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))[:-1], lengths
    )
    dest = real_starts + local

    def scatter(field, fill, dtype):
        out = torch.full((total,), fill, dtype=dtype)
        out[dest] = torch.cat([s[field] for s in samples]).to(dtype)
        return out.unsqueeze(0)

    tokens_1T = scatter("input_ids", 0, torch.long)
    vision, grids = _vision_inputs(samples, tokens_1T[0], tokens)
    position_ids_3T = get_model_entry(tokens.arch).packed_position_ids(
        tokens_1T[0], grids, tokens.vision_ids, tokens.spatial_merge, cu_padded
    )
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    # PackedSeqParams takes both: cu_seqlens counts real tokens only; sample b's real tokens
    # sit at cu_seqlens_padded[b] .. cu_seqlens_padded[b] + lengths[b] in the row.
    return PackedBatch(
        tokens=tokens_1T,
        labels=scatter("labels", IGNORE_INDEX, torch.long),
        loss_mask=scatter("loss_mask", 0.0, torch.float32),
        padding_mask=_padding_mask(total, dest),
        position_ids=position_ids_3T.unsqueeze(1),
        cu_seqlens=cu_seqlens.to(torch.int32),
        cu_seqlens_padded=cu_padded.to(torch.int32),
        max_seqlen=int(padded.max()),
        **vision,
        stats=_stats(lengths, total),
    )


def pad_bshd(
    samples: list[dict], tokens: VisionTokens, pad_multiple: int = 1, seq_length: int | None = None
) -> PackedBatch:
    lengths = torch.tensor([s["input_ids"].numel() for s in samples], dtype=torch.long)
    width = int(_round_up(lengths.max(), pad_multiple)) if seq_length is None else seq_length
    if int(lengths.max()) > width:
        raise ValueError(f"a sample has {int(lengths.max())} tokens, more than the padded length {width}")
    packed = pack_thd(samples, tokens, 1)  # positions computed once for all rows, then laid out
    rows = torch.arange(len(samples)).repeat_interleave(lengths)
    cols = torch.cat([torch.arange(int(n)) for n in lengths])

    def lay_out(flat, fill):
        out = torch.full((len(samples), width) + flat.shape[1:], fill, dtype=flat.dtype)
        out[rows, cols] = flat
        return out

    position_ids = lay_out(packed.position_ids[:, 0].transpose(0, 1), 0).permute(2, 0, 1).contiguous()
    return replace(  # the vision inputs as packed
        packed,
        tokens=lay_out(packed.tokens[0], 0),
        labels=lay_out(packed.labels[0], IGNORE_INDEX),
        loss_mask=lay_out(packed.loss_mask[0], 0.0),
        padding_mask=lay_out(packed.padding_mask[0], True),
        position_ids=position_ids,
        cu_seqlens=None,
        cu_seqlens_padded=None,
        max_seqlen=width,
        stats=_stats(lengths, len(samples) * width),
    )


def pad_row_to(batch: PackedBatch, length: int) -> PackedBatch:
    """The batch with every row right-padded to ``length`` tokens (input 0, label IGNORE_INDEX,
    loss mask 0, position 0, padding mask True). A THD row gains one extra segment with no real tokens, so every
    sample keeps its boundaries. Used to give ranks that must exchange equal-sized token buffers
    equal rows; the padding never reaches the loss."""
    width = batch.tokens.shape[1]
    extra = length - width
    if extra < 0:
        raise ValueError(f"cannot pad a row of {width} tokens to {length}")
    if extra == 0:
        return batch

    def pad(t, value):  # None: a tensor this pipeline stage does not read
        return None if t is None else mapped(t, lambda x: torch.nn.functional.pad(x, (0, extra), value=value))

    out = replace(
        batch,
        tokens=pad(batch.tokens, 0),
        labels=pad(batch.labels, IGNORE_INDEX),
        loss_mask=pad(batch.loss_mask, 0.0),
        position_ids=pad(batch.position_ids, 0),
        padding_mask=pad(batch.padding_mask, True),
    )
    if batch.thd:
        cu, cu_padded = batch.cu_seqlens, batch.cu_seqlens_padded
        out.cu_seqlens = mapped(cu, lambda x: torch.cat([x, x[-1:]]))
        out.cu_seqlens_padded = mapped(cu_padded, lambda x: torch.cat([x, x[-1:] + extra]))
        out.max_seqlen = max(batch.max_seqlen, extra)
    else:
        out.max_seqlen = length
    return out


class Collator:
    """The ``collate_fn`` a DataLoader gets: THD when ``packed`` (the default), else BSHD.
    ``row_length`` (token-budget packing): every THD row padded to exactly that many tokens
    (a row holding one conversation longer than that stays as long as it is)."""

    def __init__(
        self,
        tokens: VisionTokens,
        packed: bool = True,
        pad_multiple: int = 1,
        seq_length: int | None = None,
        row_length: int | None = None,
    ):
        self.tokens, self.packed, self.pad_multiple, self.seq_length = tokens, packed, pad_multiple, seq_length
        self.row_length = row_length

    def __call__(self, samples: list) -> PackedBatch:
        # a preference pair (DPO, preferences.py) is its two samples, chosen first, side by side in the row
        samples = [one for item in samples for one in (item if isinstance(item, tuple) else (item,))]
        if not self.packed:
            return pad_bshd(samples, self.tokens, self.pad_multiple, self.seq_length)
        batch = pack_thd(samples, self.tokens, self.pad_multiple)
        if self.row_length is None or batch.tokens.shape[1] >= self.row_length:
            return batch
        lengths = torch.tensor(batch.stats.lengths, dtype=torch.long)
        return replace(pad_row_to(batch, self.row_length), stats=_stats(lengths, self.row_length))

"""Qwen3.5 vision tower on megatron-core modules.

Legend: P = patches of all images/frames in the micro-batch (processor order: spatial-merge
blocks of m x m patches, row-major over blocks, repeated per temporal frame); N = P / m^2
merged tokens handed to the language model.

    pixel_values [P, C*tp*p*p] -> Conv3d patch embed [P, D]
      + learned position table (sqrt(n) x sqrt(n)), bilinearly resampled to each (h, w) grid
      -> ViT blocks, 2-D rotary (h, w), attention within each frame (one THD segment per frame)
      -> merger: LayerNorm -> view [N, D*m^2] -> fc1 -> exact GELU -> fc2 -> [N, out_hidden]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from ..common.batch_memo import to_device
from ..common.context_parallel import process_groups_without_context_parallel
from ..common.video_frames import frames_of
from .configuration import VisionShape
from .flops import vision_flops
from .specs import linear_classes, vision_block_spec


def frame_chunks(grid_thw: torch.Tensor, patches: int) -> list[torch.Tensor]:
    """The items of ``grid_thw`` as frames (a video's temporal patches are independent segments of the
    tower, each its own (1, h, w) grid, encoded alike), in order, grouped into runs of at most
    ``patches`` patches; a frame larger than that is a chunk of its own."""
    frames = frames_of(grid_thw)
    chunks, current, held = [], [], 0
    for frame, size in zip(frames, frames.prod(-1).tolist()):
        if current and held + size > patches:
            chunks.append(torch.stack(current))
            current, held = [], 0
        current.append(frame)
        held += size
    chunks.append(torch.stack(current))
    return chunks


def merge_block_coords(grid_thw: torch.Tensor, merge: int):
    """(row, col, frame height, frame width) of every patch, in processor (merge-block) order."""
    rows, cols, heights, widths = [], [], [], []
    for t, h, w in grid_thw.tolist():  # one iteration per image, not per patch
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        heights.append(torch.full((t * h * w,), h))
        widths.append(torch.full((t * h * w,), w))
    return torch.cat(rows), torch.cat(cols), torch.cat(heights), torch.cat(widths)


def bilinear_taps(coord: torch.Tensor, size: torch.Tensor, side: int):
    """align_corners=True resampling of a ``side``-long axis to ``size`` points: two taps each."""
    src = coord.float() * (side - 1) / (size - 1).clamp(min=1).float()
    lo = src.floor()
    frac = src - lo
    lo = lo.long().clamp(0, side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    return (lo, hi), (1.0 - frac, frac)


class PatchMerger(MegatronModule):
    def __init__(self, config, shape: VisionShape, backend: str, tp_group=None):
        super().__init__(config=config)
        if tp_group is not None:  # its own layout; otherwise megatron's TP group, as the linears'
            self.tp_group = tp_group
        column, row, _ = linear_classes(backend)
        self.merged_dim = shape.hidden_size * shape.spatial_merge_size**2
        self.patch_norm = nn.LayerNorm(shape.hidden_size, eps=1e-6, dtype=config.params_dtype)
        self.linear_fc1 = column(
            self.merged_dim,
            self.merged_dim,
            config=config,
            init_method=config.init_method,
            bias=True,
            gather_output=False,
            skip_bias_add=False,
            is_expert=False,  # a required keyword of megatron-core's TE wrappers (the local linears default it)
            tp_group=tp_group,
        )
        self.linear_fc2 = row(
            self.merged_dim,
            shape.out_hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=False,
            tp_group=tp_group,
        )

    def forward(self, x_PD: torch.Tensor) -> torch.Tensor:
        x = self.patch_norm(x_PD).view(-1, self.merged_dim)
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(F.gelu(x))  # exact (erf) GELU, unlike the tanh GELU of the blocks
        return x


class Qwen35VisionModel(MegatronModule):
    def __init__(self, config, shape: VisionShape, backend: str = "local", bridge=None):
        """``bridge``: a ``common.vision_bridge.VisionBridge`` when the tower runs on its own
        tensor-parallel size; None: the language model's TP groups."""
        super().__init__(config=config)
        self.shape = shape
        self.bridge = bridge
        groups = bridge.process_groups() if bridge is not None else process_groups_without_context_parallel()
        if bridge is not None:
            self.tp_group = groups.tp  # the checkpoint's TP coordinate of the plain parameters
        kernel = (shape.temporal_patch_size, shape.patch_size, shape.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            shape.in_channels,
            shape.hidden_size,
            kernel_size=kernel,
            stride=kernel,
            bias=True,
            dtype=config.params_dtype,
        )
        self.pos_embed = nn.Embedding(shape.num_position_embeddings, shape.hidden_size, dtype=config.params_dtype)
        self.grid_side = int(shape.num_position_embeddings**0.5)
        head_dim = shape.hidden_size // shape.num_heads
        # made on the host even in a meta-device build (whose weights are put in one module at a time,
        # checkpoint/weightless_model.py): a buffer is no weight, nothing would fill it; .cuda() moves it
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device="cpu") / (head_dim // 2)
        self.register_buffer("rope_inv_freq", 1.0 / (shape.rope_theta**quarter), persistent=False)
        # Every CP rank runs the whole tower on all images (the split comes after the merge), so
        # its attention and rotary must not see the language model's CP group.
        self.decoder = TransformerBlock(
            config=config,
            spec=vision_block_spec(config, backend),
            pre_process=True,
            post_process=False,
            post_layer_norm=False,
            pg_collection=groups,
        )
        self.merger = PatchMerger(config, shape, backend, tp_group=groups.tp if bridge is not None else None)
        if bridge is not None:
            bridge.adopt(self)

    def item_flops(self, grid_thw) -> float:
        """Forward FLOPs of encoding one image or video of this (t, h, w) grid: what context
        parallelism deals the tower's work by (``common/vision_context_parallel.py``)."""
        return vision_flops(self.shape, self.shape.out_hidden_size, [tuple(grid_thw)])

    def position_embeddings(self, rows, cols, heights, widths) -> torch.Tensor:
        (h0, h1), (wh0, wh1) = bilinear_taps(rows, heights, self.grid_side)
        (c0, c1), (wc0, wc1) = bilinear_taps(cols, widths, self.grid_side)
        table, side = self.pos_embed.weight, self.grid_side
        out = 0
        for hi, wh in ((h0, wh0), (h1, wh1)):
            for ci, wc in ((c0, wc0), (c1, wc1)):
                # an embedding lookup, not table[index]: the indexing's backward accumulates in a thread
                # order that varies (CPU threads, CUDA atomics), so a resumed run's gradient differed in
                # the last bits from the straight run's; the embedding's backward sums in a fixed order
                out = out + F.embedding(hi * side + ci, table) * (wh * wc).to(table.dtype)[:, None]
        return out

    def rotary_angles(self, rows, cols) -> torch.Tensor:
        """[P, 1, 1, head_dim]: h angles then w angles, duplicated for rotate-half."""
        inv = self.rope_inv_freq.to(rows.device)
        angles = torch.cat([rows.float()[:, None] * inv, cols.float()[:, None] * inv], dim=-1)
        return torch.cat([angles, angles], dim=-1)[:, None, None, :]

    # --vision-chunk-patches: the tower runs over chunks of whole frames of at most this many patches,
    # each recomputed in backward, so the activations it holds at once are one chunk's (0: one pass)
    chunk_patches = 0

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[0] != int(grid_thw.prod(-1).sum()):
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw "
                f"{grid_thw.tolist()} describes {int(grid_thw.prod(-1).sum())}"
            )
        if not self.chunk_patches or pixel_values.shape[0] <= self.chunk_patches:
            return self._encode(pixel_values, grid_thw)
        from megatron.core import tensor_parallel

        # megatron's recompute (its RNG states kept) hands back a gradient only where an input needs
        # one, and the pixels do not: the output is tied to this anchor, whose gradient is dropped
        anchor = torch.zeros((), device=pixel_values.device, requires_grad=torch.is_grad_enabled())
        outs, start = [], 0
        for grids in frame_chunks(grid_thw, self.chunk_patches):
            rows = int(grids.prod(-1).sum())
            pixels = pixel_values[start : start + rows]
            start += rows
            if torch.is_grad_enabled():  # only the chunk's input is kept; backward runs it again
                outs.append(tensor_parallel.checkpoint(self._anchored_encode, False, anchor, pixels, grids))
            else:
                outs.append(self._encode(pixels, grids))
        return torch.cat(outs)

    def _anchored_encode(self, anchor, pixel_values, grid_thw):
        return self._encode(pixel_values, grid_thw) + anchor.to(self.patch_embed.proj.weight.dtype)

    def _encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        s = self.shape
        dtype = self.patch_embed.proj.weight.dtype
        patches = pixel_values.to(dtype).view(-1, s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
        x = self.patch_embed.proj(patches).view(-1, s.hidden_size)
        rows, cols, heights, widths = (t.to(x.device) for t in merge_block_coords(grid_thw.cpu(), s.spatial_merge_size))
        x = x + self.position_embeddings(rows, cols, heights, widths)
        frame_lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu = to_device(F.pad(frame_lengths.cumsum(0), (1, 0)), x.device, torch.int32)  # bounds kept on the host
        max_len = int(frame_lengths.max())
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len
        )
        hidden = self.decoder(
            hidden_states=x.unsqueeze(1),
            attention_mask=None,
            rotary_pos_emb=self.rotary_angles(rows, cols),
            packed_seq_params=packed,
        )
        return self.merger(hidden.squeeze(1))

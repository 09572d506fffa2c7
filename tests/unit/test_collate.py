"""THD packing and BSHD padding: boundaries, pad values, MRoPE restarts (vs transformers), the
per-token loss of a packed batch equal to that of the padded batch (1e-5 abs), and what a
pipeline stage keeps of a batch."""

import pytest
import torch
from hf_reference import hf_rope_index

from examples.multimodal_dev.data.batch import StageInput
from examples.multimodal_dev.data.collate import Collator, pack_thd, pad_bshd, pad_multiple_for
from examples.multimodal_dev.data.mock import MockConversations
from examples.multimodal_dev.data.mock_video import VideoProfile
from examples.multimodal_dev.data.sample import IGNORE_INDEX, VisionTokens, validate_sample
from examples.multimodal_dev.forward_step import batch_loss
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.mrope import padded_batch_position_ids

SHAPE = get_variant("tiny", moe=False, mtp=False)
TOKENS = VisionTokens.from_shape(SHAPE)
PATCH_DIM = SHAPE.vision.patch_dim


def _samples(n, seed=3, videos=False):
    mock = MockConversations(
        TOKENS,
        SHAPE.text.vocab_size,
        PATCH_DIM,
        seed=seed,
        mean_text_tokens=40,
        profile=VideoProfile(40) if videos else None,
    )
    return [mock(i) for i in range(n)]


def test_videos_pack_with_their_frames_positions_and_pixels():
    """Images and videos interleave in packing order; every frame is a vision run whose MRoPE
    positions equal the per-sample reference (itself equal to transformers' get_rope_index with
    videos: test_mrope.py), in THD and BSHD alike."""
    samples = _samples(8, seed=5, videos=True)
    with_video = [s for s in samples if s["video_grid_thw"].shape[0]]
    assert with_video and any(s["image_grid_thw"].shape[0] for s in with_video), "want images and videos together"
    assert any(int(s["video_grid_thw"][:, 0].max()) > 1 for s in with_video), "want a multi-frame video"
    for s in samples:
        validate_sample(s, TOKENS, PATCH_DIM)
    packed, padded = pack_thd(samples, TOKENS, 4), pad_bshd(samples, TOKENS)
    for field in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        expected = torch.cat([s[field] for s in samples])
        assert torch.equal(getattr(packed, field), expected), field
        assert torch.equal(getattr(padded, field), expected), field
    for b, (start, s) in enumerate(zip(packed.cu_seqlens_padded[:-1].tolist(), samples)):
        n = s["input_ids"].numel()
        reference = padded_batch_position_ids(
            s["input_ids"][None],
            None,
            s["image_grid_thw"],
            s["video_grid_thw"],
            TOKENS.image,
            TOKENS.video,
            TOKENS.spatial_merge,
        )[:, 0]
        assert torch.equal(packed.position_ids[:, 0, start : start + n], reference), b
        assert torch.equal(padded.position_ids[:, b, :n], reference), b
    # a micro-batch's FLOPs count the videos' frames in the vision tower
    from examples.multimodal_dev.models.qwen35_vl.flops import vision_flops
    from examples.multimodal_dev.training.throughput import batch_flops

    frames = [tuple(g) for g in packed.video_grid_thw.tolist()]
    images = [tuple(g) for g in packed.image_grid_thw.tolist()]
    assert batch_flops(SHAPE, packed).vision == pytest.approx(
        vision_flops(SHAPE.vision, SHAPE.text.hidden_size, images + frames)
    )
    assert vision_flops(SHAPE.vision, SHAPE.text.hidden_size, frames) > 0


@pytest.mark.parametrize(
    "first,kept",
    [
        (StageInput.PIXELS, {"pixel_values", "image_grid_thw"}),
        (StageInput.GRIDS, {"image_grid_thw"}),
        (StageInput.HIDDEN, set()),
    ],
)
@pytest.mark.parametrize("post_process", [True, False])
def test_a_stage_keeps_what_it_reads(first, kept, post_process):
    """Vision inputs as the stage's first layer needs them, labels and loss mask on the last
    stage; positions, boundaries, the padding mask and the token ids everywhere; stats shared."""
    batch = pack_thd(_samples(4), TOKENS, 4)
    assert batch.pixel_values is not None and batch.image_grid_thw is not None
    view = batch.for_stage(first, post_process)
    vision = {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    assert {k for k in vision if getattr(view, k) is not None} == kept
    assert (view.labels is not None, view.loss_mask is not None) == (post_process, post_process)
    assert set(view.tensors()) - vision - {"labels", "loss_mask"} == {
        "tokens",
        "position_ids",
        "cu_seqlens",
        "cu_seqlens_padded",
        "padding_mask",
    }
    assert view.max_seqlen == batch.max_seqlen and view.stats is batch.stats
    assert StageInput.of(True) is StageInput.PIXELS and StageInput.of(False) is StageInput.HIDDEN


@pytest.mark.parametrize(
    "cp,tp,sp,expected",
    [(1, 1, False, 1), (2, 1, False, 4), (4, 1, False, 8), (1, 2, True, 2), (2, 2, True, 8), (2, 2, False, 4)],
)
def test_pad_multiple(cp, tp, sp, expected):
    assert pad_multiple_for(cp, tp, sp) == expected


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_cu_seqlens_and_pad_values(multiple):
    samples = _samples(5)
    lengths = [s["input_ids"].numel() for s in samples]
    batch = pack_thd(samples, TOKENS, multiple)
    padded = [(n + multiple - 1) // multiple * multiple for n in lengths]
    assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(6)]
    assert batch.cu_seqlens_padded.tolist() == [sum(padded[:i]) for i in range(6)]
    assert batch.max_seqlen == max(padded)
    assert batch.tokens.shape == (1, sum(padded)) and batch.position_ids.shape == (3, 1, sum(padded))
    real = torch.zeros(sum(padded), dtype=torch.bool)
    for start, n, s in zip(batch.cu_seqlens_padded[:-1].tolist(), lengths, samples):
        real[start : start + n] = True
        assert torch.equal(batch.tokens[0, start : start + n], s["input_ids"])
        assert torch.equal(batch.labels[0, start : start + n], s["labels"])
    pad = ~real
    assert bool((batch.tokens[0, pad] == 0).all()) and bool((batch.labels[0, pad] == IGNORE_INDEX).all())
    assert bool((batch.loss_mask[0, pad] == 0).all())
    assert batch.stats.real_tokens == sum(lengths) and batch.stats.padded_tokens == sum(padded)
    # Images concatenated in packing order.
    assert torch.equal(batch.image_grid_thw, torch.cat([s["image_grid_thw"] for s in samples]))
    assert torch.equal(batch.pixel_values, torch.cat([s["pixel_values"] for s in samples]))


@pytest.mark.parametrize("kind", ["image", "video"])
@pytest.mark.parametrize("change", ["fewer", "more"])
def test_grids_that_do_not_match_the_placeholder_runs_are_refused(kind, change):
    """One grid too few or too many for the micro-batch's placeholder runs is one line naming the
    field, never a silent shift of pixels onto other placeholders."""
    samples = _samples(4, videos=True)
    field = "image_grid_thw" if kind == "image" else "video_grid_thw"
    i = next(j for j, s in enumerate(samples) if s[field].shape[0])
    grids = samples[i][field]
    extra = grids[:1].clone()
    if kind == "video":
        extra[:, 0] = 1  # one more frame
    samples[i] = dict(
        samples[i],
        **{
            field: grids[1:]
            if change == "fewer" and kind == "image"
            else torch.cat([grids[:, :1] - 1, grids[:, 1:]], 1)
            if change == "fewer"
            else torch.cat([grids, extra])
        },
    )
    named = "image_grid_thw" if kind == "image" else "video frames in video_grid_thw"
    with pytest.raises(ValueError, match=f"{kind}s: the micro-batch ha.* placeholder runs but {named} lists"):
        pack_thd(samples, TOKENS, 1)


def test_packed_positions_equal_padded_and_hf():
    samples = _samples(6)
    assert any(s["image_grid_thw"].shape[0] == 2 for s in samples), "want samples with two images"
    packed = pack_thd(samples, TOKENS, 4)
    padded = pad_bshd(samples, TOKENS)
    lengths = [s["input_ids"].numel() for s in samples]
    mask = torch.zeros_like(padded.tokens)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    reference = hf_rope_index(SHAPE, padded.tokens, mask, padded.image_grid_thw)
    for b, (start, n) in enumerate(zip(packed.cu_seqlens_padded[:-1].tolist(), lengths)):
        ours = packed.position_ids[:, 0, start : start + n]
        assert int(ours[:, 0].abs().max()) == 0, f"sample {b} does not restart at 0"
        assert torch.equal(ours, padded.position_ids[:, b, :n])
        assert torch.equal(ours, reference[:, b, :n]), f"sample {b} differs from transformers' get_rope_index"


@pytest.mark.parametrize("videos", [False, True], ids=["images", "images and videos"])
def test_packed_loss_equals_padded_loss(mcore, videos):
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    torch.manual_seed(0)
    model = build_model(SHAPE).eval()
    samples = _samples(4, seed=11 if not videos else 6, videos=videos)
    assert not videos or any(s["video_grid_thw"].shape[0] for s in samples)
    results = {}
    with torch.no_grad():
        for name, collate in (
            ("thd", Collator(TOKENS, packed=True, pad_multiple=4)),
            ("bshd", Collator(TOKENS, packed=False)),
        ):
            batch = collate(samples)
            loss_sum, n_tokens, _ = batch_loss(model, batch)
            results[name] = (loss_sum / n_tokens).item()
            assert int(n_tokens) == int(sum(s["loss_mask"].sum() for s in samples))
    print(f"per-token loss: packed {results['thd']:.7f} padded {results['bshd']:.7f}")
    assert abs(results["thd"] - results["bshd"]) < 1e-5


def test_a_jsonl_video_sample_packs_and_pads(mcore, tmp_path):
    """The JSONL provider's video samples (frames inside the chat template's vision_start /
    vision_end pair, as transformers 5.x writes them) through the Collator: in THD and BSHD every
    sample's positions equal transformers' get_rope_index, the frames' pixels and grids follow in
    order, and the packed per-token loss equals the padded one (1e-5 abs)."""
    from dataclasses import replace

    from test_jsonl import hf_rope_positions, video_conversation
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    processor_path = build_processor(str(tmp_path / "processor"), chat_template=QWEN35_CHAT_TEMPLATE)
    train, _, _, info = video_conversation(processor_path, tmp_path / "data")
    t = info.tokens
    samples = [train[0], train[1]]  # a video and an image; a video alone (4 frames)
    for s in samples:
        n_frames = int(s["video_grid_thw"][:, 0].sum())
        assert int((s["input_ids"] == t.vision_start).sum()) == s["image_grid_thw"].shape[0] + n_frames + 1
    shape = replace(
        SHAPE,
        image_token_id=t.image,
        video_token_id=t.video,
        vision_start_token_id=t.vision_start,
        vision_end_token_id=t.vision_end,
    )
    torch.manual_seed(0)
    model = build_model(shape).eval()
    losses = {}
    with torch.no_grad():
        for name, collate in (("thd", Collator(t, packed=True, pad_multiple=4)), ("bshd", Collator(t, packed=False))):
            batch = collate(samples)
            for field in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                assert torch.equal(getattr(batch, field), torch.cat([s[field] for s in samples])), (name, field)
            starts = batch.cu_seqlens_padded[:-1].tolist() if name == "thd" else [0] * len(samples)
            for b, (start, s) in enumerate(zip(starts, samples)):
                n = s["input_ids"].numel()
                got = batch.position_ids[:, 0, start : start + n] if name == "thd" else batch.position_ids[:, b, :n]
                expected = hf_rope_positions(s["input_ids"], s["image_grid_thw"], s["video_grid_thw"], t)
                assert torch.equal(got, expected), (name, b)
            loss_sum, n_tokens, _ = batch_loss(model, batch)
            losses[name] = (loss_sum / n_tokens).item()
            assert int(n_tokens) == int(sum(s["loss_mask"].sum() for s in samples))
    print(f"per-token loss: packed {losses['thd']:.7f} padded {losses['bshd']:.7f}")
    assert abs(losses["thd"] - losses["bshd"]) < 1e-5 and torch.isfinite(torch.tensor(losses["thd"]))


def test_bench_collate_runs(capsys):
    import importlib

    bench = importlib.import_module("examples.multimodal_dev.benchmarks.bench_collate")
    figures = bench.main(["--samples", "16", "--micro-batch", "4", "--repeats", "1"])  # raises on a mismatch
    out = capsys.readouterr().out
    assert figures["samples"] == 16 and figures["ours_per_s"] > 0 and figures["hf_per_s"] > 0
    assert "ratio (ours / transformers)" in out


def test_moving_a_batch_leaves_the_grids_on_the_host():
    """The vision tower reads the grids on the host (every read of a device copy stopped a GPU run):
    ``to`` moves every other tensor, and the segment bounds and tokens carry their host copy. What the
    moved batch keeps stays off the collated batch's tensors, which megatron's rerun state machine
    pickles into checkpoints."""
    from examples.multimodal_dev.models.common.batch_memo import HOST_SIDE_MARK, on_host

    batch = pack_thd(_samples(4, videos=True), TOKENS)
    moved = batch.to("meta")
    assert moved.tokens.device.type == "meta" and moved.pixel_values.device.type == "meta"
    assert moved.image_grid_thw.device.type == "cpu" and torch.equal(moved.image_grid_thw, batch.image_grid_thw)
    assert moved.video_grid_thw is None or moved.video_grid_thw.device.type == "cpu"
    assert on_host(moved.cu_seqlens_padded).device.type == "cpu"
    assert torch.equal(on_host(moved.cu_seqlens_padded), batch.cu_seqlens_padded)
    assert all(not t.__dict__ for t in batch.tensors().values()), HOST_SIDE_MARK
    on_cpu = batch.to("cpu")
    assert on_cpu.cu_seqlens is not batch.cu_seqlens and not batch.cu_seqlens.__dict__

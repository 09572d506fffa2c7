"""THD packing and BSHD padding: boundaries, pad values, MRoPE restarts (vs transformers), and
the per-token loss of a packed batch equal to that of the padded batch (1e-5 abs)."""

import pytest
import torch
from hf_reference import hf_rope_index

from examples.multimodal_dev.data.collate import Collator, pack_thd, pad_bshd, pad_multiple_for
from examples.multimodal_dev.data.mock import MockConversations
from examples.multimodal_dev.data.sample import IGNORE_INDEX, VisionTokens
from examples.multimodal_dev.forward_step import batch_loss
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

SHAPE = get_variant("tiny", moe=False, mtp=False)
TOKENS = VisionTokens.from_shape(SHAPE)
PATCH_DIM = SHAPE.vision.patch_dim


def _samples(n, seed=3):
    mock = MockConversations(TOKENS, SHAPE.text.vocab_size, PATCH_DIM, seed=seed, mean_text_tokens=40)
    return [mock(i) for i in range(n)]


@pytest.mark.parametrize("cp,tp,sp,expected", [(1, 1, False, 1), (2, 1, False, 4), (4, 1, False, 8),
                                               (1, 2, True, 2), (2, 2, True, 8), (2, 2, False, 4)])
def test_pad_multiple(cp, tp, sp, expected):
    assert pad_multiple_for(cp, tp, sp) == expected


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_cu_seqlens_and_pad_values(multiple):
    samples = _samples(5)
    lengths = [s["input_ids"].numel() for s in samples]
    batch = pack_thd(samples, TOKENS, multiple)
    padded = [(n + multiple - 1) // multiple * multiple for n in lengths]
    assert batch["cu_seqlens"].dtype == batch["cu_seqlens_padded"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [sum(lengths[:i]) for i in range(6)]
    assert batch["cu_seqlens_padded"].tolist() == [sum(padded[:i]) for i in range(6)]
    assert batch["max_seqlen"] == max(padded)
    assert batch["tokens"].shape == (1, sum(padded)) and batch["position_ids"].shape == (3, 1, sum(padded))
    real = torch.zeros(sum(padded), dtype=torch.bool)
    for start, n, s in zip(batch["cu_seqlens_padded"][:-1].tolist(), lengths, samples):
        real[start:start + n] = True
        assert torch.equal(batch["tokens"][0, start:start + n], s["input_ids"])
        assert torch.equal(batch["labels"][0, start:start + n], s["labels"])
    pad = ~real
    assert bool((batch["tokens"][0, pad] == 0).all()) and bool((batch["labels"][0, pad] == IGNORE_INDEX).all())
    assert bool((batch["loss_mask"][0, pad] == 0).all())
    assert batch["stats"]["real_tokens"] == sum(lengths) and batch["stats"]["padded_tokens"] == sum(padded)
    # Images concatenated in packing order.
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples]))
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in samples]))


def test_packed_positions_equal_padded_and_hf():
    samples = _samples(6)
    assert any(s["image_grid_thw"].shape[0] == 2 for s in samples), "want samples with two images"
    packed = pack_thd(samples, TOKENS, 4)
    padded = pad_bshd(samples, TOKENS)
    lengths = [s["input_ids"].numel() for s in samples]
    mask = torch.zeros_like(padded["tokens"])
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    reference = hf_rope_index(SHAPE, padded["tokens"], mask, padded["image_grid_thw"])
    for b, (start, n) in enumerate(zip(packed["cu_seqlens_padded"][:-1].tolist(), lengths)):
        ours = packed["position_ids"][:, 0, start:start + n]
        assert int(ours[:, 0].abs().max()) == 0, f"sample {b} does not restart at 0"
        assert torch.equal(ours, padded["position_ids"][:, b, :n])
        assert torch.equal(ours, reference[:, b, :n]), f"sample {b} differs from transformers' get_rope_index"


def test_packed_loss_equals_padded_loss(mcore):
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    torch.manual_seed(0)
    model = build_model(SHAPE).eval()
    samples = _samples(4, seed=11)
    results = {}
    with torch.no_grad():
        for name, collate in (("thd", Collator(TOKENS, packed=True, pad_multiple=4)),
                              ("bshd", Collator(TOKENS, packed=False))):
            batch = collate(samples)
            loss_sum, n_tokens, _ = batch_loss(model, batch)
            results[name] = (loss_sum / n_tokens).item()
            assert int(n_tokens) == int(sum(s["loss_mask"].sum() for s in samples))
    print(f"per-token loss: packed {results['thd']:.7f} padded {results['bshd']:.7f}")
    assert abs(results["thd"] - results["bshd"]) < 1e-5


def test_bench_collate_runs(capsys):
    import importlib

    bench = importlib.import_module("examples.multimodal_dev.tools.bench_collate")
    figures = bench.main(["--samples", "16", "--micro-batch", "4", "--repeats", "1"])  # raises on a mismatch
    out = capsys.readouterr().out
    assert figures["samples"] == 16 and figures["ours_per_s"] > 0 and figures["hf_per_s"] > 0
    assert "ratio (ours / transformers)" in out

"""The chunked vision tower (``--vision-chunk-patches``, ``vision_encoder.py``): chunks of whole frames
give the unchunked tower's features and gradients (fp32), and what backward holds at once is one
chunk's activations, measured with ``torch.autograd.graph.saved_tensors_hooks``."""

import pytest
import torch
from hf_reference import pixel_values_for

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.models.qwen35_vl.vision_encoder import frame_chunks

# two images and a three-frame video: 16 + 32 + 3 x 16 patches
GRIDS = torch.tensor([(1, 4, 4), (1, 4, 8), (3, 4, 4)])
CHUNK = 40  # patches: chunks of 16, 32, 32 (two of the video's frames) and 16


@pytest.fixture(scope="module")
def tower(mcore):
    torch.manual_seed(0)
    return build_model(get_variant("tiny")).vision_model.train()


def _pixels():
    return pixel_values_for(get_variant("tiny"), GRIDS.tolist(), torch.Generator().manual_seed(1))


def _features_and_grads(tower, pixels, chunk: int):
    tower.chunk_patches = chunk
    tower.zero_grad(set_to_none=True)
    features = tower(pixels, GRIDS)
    weights = torch.linspace(-1, 1, features.numel()).view_as(features)
    (features * weights).sum().backward()
    tower.chunk_patches = 0
    return features.detach(), {n: p.grad.clone() for n, p in tower.named_parameters()}


def test_chunks_are_whole_frames_of_at_most_n_patches():
    chunks = frame_chunks(GRIDS, CHUNK)
    assert [c.tolist() for c in chunks] == [[[1, 4, 4]], [[1, 4, 8]], [[1, 4, 4], [1, 4, 4]], [[1, 4, 4]]]
    assert [c.tolist() for c in frame_chunks(GRIDS, 8)][1] == [[1, 4, 8]]  # a larger frame: a chunk alone


def test_chunked_equals_one_pass(tower):
    pixels = _pixels()
    whole, whole_grads = _features_and_grads(tower, pixels, 0)
    chunked, chunked_grads = _features_and_grads(tower, pixels, CHUNK)
    diff = (chunked - whole).abs().max().item()
    # chunks add the weights' gradients in another order: within 1e-6 of the largest gradient entry
    grad_diff = max((chunked_grads[n] - g).abs().max().item() for n, g in whole_grads.items())
    scale = max(g.abs().max().item() for g in whole_grads.values())
    print(f"features max abs diff {diff:.1e}, gradients {grad_diff:.1e} (largest gradient entry {scale:.2f})")
    assert diff <= 1e-6 and grad_diff <= 1e-6 * max(scale, 1.0)


class _Saved:
    """Bytes autograd saves, per storage, since the last ``reset``; the parameters and the micro-batch's
    pixels (held whatever the tower does; a chunk's pixels are a view of them) left out."""

    def __init__(self, held):
        self.params = {t.untyped_storage().data_ptr() for t in held}
        self.reset()

    def reset(self):
        self.storages, self.peak = {}, getattr(self, "peak", 0)

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
            self.peak = max(self.peak, sum(self.storages.values()))
        return t


def test_backward_holds_one_chunk_at_a_time(tower, monkeypatch):
    """One pass saves activations for every patch; chunked, the forward keeps only each chunk's input,
    and each chunk recomputed in backward saves about its share: at most 1.25 x the one pass's bytes a
    patch times the chunk's patches."""
    pixels = _pixels()
    total = int(GRIDS.prod(-1).sum())
    saved = _Saved([*tower.parameters(), pixels])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        tower(pixels, GRIDS).sum().backward()
    one_pass = sum(saved.storages.values())

    tower.chunk_patches = CHUNK
    per_chunk, encode = [], tower._encode

    def counted(pixels_chunk, grids):  # the forward (under no_grad: nothing saved) and its recompute
        saved.reset()
        out = encode(pixels_chunk, grids)
        per_chunk.append((int(grids.prod(-1).sum()), sum(saved.storages.values())))
        return out

    monkeypatch.setattr(tower, "_encode", counted)
    saved.reset()
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            tower(pixels, GRIDS).sum().backward()
    finally:
        tower.chunk_patches = 0
    recomputed = [(n, b) for n, b in per_chunk if b]  # the backward's recomputes (the forward saved nothing)
    print(f"one pass: {one_pass} bytes for {total} patches; chunks (patches, bytes): {recomputed}")
    assert len(recomputed) == len(frame_chunks(GRIDS, CHUNK))
    for patches, held in recomputed:
        assert held <= 1.25 * one_pass / total * patches, (patches, held)


def test_the_planner_counts_what_one_chunk_saves(tower, monkeypatch):
    """``activation_memory``'s chunked tower: what the largest chunk's recompute saves (pixels left
    out) is predicted within 10% of what it saves here, and the forward keeps only the pixels."""
    from examples.multimodal_dev.planner.activation_memory import chunk_patches, micro_batch_activations

    pixels = _pixels()
    saved = _Saved([*tower.parameters(), pixels])
    tower.chunk_patches = CHUNK
    per_chunk, encode = [], tower._encode

    def counted(pixels_chunk, grids):
        saved.reset()
        out = encode(pixels_chunk, grids)
        per_chunk.append(sum(saved.storages.values()))
        return out

    monkeypatch.setattr(tower, "_encode", counted)
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            tower(pixels, GRIDS).sum().backward()
    finally:
        tower.chunk_patches = 0
    shape = get_variant("tiny")
    frames = [tuple(g) for g in GRIDS.tolist()]
    assert chunk_patches(frames, CHUNK) == [16, 32, 32, 16]
    act = micro_batch_activations(shape, [200], frames, dtype_bytes=4, vision_chunk_patches=CHUNK)
    measured = max(per_chunk)
    print(f"largest chunk's recompute: measured {measured} bytes, predicted {act.vision_recompute_working:.0f}")
    assert abs(act.vision_recompute_working - measured) <= 0.1 * measured
    assert act.vision == 4 * int(GRIDS.prod(-1).sum()) * shape.vision.patch_dim  # the pixels alone
    whole = micro_batch_activations(shape, [200], frames, dtype_bytes=4)
    assert whole.vision_recompute_working == 0 and whole.vision > act.vision + act.vision_recompute_working

"""``planner/activation_memory.py`` against what a CPU run saves for backward, part by part.

Measured: every tensor autograd saves during the forward of one micro-batch through the training
path (``forward_step.batch_loss``: collate -> PackedSeqParams -> model -> per-token loss), caught by
``torch.autograd.graph.saved_tensors_hooks`` and counted once per storage (the bytes actually held:
a saved view holds its whole storage). Parameters and views of them are left out (weights are
counted elsewhere); the batch's own tensors (token ids, pixel values) are counted where the model
saves them (the embedding's ids, the patch embedding's pixels), since backward holds them too.
A part is the module running when the tensor was saved (forward pre-hooks tag the parts); a
storage saved by two parts (MTP's and the main output layer's halves of one hidden row) is split
between them, one saved by several decoder layers (the recompute checkpoints' rotary table and
padding mask) is ``per_stage``. With recompute, every checkpointed function is then run again as
megatron's backward runs it (``Checkpointed``), and the bytes it saves that are not already held
are that layer's working set; ``test_replay_is_the_recompute`` checks this equals what the real
backward saves (the proxy's bf16 backward itself took 9 minutes on this host, which lacks
AVX512-BF16: torch's bf16 grad_output @ weight, megatron's input gradient, ran 65x slower than
the same product on a transposed copy).

Cases: tiny (dense), tiny with MoE and MTP, and proxy; fp32 and bf16 (bf16 built in bf16 and
wrapped in megatron's Float16Module, as megatron.training does); packed and padded; recompute off
and "full" (uniform, 1 layer; the vision tower gets megatron's recompute flags too, as
``config_from_args`` gives them). The proxy is built at its real widths (hidden 4096, 32 / 2
heads, 64 GDN value heads of 128, 8 experts of 1024, the full-width vision tower) but with one
Gated DeltaNet and one attention layer, a 1-block vision tower, an 8192-token vocabulary (token
ids moved below it) and no MTP head (an attention layer and an MoE like the ones measured here;
tiny_moe_mtp checks its structure): the formulas are per layer, per block and per vocabulary
entry. TP/SP/CP need several processes and are not measured here: tp = cp = 1.
"""

import dataclasses

import pytest
import torch
from hf_reference import image_tokens

from examples.multimodal_dev.data.collate import pack_thd, pad_bshd
from examples.multimodal_dev.data.sample import VisionTokens, build_conversation_sample
from examples.multimodal_dev.forward_step import batch_loss
from examples.multimodal_dev.models.qwen35_vl.configuration import (
    FULL,
    LINEAR,
    get_variant,
    language_transformer_config,
    vision_transformer_config,
)
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.planner.activation_memory import micro_batch_activations

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
TOLERANCE = 0.10


def proxy_shape():
    shape = get_variant("proxy")
    text = dataclasses.replace(shape.text, num_layers=2, layer_types=(LINEAR, FULL), vocab_size=8192, mtp_num_layers=0)
    return dataclasses.replace(
        shape,
        text=text,
        vision=dataclasses.replace(shape.vision, depth=1),
        image_token_id=8000,
        video_token_id=8001,
        vision_start_token_id=8002,
        vision_end_token_id=8003,
    )


# (shape, real sample lengths, image grids: the first sample holds the images)
SHAPES = {
    "tiny": (get_variant("tiny"), (150, 70, 45), [(1, 8, 12)]),
    "tiny_moe_mtp": (get_variant("tiny", moe=True, mtp=True), (100, 60), [(1, 8, 8), (1, 4, 8)]),
    "proxy": (proxy_shape(), (80, 30), [(1, 4, 8)]),
}


def micro_batch(shape, lengths, grids, padded_to=None):
    """Collated batch of samples of these lengths; the first holds the images' placeholder runs."""
    tokens = VisionTokens.from_shape(shape)
    samples = []
    for i, n in enumerate(lengths):
        ids, sample_grids = [], grids if i == 0 else []
        for _, h, w in sample_grids:
            ids += image_tokens(shape, h, w)
        ids = torch.tensor(ids + [16 + j % 500 for j in range(n - len(ids))])
        pixels = torch.randn(sum(t * h * w for t, h, w in sample_grids), shape.vision.patch_dim)
        samples.append(
            build_conversation_sample(
                ids,
                torch.ones_like(ids, dtype=torch.bool),
                pixels,
                torch.tensor(sample_grids, dtype=torch.long).reshape(-1, 3),
            )
        )
    return pad_bshd(samples, tokens, seq_length=padded_to) if padded_to else pack_thd(samples, tokens, 1)


def build(shape, dtype):
    """The model as megatron.training builds it: recompute flags shared by both towers (set per run:
    megatron reads ``recompute_granularity == 'full'`` only in forward), bf16 in Float16Module."""
    # Uniform draws: which tensors are saved does not depend on the weights' values, and normal draws
    # were most of the 0.8 B-parameter proxy's build time.
    init = dict(init_method=_uniform, output_layer_init_method=_uniform)
    language = language_transformer_config(shape.text, dtype, **init)
    vision = dataclasses.replace(vision_transformer_config(shape.vision, dtype), **init)
    model = build_model(shape, configs=(language, vision))
    if dtype == torch.bfloat16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(language, model), model
    return model, model


def _uniform(weight):
    return torch.nn.init.uniform_(weight, -0.03, 0.03)


def set_recompute(model, on: bool):
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        for field, value in RECOMPUTE.items():
            setattr(config, field, value if on else None)  # None: TransformerConfig's defaults


class SavedBytes:
    """Bytes saved for backward, by part (see the module docstring)."""

    def __init__(self, vlm):
        self.params = {p.untyped_storage().data_ptr() for p in vlm.parameters()}
        self.mtp_layers = vlm.language_model.config.mtp_num_layers or 0
        self.held, self.units, self.unit_seen = {}, {}, {}
        self.phase, self.tag, self.calls, self.handles = "forward", "embedding", 0, []
        lm, on = vlm.language_model, self._on
        on(vlm, pre=lambda: self._start())
        if vlm.vision_model is not None:
            on(vlm.vision_model, pre=lambda: self._set("vision"), post=lambda: self._set("embedding"))
        for i, layer in enumerate(lm.decoder.layers):
            # a checkpoint saves the layer's input after running it: that belongs to the layer too
            on(layer, pre=lambda i=i: self._set(("mixer", i)), post=lambda i=i: self._set(("mixer", i)))
            on(layer.pre_mlp_layernorm, pre=lambda i=i: self._set(("mlp", i)))
        on(lm.decoder.final_layernorm, pre=lambda: self._set("output"))
        if self.mtp_layers:
            on(lm.mtp, pre=lambda: self._set("mtp"))
        # megatron-core's _postprocess runs the output layer for each MTP head first, then the model's
        on(lm.output_layer, pre=lambda: self._count_output())

    def _on(self, module, pre=None, post=None):
        if pre:
            self.handles.append(module.register_forward_pre_hook(lambda *_: pre()))
        if post:
            self.handles.append(module.register_forward_hook(lambda *_: post()))

    def close(self):
        for handle in self.handles:
            handle.remove()

    def _start(self):
        self.tag, self.calls = "embedding", 0

    def _set(self, tag):
        if self.phase == "forward":
            self.tag = tag

    def _count_output(self):
        self.calls += 1
        self._set("mtp" if self.calls <= self.mtp_layers else "output")

    def unit(self, name):
        """Count what follows as one recomputed layer's saves."""
        self.phase, self.tag, self.unit_seen = "recompute", name, {}

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params:
            return t
        if self.phase == "forward":
            entry = self.held.setdefault(ptr, [t, storage.nbytes(), []])  # keep t: no address reuse
            if self.tag not in entry[2]:
                entry[2].append(self.tag)
        elif ptr not in self.held and ptr not in self.unit_seen:  # new bytes while recomputing
            self.unit_seen[ptr] = t
            self.units[self.tag] = self.units.get(self.tag, 0) + storage.nbytes()
        return t

    def parts(self) -> dict:
        out = {}
        for _, nbytes, tags in self.held.values():
            layers = {
                tag[1] if isinstance(tag, tuple) else tag for tag in tags if isinstance(tag, tuple) or tag == "mtp"
            }
            if len(layers) > 1:
                out["per_stage"] = out.get("per_stage", 0) + nbytes
                continue
            for tag in tags:
                out[tag] = out.get(tag, 0) + nbytes / len(tags)
        return out


class Checkpointed:
    """The calls megatron's CheckpointFunction makes under no_grad in forward (decoder and vision
    layers, each MTP layer's ``_proj_and_transformer_layer``), kept to be run again as its backward
    does: the same function on detached inputs under grad. That is the recompute without computing
    gradients, whose bf16 matmuls take minutes on a CPU (``test_replay_is_the_recompute`` checks the
    two save the same bytes)."""

    def __init__(self, vlm):
        self.calls, self.handles, self.wrapped = [], [], []
        lm = vlm.language_model
        blocks = [("layer", i, layer) for i, layer in enumerate(lm.decoder.layers)]
        if vlm.vision_model is not None:
            blocks += [("vision", i, layer) for i, layer in enumerate(vlm.vision_model.decoder.layers)]
        for kind, i, layer in blocks:
            self.handles.append(
                layer.register_forward_pre_hook(
                    lambda mod, args, kwargs, u=(kind, i): self._keep(u, mod, args, kwargs), with_kwargs=True
                )
            )
        for i, layer in enumerate(lm.mtp.layers if lm.mtp_process else []):
            run = layer._proj_and_transformer_layer
            layer._proj_and_transformer_layer = lambda *a, _run=run, _u=("mtp", i), **k: (
                self._keep(_u, _run, a, k) or _run(*a, **k)
            )
            self.wrapped.append(layer)

    def _keep(self, unit, fn, args, kwargs):
        if not torch.is_grad_enabled():
            self.calls.append((unit, fn, args, kwargs))

    def close(self):
        for handle in self.handles:
            handle.remove()
        for layer in self.wrapped:
            del layer._proj_and_transformer_layer

    def replay(self, counter, vlm):
        def detach(x):
            return x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x

        set_recompute(vlm, False)  # the function itself runs plain, as inside the checkpoint
        for unit, fn, args, kwargs in self.calls:
            counter.unit(unit)
            with torch.enable_grad():
                fn(*map(detach, args), **{k: detach(v) for k, v in kwargs.items()})


def measure(model, vlm, batch, recompute: bool, backward: bool = False):
    """(bytes by part, bytes saved by each recomputed layer): the recomputed layers' saves come from
    running them again (``Checkpointed``) or, with ``backward``, from megatron's real backward."""
    counter, kept = SavedBytes(vlm), Checkpointed(vlm) if recompute and not backward else None
    set_recompute(vlm, recompute)
    try:
        with (
            torch._dynamo.config.patch(disable=True),
            torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t),
        ):
            loss, _, _ = batch_loss(model, batch)
            if recompute and backward:
                hooks = [
                    m.register_forward_pre_hook(lambda mod, *_: counter.unit(mod._unit)) for m in _recompute_roots(vlm)
                ]
                counter.phase = "recompute"
                loss.backward()
                for h in hooks:
                    h.remove()
            elif recompute:
                kept.replay(counter, vlm)
    finally:
        counter.close()
        if kept:
            kept.close()
        set_recompute(vlm, False)
    model.zero_grad(set_to_none=True)
    return counter.parts(), counter.units


def _recompute_roots(vlm):
    """The first module each checkpointed function runs, named by its unit (real backward)."""
    lm, roots = vlm.language_model, []
    for i, layer in enumerate(lm.decoder.layers):
        layer._unit = ("layer", i)
        roots.append(layer)
    for i, layer in enumerate(vlm.vision_model.decoder.layers if vlm.vision_model is not None else []):
        layer._unit = ("vision", i)
        roots.append(layer)
    for i, layer in enumerate(lm.mtp.layers if lm.mtp_process else []):
        layer.enorm._unit = ("mtp", i)
        roots.append(layer.enorm)
    return roots


def compare(parts, units, predicted, layer_types):
    """[(part, measured, predicted)] for every part the breakdown names. What several layers keep is
    measured as ``per_stage``: the GDN layers' shared layout is, unless one GDN layer alone keeps it."""
    n_gdn = sum(kind == LINEAR for kind in layer_types)
    shared_by_one = predicted.gdn_shared if n_gdn == 1 else 0.0
    rows = [(name, parts.get(name, 0.0), getattr(predicted, name)) for name in ("vision", "embedding", "output", "mtp")]
    rows.append(("per_stage", parts.get("per_stage", 0.0), predicted.per_stage + predicted.gdn_shared - shared_by_one))
    for i, kind in enumerate(layer_types):
        rows.append(
            (
                f"layer{i}.{'gdn' if kind == LINEAR else 'attention'}",
                parts.get(("mixer", i), 0.0),
                predicted.gdn_layer + shared_by_one if kind == LINEAR else predicted.attention_layer,
            )
        )
        rows.append((f"layer{i}.mlp", parts.get(("mlp", i), 0.0), predicted.mlp_layer))
    if units:
        work = max(v for k, v in units.items() if k[0] == "layer")
        rows.append(("recompute_working", work, predicted.recompute_working))
        for kind, field in (("vision", "vision_recompute_working"), ("mtp", "mtp_recompute_working")):
            if any(k[0] == kind for k in units):
                rows.append((field, max(v for k, v in units.items() if k[0] == kind), getattr(predicted, field)))
    total = sum(parts.values())
    n_attn = sum(kind == FULL for kind in layer_types)
    rows.append(
        ("total", total, predicted.stage(len(layer_types) - n_attn, n_attn, True, True) - predicted.working(True, True))
    )
    return rows


def worst(rows):
    return max(abs(p - m) / m if m else (0.0 if not p else float("inf")) for _, m, p in rows)


@pytest.fixture(scope="module", params=list(SHAPES))
def built(request, mcore):
    shape, lengths, grids = SHAPES[request.param]
    models = {dtype: build(shape, dtype) for dtype in (torch.float32, torch.bfloat16)}
    return request.param, shape, lengths, grids, models


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("recompute", [None, "full"], ids=["plain", "recompute"])
def test_activation_bytes_within_ten_percent(built, dtype, layout, recompute):
    name, shape, lengths, grids, models = built
    model, vlm = models[dtype]
    padded_to = max(lengths) + 10 if layout == "padded" else None
    torch.manual_seed(0)
    batch = micro_batch(shape, lengths, grids, padded_to)
    parts, units = measure(model, vlm, batch, recompute is not None)
    b = 4 if dtype == torch.float32 else 2
    kw = dict(dtype_bytes=b, recompute=recompute, padded_to=padded_to)
    rows = compare(parts, units, micro_batch_activations(shape, lengths, grids, **kw), shape.text.layer_types)
    print(f"\n{name} {layout} {'fp32' if b == 4 else 'bf16'} recompute={recompute}")
    for part, m, p in rows:
        print(
            f"  {part:26s} measured {m / 2**20:10.3f} MiB  predicted {p / 2**20:10.3f} MiB  "
            f"{(p - m) / m * 100 if m else 0.0:+7.3f}%"
        )
    bad = [(part, m, p) for part, m, p in rows if abs(p - m) > TOLERANCE * m]
    assert not bad, f"parts off by more than 10%: {bad}"
    # the comparison can fail: the wrong dtype, or recompute ignored, is far outside 10%
    wrong = micro_batch_activations(shape, lengths, grids, **{**kw, "dtype_bytes": 6 - b})
    assert worst(compare(parts, units, wrong, shape.text.layer_types)) > 2 * TOLERANCE
    ignored = micro_batch_activations(shape, lengths, grids, **{**kw, "recompute": None if recompute else "full"})
    assert worst(compare(parts, {}, ignored, shape.text.layer_types)) > 2 * TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_replay_is_the_recompute(mcore, dtype):
    """Running the checkpointed functions again saves what megatron's backward saves recomputing them."""
    shape, lengths, grids = SHAPES["tiny_moe_mtp"]
    model, vlm = build(shape, dtype)
    batch = micro_batch(shape, lengths, grids)
    _, replayed = measure(model, vlm, batch, recompute=True)
    _, real = measure(model, vlm, batch, recompute=True, backward=True)
    assert len(real) == shape.text.num_layers + shape.vision.depth + shape.text.mtp_num_layers
    assert replayed == real


def test_under_cp_the_tower_counts_the_fullest_ranks_frames():
    """The model deals frames to CP ranks by FLOPs (``vision_context_parallel``): a long video splits
    evenly, two unequal images cannot, and the planner counts the rank with the most patches."""
    from examples.multimodal_dev.planner.activation_memory import rank_frames

    shape = get_variant("9b")
    video = rank_frames(shape, [(256, 12, 16)], 4)
    assert video == [(1, 12, 16)] * 64
    images = rank_frames(shape, [(1, 32, 32), (1, 8, 8)], 2)
    assert images == [(1, 32, 32)]  # 1024 of 1088 patches, not half
    plain = micro_batch_activations(shape, [4096], [(1, 32, 32), (1, 8, 8)], cp=2)
    alone = micro_batch_activations(shape, [4096], [(1, 32, 32)], cp=1)
    assert plain.vision == alone.vision

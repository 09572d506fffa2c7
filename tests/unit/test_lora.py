"""LoRA (``lora/``) on the tiny model, dense and MoE, one process, fp32: with ``B = 0`` the model is
the base model exactly; only adapters get gradients and the base weights stay bitwise; the merged
weights give the adapted model's logits; the default targets reach every linear of the decoder,
Gated DeltaNet and the experts included; checkpoints split ``B`` as they split the weight."""

from types import SimpleNamespace

import pytest
import torch
from hf_reference import image_tokens, megatron_position_ids, pixel_values_for

from examples.multimodal_dev.lora import apply as lora
from examples.multimodal_dev.lora.adapter import LoraLinear
from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS, TARGETS, check, parse_targets
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model

MERGE_RTOL = 1e-5  # merged against unmerged logits, relative to the largest logit (fp32)


def _batch(shape):
    grids = [(1, 4, 6)]
    ids = torch.tensor([[5, 6, *image_tokens(shape, 4, 6), 7, 8, 9, 10, 11, 12]])
    pixels = pixel_values_for(shape, grids, torch.Generator().manual_seed(3))
    positions = megatron_position_ids(shape, ids, torch.ones_like(ids), torch.tensor(grids))
    return dict(input_ids=ids, position_ids=positions, pixel_values=pixels, image_grid_thw=torch.tensor(grids))


def _model(moe: bool, seed: int = 0):
    torch.manual_seed(seed)
    shape = get_variant("tiny", moe=moe)
    return shape, build_model(shape)


def _adapted(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


@pytest.fixture(scope="module", params=["dense", "moe"])
def adapted(request, mcore):
    """(shape, base model's logits, the model with adapters of rank 4 on the default targets)."""
    shape, model = _model(request.param == "moe")
    batch = _batch(shape)
    with torch.no_grad():
        base = model(**batch)
    counts = lora.apply(model, 4, 8.0, 0.0, DEFAULT_TARGETS, seed=1234)
    return request.param, shape, batch, base, model, counts


def test_adapters_at_zero_leave_the_model_unchanged(adapted):
    _, _, batch, base, model, _ = adapted
    with torch.no_grad():
        assert torch.equal(model(**batch), base)


def test_default_targets_reach_every_decoder_linear(adapted):
    """Every linear named a target in the language model's decoder has an adapter, and nothing else:
    Gated DeltaNet's in_proj / out_proj in three layers of four, every routed and shared expert."""
    kind, shape, _, _, model, counts = adapted
    names = _adapted(model)
    layers = shape.text.num_layers
    gdn = sum(t == "linear_attention" for t in shape.text.layer_types)
    assert counts["in_proj"] == counts["out_proj"] == gdn > 0
    assert counts["linear_qkv"] == counts["linear_proj"] == layers - gdn
    mlps = layers * ((shape.text.num_experts + 1) if kind == "moe" else 1)  # + the shared expert
    assert counts["linear_fc1"] == counts["linear_fc2"] == mlps
    assert all(n.startswith("language_model.decoder.layers.") for n in names)
    assert len(names) == sum(counts.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{h}" for n in names for h in "AB"}


def test_only_adapters_train_and_the_base_stays_bitwise(adapted):
    kind, shape, batch, _, model, _ = adapted
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        model(**batch).float().logsumexp(-1).mean().backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
        optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any(n.endswith("lora_B") for n in moved) and any(n.endswith("lora_A") for n in moved)


def test_merged_weights_give_the_adapted_logits(adapted):
    """B set away from zero; the base weights replaced by ``merged_weight`` and the adapters zeroed."""
    _, shape, batch, _, model, _ = adapted
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in _adapted(model).values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.05)
        adapted_logits = model(**batch)
        for module in _adapted(model).values():
            module.weight.copy_(module.merged_weight())
            module.lora_B.zero_()
        merged = model(**batch)
    diff, scale = (merged - adapted_logits).abs().max().item(), adapted_logits.abs().max().item()
    print(f"merged vs adapted: max abs diff {diff:.2e} (largest logit {scale:.2f})")
    assert diff <= MERGE_RTOL * scale
    assert not torch.allclose(adapted_logits, adapted[3], atol=1e-3)  # the adapters did change the model


def test_an_adapter_starts_from_its_name_and_seed_alone(mcore):
    """``A`` is drawn from the seed and the linear's name in the whole model: the same model built
    twice from different torch seeds gets the same adapters; another seed, others."""
    _, first = _model(False, seed=0)
    _, second = _model(False, seed=5)
    _, third = _model(False, seed=0)
    for model, seed in ((first, 1), (second, 1), (third, 2)):
        lora.apply(model, 4, 4.0, 0.0, ("in_proj",), seed=seed)
    a = [m.lora_A for m in _adapted(first).values()]
    assert all(torch.equal(x, m.lora_A) for x, m in zip(a, _adapted(second).values()))
    assert not any(torch.equal(x, m.lora_A) for x, m in zip(a, _adapted(third).values()))
    assert len({tuple(x.flatten()[:4].tolist()) for x in a}) == len(a)  # each layer its own draw


def test_checkpoints_split_b_as_they_split_the_weight(mcore):
    """Gated DeltaNet's in_proj and a gated linear_fc1 split their weight into named sections in
    checkpoints (so they reshard across TP); their ``B`` rows follow the weight's, split alike."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    _, model = _model(True)
    lora.apply(model, 4, 4.0, 0.0, DEFAULT_TARGETS, seed=0)
    state = model.sharded_state_dict()
    layer = "language_model.decoder.layers.0."
    assert layer + "self_attention.in_proj.lora_B" in state
    for weight in ("self_attention.in_proj", "mlp.shared_experts.linear_fc1"):
        assert isinstance(state[layer + weight + ".weight"], ShardedTensorFactory)
        assert isinstance(state[layer + weight + ".lora_B"], ShardedTensorFactory)
    assert not isinstance(state[layer + "self_attention.out_proj.lora_B"], ShardedTensorFactory)
    expert = state[layer + "mlp.experts.local_experts.1.linear_fc2.lora_B"]  # numbered in the whole model
    assert expert.key == layer + "mlp.experts.experts.linear_fc2.lora_B" and expert.global_offset[0] == 1
    assert isinstance(state[layer + "mlp.experts.local_experts.1.linear_fc1.lora_B"], ShardedTensorFactory)


def test_targets_and_settings_are_refused_by_name():
    assert parse_targets("in_proj, vision.merger.linear_fc1") == ("in_proj", "vision.merger.linear_fc1")
    with pytest.raises(ValueError, match="no linear is named q_proj"):
        parse_targets("in_proj,q_proj")
    with pytest.raises(ValueError, match="no target named"):
        parse_targets(" , ")
    assert set(DEFAULT_TARGETS) <= set(TARGETS)

    def args(**kw):
        base = dict(lora_rank=8, lora_alpha=None, lora_dropout=0.0, lora_targets="in_proj,linear_fc1")
        return SimpleNamespace(**{**base, **kw})

    ok = args()
    check(ok)
    assert ok.lora_alpha == 8.0
    for settings, message in (
        (dict(lora_rank=-1), "--lora-rank -1"),
        (dict(lora_alpha=float("nan")), "--lora-alpha nan"),
        (dict(lora_dropout=1.0), "--lora-dropout 1.0"),
        (dict(lora_targets="q_proj"), "no linear is named q_proj"),
    ):
        with pytest.raises(ValueError, match=message):
            check(args(**settings))


class _TEStandIn(torch.nn.Module):
    """What the adapter reads of megatron-core's Transformer Engine wrappers (TE is not on this
    host): ``weight``, ``config``, ``_tp_group``, a forward returning (output, bias); and for the
    LayerNorm-linear, TE's norm attributes. Named and placed as megatron's classes are, which is how
    ``linear_facts`` knows them."""

    def __init__(self, weight, config, group, norm=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.config, self._tp_group = config, group
        if norm is not None:  # TE's LayerNormLinear: normalization, eps, zero_centered_gamma, layer_norm_weight
            self.normalization = "RMSNorm" if norm.rms else "LayerNorm"
            self.eps, self.zero_centered_gamma = norm.eps, norm.zero_centered
            self.layer_norm_weight = torch.nn.Parameter(norm.weight.detach().clone())
        self.norm = norm

    def forward(self, x):
        return torch.nn.functional.linear(self.norm(x) if self.norm is not None else x, self.weight), None


def _te_class(name):
    from examples.multimodal_dev.lora.adapter import _TE_MODULE

    return type(name, (_TEStandIn,), {"__module__": _TE_MODULE})


def test_te_linears_take_the_adapter_the_local_ones_do(mcore):
    """A Gated DeltaNet layer's input norm + in_proj and its out_proj, as local linears and as TE's
    (the norm fused into in_proj): the same adapters give the same outputs and gradients, the
    adapter behind the fused norm computing that norm itself; an expert flag the linear contradicts
    is refused."""
    from examples.multimodal_dev.lora.adapter import COLUMN, ROW, attach, linear_facts

    _, model = _model(False)
    layer = model.language_model.decoder.layers[0]
    norm, in_proj, out_proj = layer.input_layernorm, layer.self_attention.in_proj, layer.self_attention.out_proj
    with torch.no_grad():
        norm.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    te_in = _te_class("TELayerNormColumnParallelLinear")(in_proj.weight, in_proj.config, in_proj.tp_group, norm)
    te_out = _te_class("TERowParallelLinear")(out_proj.weight, out_proj.config, out_proj.tp_group)
    assert linear_facts(te_in, False).fused_norm and linear_facts(te_in, False).kind == COLUMN
    assert linear_facts(te_out, False).kind == ROW and not linear_facts(te_out, False).fused_norm
    with pytest.raises(ValueError, match="is_expert is False, its place says True"):
        linear_facts(in_proj, True)
    with pytest.raises(TypeError, match="Linear is not one of megatron-core's tensor-parallel linears"):
        linear_facts(torch.nn.Linear(2, 2), False)
    pairs = ((in_proj, te_in), (out_proj, te_out))
    for i, (local, te) in enumerate(pairs):
        for linear in (local, te):
            attach(linear, 4, 8.0, 0.0, torch.Generator().manual_seed(i), False)
            with torch.no_grad():
                linear.lora_B.copy_(torch.randn(linear.lora_B.shape, generator=torch.Generator().manual_seed(9)))
    x = torch.randn(5, 1, in_proj.weight.shape[1], generator=torch.Generator().manual_seed(4))
    outputs = {}
    for name, first, second in (
        ("local", lambda t: in_proj(norm(t))[0], out_proj),
        ("te", lambda t: te_in(t)[0], te_out),
    ):
        inputs = x.clone().requires_grad_(True)
        hidden = first(inputs)
        out = second(hidden[..., : second.weight.shape[1]])[0]
        out.square().sum().backward()
        outputs[name] = (hidden, out, inputs.grad)
    saved, x_in = [], x.clone().requires_grad_(True)  # what the fused norm's adapter input keeps for
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):  # backward:
        te_in.lora_input(x_in)  # its inputs alone, alive anyway (the norm is recomputed)
    assert saved and {t.data_ptr() for t in saved} <= {x_in.data_ptr(), te_in.layer_norm_weight.data_ptr()}
    got = [*outputs["te"], *(getattr(te, h).grad for _, te in pairs for h in ("lora_A", "lora_B"))]
    want = [*outputs["local"], *(getattr(local, h).grad for local, _ in pairs for h in ("lora_A", "lora_B"))]
    for g, w in zip(got, want):  # fp32, summed in other orders: within 1e-5 of the tensor's largest entry
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


def test_narrow_sides_are_the_built_linears(adapted):
    """``narrow_sides`` (the rank warning's widths, from the shape alone) against the built model's
    linears: the narrowest min(d_in, d_out) of each target's linears."""
    from examples.multimodal_dev.lora.targets import narrow_sides

    _, shape, _, _, model, _ = adapted
    built = _built_sides(model, DEFAULT_TARGETS)
    assert built == {t: w for t, w in narrow_sides(shape).items() if t in built}


def _built_sides(model, targets) -> dict:
    from examples.multimodal_dev.lora.targets import target_of

    built = {}
    for name, module in _adapted(model).items():
        target = target_of(name, targets)
        built[target] = min(built.get(target, 1 << 30), *module.weight.shape)
    return built


def test_narrow_sides_of_the_vision_tower_and_of_narrow_experts(mcore):
    """The vision tower's linears; and experts narrower than the hidden size (35b_a3b's are a quarter
    of it), where the gated linear_fc1 is twice as wide as linear_fc2's input."""
    from dataclasses import replace

    from examples.multimodal_dev.lora.targets import VISION_TARGETS, narrow_sides

    shape, model = _model(False)
    lora.apply(model, 2, 2.0, 0.0, VISION_TARGETS, seed=0)
    assert _built_sides(model, VISION_TARGETS) == {t: w for t, w in narrow_sides(shape).items() if t in VISION_TARGETS}
    moe = get_variant("tiny", moe=True)
    quarter = moe.text.hidden_size // 4
    narrow = replace(moe, text=replace(moe.text, moe_ffn_hidden_size=quarter, shared_expert_ffn_hidden_size=quarter))
    model = build_model(narrow)
    lora.apply(model, 2, 2.0, 0.0, ("linear_fc1", "linear_fc2"), seed=0)
    assert _built_sides(model, ("linear_fc1", "linear_fc2")) == {"linear_fc1": 2 * quarter, "linear_fc2": quarter}
    assert {t: narrow_sides(narrow)[t] for t in ("linear_fc1", "linear_fc2")} == {
        "linear_fc1": 2 * quarter,
        "linear_fc2": quarter,
    }


def _lora_args(**kw):
    base = dict(lora_rank=4, lora_alpha=None, lora_dropout=0.0, lora_targets=",".join(DEFAULT_TARGETS))
    return SimpleNamespace(**{**base, "freeze_language": False, "freeze_vision": False, **kw})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(freeze_language=True), "--lora-targets linear_qkv,.* with --freeze-language: every adapter is in the"),
        (
            dict(lora_targets="vision.linear_qkv", freeze_vision=True),
            "--lora-targets vision.linear_qkv with --freeze-v",
        ),
        (dict(lora_rank=0, freeze_language=True, freeze_vision=True), "--freeze-language with --freeze-vision: nothi"),
        (dict(lora_rank=0, lora_alpha=8.0), "--lora-alpha 8.0 without --lora-rank: there are no adapters"),
        (dict(lora_rank=0, lora_dropout=0.1), "--lora-dropout 0.1 without --lora-rank"),
        (dict(lora_rank=0, lora_targets="in_proj"), "--lora-targets in_proj without --lora-rank"),
    ],
)
def test_a_run_that_trains_nothing_or_drops_a_setting_is_refused(settings, message):
    """Each of these exited 0: having trained nothing (the freeze covers the adapters of its part), or
    with every weight trained and the LoRA setting dropped."""
    with pytest.raises(ValueError, match=message):
        check(_lora_args(**settings))


def test_what_still_trains_passes():
    check(_lora_args(lora_targets="in_proj,vision.linear_qkv", freeze_language=True))
    check(_lora_args(lora_rank=0, freeze_vision=True))


def test_a_rank_past_a_linears_narrow_side_is_warned():
    """Rank 4096 on the tiny model gave 29.6 M adapter values for 3 M weights without a word."""
    from examples.multimodal_dev.lora.targets import rank_warning

    shape = get_variant("tiny", moe=False)
    hidden = shape.text.hidden_size
    assert rank_warning(_lora_args(lora_rank=hidden), shape) is None
    line = rank_warning(_lora_args(lora_rank=4096, lora_targets="in_proj,vision.linear_qkv"), shape)
    assert line == (
        f"warning: --lora-rank 4096 is past the narrower side of in_proj ({hidden}), vision.linear_qkv "
        f"({shape.vision.hidden_size}): there an adapter holds more values than it can use (B @ A has rank at "
        "most min(d_in, d_out))"
    )
    assert rank_warning(_lora_args(lora_rank=0), shape) is None


def test_a_resume_at_another_alpha_is_refused(tmp_path, monkeypatch):
    """The adapters learned at alpha / rank; another alpha scales what they add: LORA_ALPHA=64 on a run
    saved at 4 resumed at 16 times the update with no message."""
    from examples.multimodal_dev.checkpoint import adapters_from_base

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    stored = SimpleNamespace(lora_rank=4, lora_alpha=4.0, lora_targets="in_proj")
    monkeypatch.setattr(adapters_from_base, "stored_args", lambda directory: stored)
    args = _lora_args(lora_alpha=4.0, lora_targets="in_proj")
    adapters_from_base.check_adapters_kept(args, str(tmp_path), "--load")
    with pytest.raises(ValueError) as refused:
        adapters_from_base.check_adapters_kept(
            _lora_args(lora_alpha=64.0, lora_targets="in_proj"), str(tmp_path), "--load"
        )
    assert str(refused.value) == (
        f"--load {tmp_path} holds LoRA adapters trained at --lora-alpha 4 (scale 1); this run has 64 (scale 16): "
        "train on with --lora-alpha 4 (LORA_ALPHA)"
    )

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

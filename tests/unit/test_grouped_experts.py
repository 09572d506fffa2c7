"""Grouped-GEMM experts (models/common/grouped_experts.py) against megatron-core's SequentialMLP:
the same weights give the same MoE layer output and gradients (dropless, and with a capacity that
drops and pads), the same sharded checkpoint entries, and a checkpoint of either loads into the
other bitwise. The engine runs against each other from one checkpoint are in
tests/distributed/test_parallelism.py (GROUPED_EXPERTS=0 beside the grouped single process, and
every EP / ETP / DP layout on the grouped experts)."""

import re
from dataclasses import replace

import pytest
import torch

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model

EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight$")
# fp32: the same products summed in the same order on this host; the bound leaves room for a BLAS that
# blocks a grouped GEMM differently from separate ones (fp32 rounding ~6e-8 a step, ~1e2 terms)
FP32_REL = 1e-5


def _pair(**settings):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    shape = get_variant("tiny", moe=True, mtp=False)
    model_parallel_cuda_manual_seed(7)
    sequential = build_model(shape, use_cpu_initialization=True, **settings)
    grouped = build_model(shape, use_cpu_initialization=True, moe_grouped_gemm=True, **settings)
    return shape, sequential, grouped


def _pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _copy_experts(sequential, grouped) -> None:
    """The sequential model's weights into the grouped one, each expert's linear into its slice."""
    source, target = sequential.state_dict(), grouped.state_dict()
    for key in target:
        match = EXPERT_WEIGHT.match(key)
        if match:
            prefix, linear = match.groups()
            experts = target[key].shape[0]
            target[key] = torch.stack([source[f"{prefix}local_experts.{e}.{linear}.weight"] for e in range(experts)])
        elif key in source:
            target[key] = source[key]
    grouped.load_state_dict(target)


def _close(a, b, rel=FP32_REL):
    scale = b.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / scale) <= rel


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True},
        {"moe_expert_capacity_factor": 0.5},
        {"bias_activation_fusion": True},  # megatron's default in a training run: the fused weighted SwiGLU
    ],
    ids=["dropless", "capacity, padded", "capacity, dropping", "fused SwiGLU"],
)
def test_grouped_layer_equals_sequential(mcore, settings):
    _, sequential, grouped = _pair(**settings)
    _copy_experts(sequential, grouped)
    layer_s = sequential.language_model.decoder.layers[0].mlp
    layer_g = grouped.language_model.decoder.layers[0].mlp
    assert type(layer_g.experts).__name__ == "GroupedExperts"
    # dropless: the permutation sized on the host (models/common/dropless_dispatch.py); with a capacity,
    # and in front of SequentialMLP, megatron-core's dispatcher
    dropless = "moe_expert_capacity_factor" not in settings
    assert type(layer_g.token_dispatcher).__name__ == (
        "DroplessLocalDispatcher" if dropless else "MoEAllGatherTokenDispatcher"
    )
    assert type(layer_s.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
    torch.manual_seed(0)
    x_s = torch.randn(40, 2, layer_s.config.hidden_size, requires_grad=True)
    x_g = x_s.detach().clone().requires_grad_(True)
    (y_s, _), (y_g, _) = layer_s(x_s), layer_g(x_g)
    assert _close(y_g, y_s)
    grad = torch.randn_like(y_s)
    y_s.backward(grad)
    y_g.backward(grad)
    assert _close(x_g.grad, x_s.grad)
    for linear in ("linear_fc1", "linear_fc2"):
        per_expert = torch.stack([getattr(e, linear).weight.grad for e in layer_s.experts.local_experts])
        assert _close(getattr(layer_g.experts, linear).weight.grad, per_expert), linear
    assert _close(layer_g.router.weight.grad, layer_s.router.weight.grad)  # through the permuted probabilities


def test_dropless_dispatch_reads_nothing_back(mcore):
    """A MoE layer's forward and backward on the grouped experts: not one host sync (megatron-core's
    dispatcher in front of SequentialMLP reads the counts back, and SequentialMLP splits by them)."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally

    _, sequential, grouped = _pair()
    syncs = {}
    for name, model in (("sequential", sequential), ("grouped", grouped)):
        layer = model.language_model.decoder.layers[0].mlp
        x = torch.randn(40, 2, layer.config.hidden_size, requires_grad=True)
        tally = StepTally()
        with tally.counting():
            y, _ = layer(x)
            y.sum().backward()
        syncs[name] = sum(tally.syncs.values())
    assert syncs["grouped"] == 0 and syncs["sequential"] >= 3, syncs


def _expert_entries(model) -> dict:
    """key -> sorted [(global offset, global shape, replica id, data)] of the experts' sharded tensors and
    objects (the linears' empty extra state, which a strict load asks for)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    entries: dict = {}
    for value in nested_values(sharded):
        if isinstance(value, (ShardedTensor, ShardedObject)) and ".experts.experts." in value.key:
            data = value.data.clone() if isinstance(value, ShardedTensor) else torch.tensor(value.data is None)
            entries.setdefault(value.key, []).append(
                (tuple(value.global_offset), tuple(value.global_shape), value.replica_id, data)
            )
    return {k: sorted(v, key=lambda e: e[0]) for k, v in entries.items()}


def test_checkpoint_entries_are_sequentials(mcore):
    _, sequential, grouped = _pair()
    _copy_experts(sequential, grouped)
    mine, theirs = _expert_entries(grouped), _expert_entries(sequential)
    assert sorted(mine) == sorted(theirs) and mine
    for key in theirs:
        assert [e[:3] for e in mine[key]] == [e[:3] for e in theirs[key]], key
        assert all(torch.equal(a[3], b[3]) for a, b in zip(mine[key], theirs[key])), key


def _stacked_experts(model) -> dict:
    """``...mlp.experts.linear_fcN.weight`` -> [E, out, in] of either implementation."""
    state = model.state_dict()
    out = {}
    for key, value in state.items():
        match = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$", key)
        if match:
            out.setdefault(f"{match[1]}{match[3]}.weight", {})[int(match[2])] = value
        elif EXPERT_WEIGHT.match(key):
            out[key] = value
    return {k: torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}


@pytest.mark.parametrize("direction", ["sequential -> grouped", "grouped -> sequential"])
def test_checkpoint_loads_into_the_other_bitwise(mcore, tmp_path, direction):
    from megatron.core import dist_checkpointing

    _, sequential, grouped = _pair()  # each drawn from its own init: the load must replace the weights
    saver, loader = (sequential, grouped) if direction.startswith("sequential") else (grouped, sequential)
    dist_checkpointing.save(saver.sharded_state_dict(), str(tmp_path))
    loaded = dist_checkpointing.load(loader.sharded_state_dict(), str(tmp_path))
    loader.load_state_dict(loaded, strict=False)
    want, got = _stacked_experts(saver), _stacked_experts(loader)
    assert sorted(want) == sorted(got) and want
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_gpu_run_outside_bf16_is_refused_in_one_line(mcore, monkeypatch):
    """torch's grouped_mm takes bfloat16 on CUDA: an fp32 / fp16 GPU run is told before it builds."""
    from examples.multimodal_dev.models.common.grouped_experts import GroupedExperts
    from examples.multimodal_dev.models.qwen35_vl.configuration import language_transformer_config

    config = language_transformer_config(get_variant("tiny", moe=True, mtp=False).text)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"^--moe-grouped-gemm on a GPU needs --bf16 .*torch.float32") as refused:
        GroupedExperts(4, config)
    assert "\n" not in str(refused.value)


def test_a_rank_whose_experts_get_no_token(mcore):
    """Every token routed elsewhere (EP): an empty output, and zero gradients for the experts' weights."""
    _, _, grouped = _pair()
    experts = grouped.language_model.decoder.layers[0].mlp.experts
    hidden = experts.config.hidden_size
    tokens = torch.zeros(0, hidden, requires_grad=True)
    out, _ = experts(tokens, torch.zeros(experts.num_local_experts, dtype=torch.long), torch.zeros(0))
    assert out.shape == (0, hidden)
    out.sum().backward()
    for linear in (experts.linear_fc1, experts.linear_fc2):
        assert linear.weight.grad is not None and not linear.weight.grad.any()


def test_rows_grouped_mm_cannot_read_are_refused(mcore):
    from examples.multimodal_dev.models.common.grouped_experts import GroupedExperts
    from examples.multimodal_dev.models.qwen35_vl.configuration import language_transformer_config

    shape = get_variant("tiny", moe=True, mtp=False)
    config = language_transformer_config(replace(shape.text, moe_ffn_hidden_size=30))
    with pytest.raises(ValueError, match=r"--moe-ffn-hidden-size / expert TP 30 is not a multiple of 4"):
        GroupedExperts(4, config, pg_collection=_pg())

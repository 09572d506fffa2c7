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

EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|lora_A|lora_B)$")
# fp32: the same products summed in the same order on this host; the bound leaves room for a BLAS that
# blocks a grouped GEMM differently from separate ones (fp32 rounding ~6e-8 a step, ~1e2 terms)
FP32_REL = 1e-5


def _pair(lora_rank=0, **settings):
    """(shape, SequentialMLP model, grouped model); with ``lora_rank``, LoRA on every linear of both
    from one seed (``lora/apply.py``)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from examples.multimodal_dev.lora.apply import apply
    from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS

    shape = get_variant("tiny", moe=True, mtp=False)
    model_parallel_cuda_manual_seed(7)
    sequential = build_model(shape, use_cpu_initialization=True, **settings)
    grouped = build_model(shape, use_cpu_initialization=True, moe_grouped_gemm=True, **settings)
    if lora_rank:
        for model in (sequential, grouped):
            apply(model, lora_rank, 2.0 * lora_rank, 0.0, DEFAULT_TARGETS, seed=3)
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
            prefix, linear, tensor = match.groups()
            experts = target[key].shape[0]
            target[key] = torch.stack([source[f"{prefix}local_experts.{e}.{linear}.{tensor}"] for e in range(experts)])
        elif key in source:
            target[key] = source[key]
    grouped.load_state_dict(target)


def _same_forward_and_input_gradient(layer_s, layer_g) -> None:
    """Both MoE layers on one input: the same output, and after one backward the same input gradient."""
    torch.manual_seed(0)
    x_s = torch.randn(40, 2, layer_s.config.hidden_size, requires_grad=True)
    x_g = x_s.detach().clone().requires_grad_(True)
    (y_s, _), (y_g, _) = layer_s(x_s), layer_g(x_g)
    assert _close(y_g, y_s)
    grad = torch.randn_like(y_s)
    y_s.backward(grad)
    y_g.backward(grad)
    assert _close(x_g.grad, x_s.grad)


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
    # the permutation sized on the host (models/common/sized_dispatch.py) in every setting here; in
    # front of SequentialMLP, megatron-core's dispatcher
    assert type(layer_g.token_dispatcher).__name__ == "HostSizedDispatcher"
    assert type(layer_s.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
    _same_forward_and_input_gradient(layer_s, layer_g)
    for linear in ("linear_fc1", "linear_fc2"):
        per_expert = torch.stack([getattr(e, linear).weight.grad for e in layer_s.experts.local_experts])
        assert _close(getattr(layer_g.experts, linear).weight.grad, per_expert), linear
    assert _close(layer_g.router.weight.grad, layer_s.router.weight.grad)  # through the permuted probabilities


CAPACITY = {"moe_expert_capacity_factor": 0.5}


@pytest.mark.parametrize(
    "settings,reads",
    [({}, 0), ({**CAPACITY, "moe_pad_expert_input_to_capacity": True}, 0), (CAPACITY, 1)],
    ids=["dropless", "drop-and-pad", "dropping"],
)
def test_dispatch_reads_back_at_most_once(mcore, settings, reads):
    """A MoE layer's forward and backward on the grouped experts: no host sync where the routing fixes
    the sizes (dropless with every expert local, drop-and-pad), one where it does not (megatron-core's
    dispatcher in front of SequentialMLP reads the counts back three times, and SequentialMLP splits
    by them)."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally

    _, sequential, grouped = _pair(**settings)
    syncs = {}
    for name, model in (("sequential", sequential), ("grouped", grouped)):
        layer = model.language_model.decoder.layers[0].mlp
        x = torch.randn(40, 2, layer.config.hidden_size, requires_grad=True)
        tally = StepTally()
        with tally.counting():
            y, _ = layer(x)
            y.sum().backward()
        syncs[name] = sum(tally.syncs.values())
    assert syncs["grouped"] == reads and syncs["sequential"] >= 3, syncs


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


def _planted_adapters(model) -> None:
    """Every ``B`` random (it starts at zero, which would hide the adapters' product and A's gradient)."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("rank", [4, 3], ids=["rank 4", "rank 3, padded"])
def test_lora_on_grouped_experts_equals_sequential(mcore, rank):
    """LoRA on the routed experts: the grouped adapters start as SequentialMLP's (the same A per
    expert from one seed), and give the same MoE output, input gradient and adapter gradients. Rank 3
    is padded to rows of 16 bytes for grouped_mm (lora/grouped.py)."""
    _, sequential, grouped = _pair(lora_rank=rank)
    layer_s = sequential.language_model.decoder.layers[0].mlp
    layer_g = grouped.language_model.decoder.layers[0].mlp
    for linear in ("linear_fc1", "linear_fc2"):
        per_expert = torch.stack([getattr(e, linear).lora_A for e in layer_s.experts.local_experts])
        assert torch.equal(getattr(layer_g.experts, linear).lora_A, per_expert), linear
    _planted_adapters(sequential)
    _copy_experts(sequential, grouped)
    _same_forward_and_input_gradient(layer_s, layer_g)
    for linear in ("linear_fc1", "linear_fc2"):
        grouped_linear = getattr(layer_g.experts, linear)
        assert grouped_linear.weight.grad is None and not grouped_linear.weight.requires_grad  # frozen
        for half in ("lora_A", "lora_B"):
            per_expert = torch.stack([getattr(getattr(e, linear), half).grad for e in layer_s.experts.local_experts])
            assert _close(getattr(grouped_linear, half).grad, per_expert), (linear, half)


def test_lora_on_grouped_experts_writes_sequentials_checkpoint_entries(mcore):
    """The adapters' entries (keys, offsets, replica ids and values) are SequentialMLP's adapters': a
    checkpoint of either loads into the other, and the conversion tools read it unchanged."""
    _, sequential, grouped = _pair(lora_rank=4)
    _planted_adapters(sequential)
    _copy_experts(sequential, grouped)
    mine, theirs = _expert_entries(grouped), _expert_entries(sequential)
    assert sorted(mine) == sorted(theirs) and any(".lora_B" in k for k in mine)
    for key in theirs:
        assert [e[:3] for e in mine[key]] == [e[:3] for e in theirs[key]], key
        assert all(torch.equal(a[3], b[3]) for a, b in zip(mine[key], theirs[key])), key


def test_lora_grouped_adapters_load_from_sequentials_checkpoint(mcore, tmp_path):
    from megatron.core import dist_checkpointing

    _, sequential, grouped = _pair(lora_rank=4)
    _planted_adapters(sequential)
    dist_checkpointing.save(sequential.sharded_state_dict(), str(tmp_path))
    loaded = dist_checkpointing.load(grouped.sharded_state_dict(), str(tmp_path))
    grouped.load_state_dict(loaded, strict=False)
    state = grouped.state_dict()
    for key, value in sequential.state_dict().items():
        match = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(lora_[AB])$", key)
        if match:
            assert torch.equal(state[f"{match[1]}{match[3]}.{match[4]}"][int(match[2])], value), key


def _experts_pair(lora_rank=4):
    """The first MoE layer's experts of both implementations, equal weights, adapters planted."""
    _, sequential, grouped = _pair(lora_rank=lora_rank)
    _planted_adapters(sequential)
    _copy_experts(sequential, grouped)
    return sequential.language_model.decoder.layers[0].mlp.experts, grouped.language_model.decoder.layers[0].mlp.experts


def _experts_step(experts, tokens, counts, probs, rows):
    """(output, every gradient) of ``experts`` on ``tokens`` [T, hidden] sorted by expert, the loss
    reading the first ``rows`` output rows."""
    tokens = tokens.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    out, _ = experts(tokens, torch.tensor(counts), probs)
    loss = (out[:rows] * torch.linspace(-1, 1, out[:rows].numel()).view(rows, -1)).sum()
    loss.backward()
    grads = {"tokens": tokens.grad[:rows], "probs": probs.grad[:rows], "tokens past": tokens.grad[rows:]}
    for linear in ("linear_fc1", "linear_fc2"):
        for half in ("lora_A", "lora_B"):
            if hasattr(experts, "local_experts"):
                grads[f"{linear}.{half}"] = torch.stack(
                    [getattr(getattr(e, linear), half).grad for e in experts.local_experts]
                )
            else:
                grads[f"{linear}.{half}"] = getattr(getattr(experts, linear), half).grad
    for p in experts.parameters():
        p.grad = None
    return out, loss, grads


# tokens per expert (4 experts): zero-token experts at each end and between, every token on one
# expert, and group sizes at every alignment of a 16-byte row (1 to 8 rows of 2 to 4 bytes)
COUNTS = {
    "zero-token experts": [0, 5, 0, 3],
    "first and last empty": [0, 7, 2, 0],
    "all on one expert": [0, 0, 9, 0],
    **{f"groups of {n}": [n, n + 1, n + 2, n + 3] for n in range(1, 9)},
}


@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_grouped_edge_cases_equal_sequential(mcore, counts):
    """grouped_mm's known traps, against SequentialMLP with LoRA on (every gradient: the tokens', the
    router probabilities', each adapter half's): experts with no token, every token on one, groups of
    every size modulo a 16-byte row."""
    seq, grp = _experts_pair()
    rows = sum(counts)
    tokens = torch.randn(rows, seq.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    probs = torch.rand(rows, generator=torch.Generator().manual_seed(rows + 1))
    out_s, loss_s, grads_s = _experts_step(seq, tokens, counts, probs, rows)
    out_g, loss_g, grads_g = _experts_step(grp, tokens, counts, probs, rows)
    assert _close(out_g, out_s)
    for name, grad in grads_s.items():
        if grad.numel():
            assert torch.isfinite(grads_g[name]).all() and _close(grads_g[name], grad), name
    for e, n in enumerate(counts):  # an expert without tokens: zero adapter gradients, not stale ones
        if not n:
            assert not grads_g["linear_fc1.lora_A"][e].any() and not grads_g["linear_fc2.lora_B"][e].any()


def test_a_nan_past_the_last_offset_reaches_nothing(mcore):
    """Rows past the last expert's end (a padded tail), NaN in the tokens and the probabilities: the
    output there is zero, and the loss and every gradient equal SequentialMLP's on the rows that count."""
    seq, grp = _experts_pair()
    counts, tail = [3, 0, 4, 2], 5
    rows = sum(counts)
    tokens = torch.randn(rows + tail, seq.config.hidden_size, generator=torch.Generator().manual_seed(0))
    probs = torch.rand(rows + tail, generator=torch.Generator().manual_seed(1))
    tokens[rows:], probs[rows:] = float("nan"), float("nan")
    out_s, loss_s, grads_s = _experts_step(seq, tokens[:rows], counts, probs[:rows], rows)
    out_g, loss_g, grads_g = _experts_step(grp, tokens, counts, probs, rows)
    assert out_g.shape[0] == rows + tail and not out_g[rows:].any()
    assert _close(out_g[:rows], out_s) and _close(loss_g, loss_s)
    assert not grads_g.pop("tokens past").any()
    for name, grad in grads_s.items():
        if name != "tokens past":
            assert torch.isfinite(grads_g[name]).all() and _close(grads_g[name], grad), name

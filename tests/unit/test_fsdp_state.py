"""An fsdp_dtensor save lists every parameter's optimizer state on every rank (``checkpoint/fsdp_state.py``):
a parameter whose shard is empty here gets zeros shaped like that shard, in the state's dtypes, and the
others' step."""

import torch

from examples.multimodal_dev.checkpoint.fsdp_state import completed_state


def test_a_parameter_without_state_gets_zeros_like_its_shard_and_the_step():
    held = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.full((4,), 2.0)}
    params = {"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(0, dtype=torch.bfloat16)}
    out = completed_state({"a": held}, params)
    assert out["a"] is held and set(out) == {"a", "b"}
    assert set(out["b"]) == set(held) and float(out["b"]["step"]) == 3.0
    for key in ("exp_avg", "exp_avg_sq"):
        assert out["b"][key].shape == (0,) and out["b"][key].dtype == torch.float32
    out["b"]["step"] += 1
    assert float(held["step"]) == 3.0  # a copy, not the other parameter's own


def test_a_rank_without_any_state_is_left_as_it_is():
    assert completed_state({}, {"a": torch.zeros(2)}) == {}


def test_the_run_args_say_each_weights_dtype_in_an_fsdp_checkpoint_of_fp32_main_weights():
    from types import SimpleNamespace

    from examples.multimodal_dev.checkpoint.fsdp_weights import trained_dtype

    assert trained_dtype(SimpleNamespace(bf16=True, fp16=False)) == torch.bfloat16
    assert trained_dtype(SimpleNamespace(bf16=False, fp16=True)) == torch.float16
    assert trained_dtype(SimpleNamespace()) == torch.float32


def test_sequential_expert_weights_name_their_row_of_the_grouped_weight():
    from examples.multimodal_dev.checkpoint.fsdp_state import GROUPED_EXPERT_WEIGHT
    from examples.multimodal_dev.checkpoint.fsdp_weights import _grouped

    key = "model.module.language_model.decoder.layers.3.mlp.experts.local_experts.12.linear_fc2.weight"
    grouped, row = _grouped(key)
    assert (grouped, row) == ("model.module.language_model.decoder.layers.3.mlp.experts.linear_fc2.weight", 12)
    assert GROUPED_EXPERT_WEIGHT.search(grouped) and not GROUPED_EXPERT_WEIGHT.search(key)
    assert _grouped("model.module.language_model.decoder.layers.3.mlp.shared_experts.linear_fc1.weight") is None
    # TE's GroupedMLP names its experts weight0, weight1 ...: megatron's own index, left to megatron
    assert not GROUPED_EXPERT_WEIGHT.search("decoder.layers.3.mlp.experts.linear_fc1.weight7")

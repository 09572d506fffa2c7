"""The distributed optimizer's checkpoint format: fully reshardable by default, dp_reshardable on
request with its padding zeroed, and a dp_reshardable checkpoint resumed at another layout refused
in one line naming what to run."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

from examples.multimodal_dev.checkpoint import optimizer_format


def _tensor(key, values):
    return ShardedTensor.from_rank_offsets(key, values)


def test_padding_entries_are_zeroed_and_real_state_is_not():
    garbage = torch.full((5,), float("nan"))
    real = torch.arange(3.0)
    # the nesting megatron's sharded_param_state_dp_reshardable returns: buffers -> dtypes -> buckets -> entries
    state = {
        0: {
            ("torch.float32", "torch.float32"): [
                [
                    {
                        "param": _tensor("p", real.clone()),
                        "exp_avg": _tensor("m", real.clone()),
                        "padding": LocalNonpersistentObject(False),
                    },
                    {
                        "param": _tensor("p", garbage.clone()),
                        "exp_avg": _tensor("m", garbage.clone()),
                        "padding": LocalNonpersistentObject(True),
                    },
                ]
            ]
        }
    }
    optimizer_format._zero_padding_entries(state)
    real_entry, pad_entry = state[0][("torch.float32", "torch.float32")][0]
    assert torch.equal(real_entry["param"].data, real) and torch.equal(real_entry["exp_avg"].data, real)
    assert torch.equal(pad_entry["param"].data, torch.zeros(5)) and torch.equal(
        pad_entry["exp_avg"].data, torch.zeros(5)
    )


def test_zeroed_padding_zeroes_what_megatrons_method_returns():
    state = {0: [{"param": _tensor("p", torch.full((2,), float("nan"))), "padding": LocalNonpersistentObject(True)}]}
    wrapped = optimizer_format.zeroed_padding(lambda self, *args, **kwargs: state)
    assert wrapped(None, "model_sharded_state_dict") is state
    assert torch.equal(state[0][0]["param"].data, torch.zeros(2))


@pytest.mark.parametrize(
    "dist,dp_flag,fully_flag,expected",
    [(True, False, False, True), (True, True, False, False), (False, False, False, False), (True, False, True, True)],
)
def test_fully_reshardable_is_the_default_for_the_distributed_optimizer(dist, dp_flag, fully_flag, expected):
    args = SimpleNamespace(
        use_distributed_optimizer=dist,
        dist_ckpt_optim_dp_reshardable=dp_flag,
        dist_ckpt_optim_fully_reshardable=fully_flag,
    )
    optimizer_format.default_to_reshardable(args)
    assert args.dist_ckpt_optim_fully_reshardable is expected


def test_both_format_flags_are_refused():
    args = SimpleNamespace(
        use_distributed_optimizer=True, dist_ckpt_optim_dp_reshardable=True, dist_ckpt_optim_fully_reshardable=True
    )
    with pytest.raises(ValueError, match="--dist-ckpt-optim-dp-reshardable and --dist-ckpt-optim-fully-reshardable"):
        optimizer_format.default_to_reshardable(args)


def test_each_dp_rank_reads_its_own_saved_rng_state():
    from examples.multimodal_dev.checkpoint.rng_per_rank import own_entry_first

    loaded = {"rng_state": ["rank0", "rank1", "rank2"]}
    assert own_entry_first(loaded, 1, 3) and loaded["rng_state"][0] == "rank1"
    older = {"rng_state": ["rank0"]}  # one state (megatron's own save): every rank reads it
    assert not own_entry_first(older, 1, 2) and older["rng_state"] == ["rank0"]
    other_dp = {"rng_state": ["rank0", "rank1"]}  # saved at DP=2, resumed at DP=4: rank 0's for all
    assert not own_entry_first(other_dp, 3, 4) and other_dp["rng_state"][0] == "rank0"
    assert not own_entry_first(None, 0, 2)


def test_groups_saved_by_one_optimizer_reach_every_member_of_a_chain():
    """A checkpoint of one optimizer (EP=1) loaded by a chain (EP>1): each member gets its sharded state
    and the saved groups with their expert twins; a member with no parameter on this rank (the experts'
    optimizer on the vision tower's own ranks) has no sharded state and gets the groups alone."""
    groups = [{"params": [0, 1], "wd_mult": 1.0, "is_expert_parallel": False}]
    loaded = {
        0: {"param": "dense shards"},
        "optimizer": {"param_groups": groups},
        "param_state_sharding_type": "fully_reshardable",
    }
    chain = optimizer_format._regroup(loaded, 2)
    assert sorted(chain) == [0, 1] and chain[0]["param"] == "dense shards" and "param" not in chain[1]
    for member in chain.values():
        saved = member["optimizer"]["param_groups"]
        assert [g["is_expert_parallel"] for g in saved] == [False, True]
        assert member["param_state_sharding_type"] == "fully_reshardable"
    assert optimizer_format._regroup({**loaded, 2: {}}, 2) is None  # a member the chain does not have


@pytest.mark.parametrize(
    "saved_grouped,now_grouped,sharding,refused",
    [
        (False, True, "dp_reshardable", True),  # a checkpoint of SequentialMLP, resumed on grouped experts
        (True, False, "dp_reshardable", True),
        (True, True, "dp_reshardable", False),
        (False, True, "fully_reshardable", False),  # per parameter in the model's layout: either loads it
    ],
)
def test_a_flat_optimizer_state_is_not_carried_to_the_other_expert_layout(
    tmp_path, monkeypatch, saved_grouped, now_grouped, sharding, refused
):
    from megatron.core import dist_checkpointing

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    layout = dict(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        use_distributed_optimizer=True,
    )
    stored = SimpleNamespace(**layout, moe_grouped_gemm=saved_grouped)
    args = SimpleNamespace(
        **layout, moe_grouped_gemm=now_grouped, load=str(tmp_path), finetune=False, no_load_optim=False
    )
    monkeypatch.setattr(optimizer_format, "checkpoint_directory", lambda path: path)
    monkeypatch.setattr(optimizer_format, "stored_args", lambda directory: stored)
    monkeypatch.setattr(
        dist_checkpointing, "load_content_metadata", lambda directory: {"distrib_optim_sharding_type": sharding}
    )
    if refused:
        with pytest.raises(ValueError, match=f"GROUPED_EXPERTS={int(saved_grouped)} -> {int(now_grouped)}"):
            optimizer_format.check_layout_change(args)
    else:
        optimizer_format.check_layout_change(args)


@pytest.mark.parametrize("role", ["load", "pretrained_checkpoint"])
@pytest.mark.parametrize("saved_by_fsdp", [False, True], ids=["torch_dist into FSDP", "fsdp_dtensor without FSDP"])
def test_a_checkpoint_of_the_other_format_is_refused_with_how_to_move_it(tmp_path, role, saved_by_fsdp):
    # the files each format's directory holds: torch_dist's metadata.json; DCP's own index alone for fsdp_dtensor
    iteration = tmp_path / "ckpt" / "iter_0000003"
    iteration.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp") if saved_by_fsdp else ("metadata.json", ".metadata", "__0_0.distcp"):
        (iteration / name).write_bytes(b"")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3")
    paths = {"load": str(tmp_path / "ckpt"), "pretrained_checkpoint": None}
    if role == "pretrained_checkpoint":  # CKPT_LOAD with CKPT_RESUME: the resume directory is empty yet
        paths = {"load": str(tmp_path / "resume"), "pretrained_checkpoint": str(tmp_path / "ckpt")}
    args = SimpleNamespace(**paths, use_megatron_fsdp=not saved_by_fsdp, finetune=True, no_load_optim=True)
    saved, run = ("fsdp_dtensor", "without FSDP") if saved_by_fsdp else ("torch_dist", "with FSDP=1")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'ckpt'}: saved in {saved} format, .* into a run {run}; move"):
        optimizer_format.check_layout_change(args)
    args.use_megatron_fsdp = saved_by_fsdp  # the matching run is not refused
    optimizer_format.check_layout_change(args)


@pytest.mark.parametrize("saved_grouped", [True, False])
def test_an_fsdp_checkpoint_loads_only_into_the_expert_implementation_that_saved_it(tmp_path, saved_grouped):
    from argparse import Namespace

    from torch.distributed.checkpoint import save

    iteration = tmp_path / "iter_0000002"
    save({"args": Namespace(moe_grouped_gemm=saved_grouped)}, checkpoint_id=str(iteration), no_dist=True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    args = SimpleNamespace(
        load=str(tmp_path), use_megatron_fsdp=True, num_experts=4, moe_grouped_gemm=not saved_grouped, finetune=False
    )
    with pytest.raises(ValueError, match=f"its experts were saved .*; run with GROUPED_EXPERTS={int(saved_grouped)}$"):
        optimizer_format.check_layout_change(args)
    args.moe_grouped_gemm = saved_grouped
    optimizer_format.check_layout_change(args)

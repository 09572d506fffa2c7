"""Settings the training script refuses before megatron sees them, and the one line a NaN found
during training becomes."""

from types import SimpleNamespace

import pytest

from examples.multimodal_dev.training import run_checks


def test_non_finite_numbers_typed_are_refused():
    args = SimpleNamespace(lr=float("inf"), min_lr=1e-5, weight_decay=float("nan"), clip_grad=1.0)
    with pytest.raises(ValueError, match=r"--lr inf, --weight-decay nan: not a finite number"):
        run_checks.check_finite_flags(
            args, {"lr": "--lr", "weight_decay": "--weight-decay", "clip_grad": "--clip-grad"}
        )
    run_checks.check_finite_flags(args, {"min_lr": "--min-lr"})  # the flags not typed are not ours to judge


def test_rerun_mode_stops_at_the_first_nan_unless_given():
    args = SimpleNamespace(rerun_mode="validate_results")
    run_checks.stop_at_first_nan(args, {})
    assert args.rerun_mode == "disabled"
    args = SimpleNamespace(rerun_mode="validate_results")
    run_checks.stop_at_first_nan(args, {"rerun_mode": "--rerun-mode"})
    assert args.rerun_mode == "validate_results"


def test_a_nan_gradient_is_one_line_with_the_checkpoint_that_stays(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    err = RuntimeError(
        "Rank 0, node n, device 0, iteration 7: Unexpected result tensor(inf) (message='found Inf in "
        "local grad norm for bucket #1 in backward pass before data-parallel communication collective')"
    )
    assert run_checks.one_line(err, SimpleNamespace(save=str(tmp_path))) == (
        "iteration 7: found Inf in local grad norm for bucket #1 in backward pass before data-parallel communication "
        f"collective; the run stopped before the optimizer step and saved nothing for it: the last checkpoint is "
        f"iteration 6 in {tmp_path} (lower the LR, or look for a bad batch, then resume)"
    )
    assert run_checks.one_line(RuntimeError("something else"), SimpleNamespace(save=None)) is None
    assert run_checks.one_line(ValueError("iteration 1: Unexpected result x (message='y')"), None) is None


def _run(**given):
    settings = dict(
        seq_length=1024,
        micro_batch_size=2,
        packing="samples",
        packed_seq_length=None,
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        bf16=False,
        fp16=False,
    )
    return SimpleNamespace(**{**settings, **given})


def test_a_micro_batch_that_cannot_fit_is_refused_from_its_floor():
    # tiny: hidden 128, 4 layers, vocab 8192; SEQ_LEN=1e8 took ~200 GB before megatron's allocator died
    with pytest.raises(
        ValueError,
        match=r"^--seq-length 100000000 x --micro-batch-size 2: one micro-batch needs at "
        r"least 6485\.0 GiB per rank \(logits 6103\.5 \+ saved layer inputs 381\.5\), "
        r"more than the 24\.0 GiB of this host's RAM; shorten it, or raise TP / CP / PP$",
    ):
        run_checks.check_memory_floor(_run(seq_length=10**8), 128, 4, 8192, available=(24 << 30, "this host's RAM"))
    run_checks.check_memory_floor(_run(), 128, 4, 8192, available=(24 << 30, "this host's RAM"))


def test_the_floor_follows_the_layout():
    base = run_checks.micro_batch_floor(_run(seq_length=4096, micro_batch_size=1), 4096, 32, 248320)
    assert base == {"logits": 4096 * 248320 * 4, "saved layer inputs": 4096 * 4096 * 4 * 32}
    split = run_checks.micro_batch_floor(
        _run(
            seq_length=4096,
            micro_batch_size=1,
            tensor_model_parallel_size=4,
            context_parallel_size=2,
            sequence_parallel=True,
            bf16=True,
        ),
        4096,
        32,
        248320,
    )
    assert split == {"logits": 2048 * 62080 * 2, "saved layer inputs": 512 * 4096 * 2 * 32}
    staged = run_checks.micro_batch_floor(
        _run(packing="tokens", packed_seq_length=8192, pipeline_model_parallel_size=4), 4096, 32, 248320
    )
    assert staged == {"stage floor": max(8192 * 248320 * 4, 8192 * 4096 * 4 * 8)}
    with pytest.raises(ValueError, match=r"^--packed-seq-length 8192: .* of this GPU;"):
        run_checks.check_memory_floor(
            _run(packing="tokens", packed_seq_length=8192), 4096, 32, 248320, available=(1 << 30, "this GPU")
        )


def _layout_args(**kw):
    base = dict(
        world_size=2,
        tensor_model_parallel_size=2,
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        vision_tensor_parallel_size=1,
        vision_nproc=0,
        use_distributed_optimizer=True,
        dist_ckpt_optim_dp_reshardable=False,
        calculate_per_token_loss=True,
        save=None,
        load=None,
        finetune=False,
        ckpt_format="torch_dist",
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(), None),
        (dict(vision_tensor_parallel_size=None), None),  # the language model's TP
        (
            dict(vision_tensor_parallel_size=3),
            r"--vision-tensor-parallel-size 3 does not divide the 16 vision attention",
        ),
        (
            dict(tensor_model_parallel_size=1, world_size=1, vision_tensor_parallel_size=2),
            r"--vision-tensor-parallel-size 2 does not divide --tensor-model-parallel-size 1",
        ),
        (dict(world_size=3, vision_nproc=1), None),  # the tower on rank 0, the language model on 1-2
        (dict(world_size=3, vision_nproc=1, load="ckpt", finetune=True), None),  # a checkpoint's weights
        (dict(world_size=4, vision_nproc=2), None),  # fan-in: two vision replicas serve the one language replica
        (dict(world_size=5, vision_nproc=1), None),  # fan-out: one vision replica serves the two language replicas
        (
            dict(world_size=5, vision_nproc=2, tensor_model_parallel_size=1),
            r"--vision-nproc 2 / --vision-tensor-parallel-size 1 = 2 vision data-parallel ranks and 3 language .*: "
            r"one must "
            r"divide the other",
        ),
        (
            dict(world_size=3, vision_nproc=1, use_distributed_optimizer=False),
            r"--vision-nproc 1 needs --use-distributed",
        ),
        (dict(world_size=3, vision_nproc=1, calculate_per_token_loss=False), r"needs --calculate-per-token-loss"),
        (dict(world_size=3, vision_nproc=1, save="out", load="out"), None),  # saves and resumes
        (
            dict(world_size=3, vision_nproc=1, save="out", ckpt_format="torch"),
            r"^--ckpt-format torch with --vision-nproc 1: only torch_dist checkpoints",
        ),
        (
            dict(world_size=2, vision_nproc=1, tensor_model_parallel_size=1, dist_ckpt_optim_dp_reshardable=True),
            r"^--dist-ckpt-optim-dp-reshardable with --vision-nproc 1: that format",
        ),
        (
            dict(dist_ckpt_optim_dp_reshardable=True),
            r"--dist-ckpt-optim-dp-reshardable with --vision-tensor-parallel-size 1",
        ),
        (dict(dist_ckpt_optim_dp_reshardable=True, vision_tensor_parallel_size=2), None),  # the ordinary layout
        (
            dict(world_size=1, vision_nproc=1, tensor_model_parallel_size=1, vision_tensor_parallel_size=None),
            r"^--vision-nproc 1: of the 1 ranks it must leave at least one to the language model",
        ),
        (dict(world_size=2, vision_nproc=-1), r"^--vision-nproc -1: of the 2 ranks"),
    ],
)
def test_the_vision_layout_is_checked_by_flag(changes, message):
    args = _layout_args(**changes)
    if message is None:
        run_checks.check_vision_layout(args, vision_heads=16)
    else:
        with pytest.raises(ValueError, match=message):
            run_checks.check_vision_layout(args, vision_heads=16)


@pytest.mark.parametrize(
    "changes,vtp",
    [
        (dict(world_size=3, vision_nproc=1), 1),  # one vision replica for the one language replica at TP=2
        (dict(world_size=4, vision_nproc=2, tensor_model_parallel_size=2), 2),
        (dict(world_size=6, vision_nproc=2, tensor_model_parallel_size=2), 1),  # two language replicas, two vision ones
        (dict(world_size=5, vision_nproc=1), 1),  # one vision rank for two language replicas: a whole tower, fan-out
    ],
)
def test_an_unset_vision_tp_on_ranks_of_its_own_gives_a_vision_replica_a_language_one(changes, vtp):
    args = _layout_args(**changes, vision_tensor_parallel_size=None)
    run_checks.check_vision_layout(args, vision_heads=16)
    assert args.vision_tensor_parallel_size == vtp


def test_an_unset_vision_tp_that_cannot_pair_the_replicas_is_refused_by_name():
    # 2 vision ranks, 3 language replicas: neither DP divides the other at any VISION_TP
    args = _layout_args(world_size=5, vision_nproc=2, tensor_model_parallel_size=1, vision_tensor_parallel_size=None)
    with pytest.raises(
        ValueError,
        match=r"^--vision-nproc 2 / --vision-tensor-parallel-size 1 = 2 vision data-parallel "
        r"ranks and 3 language",
    ):
        run_checks.check_vision_layout(args, vision_heads=16)


def test_megatron_is_handed_the_vision_tp_default_it_prints():
    given = _layout_args(world_size=5, vision_nproc=1, vision_tensor_parallel_size=None)
    assert run_checks.vision_defaults(given, 5) == {"vision_tensor_parallel_size": 1}
    assert run_checks.vision_defaults(_layout_args(vision_tensor_parallel_size=None), 2) == {}  # colocated: TP
    assert (
        run_checks.vision_defaults(_layout_args(world_size=5, vision_nproc=1, vision_tensor_parallel_size=2), 5) == {}
    )


def _fsdp_args(**changes):
    """A Megatron-FSDP run's args (the ordinary layout's, saving, MoE with grouped experts) with ``changes``."""
    fsdp = dict(use_megatron_fsdp=True, ckpt_format="fsdp_dtensor", save="ckpt", expert_model_parallel_size=1)
    extra = dict(lora_rank=0, vision_chunk_patches=0, gen_eval_interval=0, moe_grouped_gemm=True)
    return _layout_args(**{**fsdp, **extra, **changes})


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(), None),
        (dict(use_megatron_fsdp=False, ckpt_format="torch_dist", pipeline_model_parallel_size=2), None),
        (dict(ckpt_format="torch_dist"), r"^--use-megatron-fsdp with --ckpt-format torch_dist: it saves fsdp_dtensor"),
        (dict(vision_chunk_patches=256), r"^--use-megatron-fsdp with --vision-chunk-patches 256: the tower's layers"),
        (dict(gen_eval_interval=5), r"^--use-megatron-fsdp with --gen-eval-interval 5: decoding reads"),
    ],
)
def test_what_megatron_fsdp_does_not_run_with_is_refused_by_flag(changes, message):
    args = _fsdp_args(**changes)
    if message is None:
        run_checks.check_fsdp(args)
    else:
        with pytest.raises(ValueError, match=message):
            run_checks.check_fsdp(args)


def test_resuming_a_finished_run_is_one_line(tmp_path):
    from examples.multimodal_dev.checkpoint.files import TRACKER

    (tmp_path / TRACKER).write_text("4")
    run = dict(load=str(tmp_path), finetune=False, train_iters=4)
    with pytest.raises(ValueError) as refused:
        run_checks.check_finished_run(SimpleNamespace(**run))
    assert str(refused.value).startswith("iteration 4 = --train-iters 4 (TRAIN_ITERS)")
    assert str(refused.value).endswith("nothing to train; raise TRAIN_ITERS to continue")
    run_checks.check_finished_run(SimpleNamespace(**{**run, "train_iters": 5}))  # one more to train
    run_checks.check_finished_run(SimpleNamespace(**{**run, "finetune": True}))  # its weights, from iteration 0

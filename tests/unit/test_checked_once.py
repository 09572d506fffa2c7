"""One set of checks: the training script rebuilds the launcher's ``RunConfig`` from its flags
(``launcher/from_args.py``) and runs ``launcher/checks.py`` on it, so a run started with torchrun
directly meets every check the run script makes, in the same words, with the flags named."""

from __future__ import annotations

import pytest

from examples.multimodal_dev.checked_args import check_as_launched
from examples.multimodal_dev.launcher import launch
from examples.multimodal_dev.launcher.from_env import Host
from examples.multimodal_dev.launcher.run_config import LaunchError
from examples.multimodal_dev.models import DEFAULT_ARCH, get_model_entry
from examples.multimodal_dev.models.common.config_from_args import given_flags, megatron_parser


def _trainer_says(argv: list[str], world: int, monkeypatch) -> str | None:
    """What the training script refuses ``argv`` with on ``world`` ranks of one node (no GPU)."""
    import torch

    from examples.multimodal_dev.arguments import add_multimodal_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the verdict is the CPU host's anywhere
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    parser = megatron_parser(add_multimodal_args)
    argv = ["--model-arch", DEFAULT_ARCH, "--micro-batch-size", "2", "--global-batch-size", "4", *argv]
    args = parser.parse_args(argv)
    moe = args.variant_moe == "on"
    shape = get_model_entry(DEFAULT_ARCH).shape_fn(args.model_variant, **({"moe": True} if moe else {}))
    try:
        check_as_launched(args, shape, given_flags(parser, argv))
    except ValueError as err:
        return str(err)
    return None


def _launcher_says(environ: dict[str, str]) -> str:
    with pytest.raises(LaunchError) as err:
        launch.prepare(environ, [], Host(False), launch.Launch())
    return str(err.value)


@pytest.mark.parametrize(
    "environ,argv,world,flags",
    [
        (
            dict(LR_WARMUP_ITERS="30"),
            ["--lr-warmup-iters", "30", "--train-iters", "30"],
            1,
            "LR_WARMUP_ITERS: --lr-warmup-iters, TRAIN_ITERS: --train-iters",
        ),
        (
            dict(CP="2", SEQ_LEN="334"),
            ["--context-parallel-size", "2", "--seq-length", "334"],
            2,
            "SEQ_LEN: --seq-length, CP: --context-parallel-size",
        ),
        (dict(PP="3", NPROC="3"), ["--pipeline-model-parallel-size", "3"], 3, "PP: --pipeline-model-parallel-size"),
        (dict(TP="3", NPROC="3"), ["--tensor-model-parallel-size", "3"], 3, "TP: --tensor-model-parallel-size"),
        (
            dict(DATA_PATH="/d.jsonl"),
            ["--data-path", "/d.jsonl"],
            1,
            "DATA_PATH: --data-path, DATASET: --dataset-provider",
        ),
        (dict(LORA_TARGETS="in_proj"), ["--lora-targets", "in_proj"], 1, "LORA_TARGETS: --lora-targets"),
        (
            dict(TRANSFORMER_IMPL="transformer_engine"),
            ["--transformer-impl", "transformer_engine"],
            1,
            "TRANSFORMER_IMPL: --transformer-impl",
        ),
        (
            dict(FSDP="1", PP="2", NPROC="2"),
            ["--use-megatron-fsdp", "--pipeline-model-parallel-size", "2", "--ckpt-format", "fsdp_dtensor"],
            2,
            "FSDP: --use-megatron-fsdp, PP: --pipeline-model-parallel-size",
        ),
        (dict(MBS="2", GBS="6", NPROC="2"), ["--global-batch-size", "6"], 2, "GBS: --global-batch-size"),
        (dict(MOE="1", TP="2", SP="0", NPROC="2"), ["--variant-moe", "on", "--tensor-model-parallel-size", "2"], 2, ""),
    ],
    ids=["schedule", "cp chunks", "pipeline split", "heads", "mock path", "lora", "te on cpu", "fsdp", "batch", "sp"],
)
def test_the_trainer_refuses_what_the_launcher_refuses_in_its_words(monkeypatch, environ, argv, world, flags):
    """The launcher's line, then how the trainer's command line spells each variable it names."""
    said = _launcher_says({"MODEL_VARIANT": "tiny", **environ})
    line = _trainer_says(argv, world, monkeypatch)
    assert line is not None and line.startswith(said + " ("), (said, line)
    assert flags in line, line


def test_a_run_the_launcher_writes_passes_the_trainers_checks(monkeypatch):
    """Every flag the run script writes for a run it accepts is accepted again, layouts included."""
    for environ, world in (({}, 1), (dict(MOE="1", EP="2", NPROC="2"), 2), (dict(PP="2", VP="2"), 2)):
        argv = launch.prepare({"DRY_RUN": "1", **environ}, [], Host(False), launch.Launch()).torchrun
        script = argv[argv.index("--module") + 2 :]
        assert _trainer_says(script, world, monkeypatch) is None, (environ, script)


def test_a_malformed_value_names_its_variable_and_flag(monkeypatch):
    line = _trainer_says(["--transformer-impl", "inference_optimized"], 1, monkeypatch)
    assert line == (
        "TRANSFORMER_IMPL=inference_optimized: expected transformer_engine or local "
        "(TRANSFORMER_IMPL: --transformer-impl)"
    )

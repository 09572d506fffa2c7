"""What ``run_qwen35_vl.sh`` prints for a set of settings (every variant on a CPU and a GPU host, the
planner's layouts, each family of variables, and refusals), held equal to ``dry_run_golden.txt``.

The file was written before the launcher became one typed run configuration, and that change had to
leave every line of it as it was. A change that means to alter what users see rewrites the file
(``UPDATE_GOLDEN=1``) and shows the difference in its commit.

The launcher runs in this process with the host's GPU and Transformer Engine given, so the verdict
does not depend on the host that runs the test."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS, get_variant, to_hf_config_dict
from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dry_run_golden.txt")
TMP = "<tmp>"  # the test's temporary folder, as the file writes it
RUN = subprocess.run


def _layout_env(variant: str) -> dict:
    tp, pp, vp, cp, ep, etp, first, last, _ = LAYOUTS[variant]
    env = dict(MODEL_VARIANT=variant, TP=tp, PP=pp, CP=cp, EP=ep, ETP=etp, PP_FIRST=first, PP_LAST=last)
    # the fewest processes that hold the layout: TP*CP*PP divides them, and EP*ETP divides them per stage
    return {**env, "NPROC": math.lcm(tp * cp * pp, pp * ep * etp)} | ({"VP": vp} if vp else {})


JSONL = dict(DATASET="jsonl", DATA_PATH="/data/train.jsonl", HF_PROCESSOR_PATH="/processor")
# (name, environment, extra flags, GPU host): TMP in a value is the test's folder
CASES = [
    *((f"{v} cpu", dict(MODEL_VARIANT=v), [], False) for v in VARIANTS),
    *((f"{v} gpu", dict(MODEL_VARIANT=v), [], True) for v in VARIANTS),
    ("unset variant cpu", {}, [], False),
    ("unset variant gpu", {}, [], True),
    *((f"{v} planned layout", _layout_env(v), [], True) for v in LAYOUTS),
    ("9b on 64 GPUs", dict(MODEL_VARIANT="9b", GPUS=64), [], True),
    ("tiny moe ep2", dict(MOE=1, EP=2, NPROC=2, TP=1), ["--seed", "7"], False),
    ("tiny moe tp2 ep2", dict(MOE=1, TP=2, EP=2, ETP=1, NPROC=2), [], False),
    ("tiny moe sequential", dict(MOE=1, GROUPED_EXPERTS=0), [], False),
    ("35b ep2 gpu", dict(MODEL_VARIANT="35b_a3b", EP=2, NPROC=2), [], True),
    ("tiny pp2 vp2", dict(PP=2, VP=2), [], False),
    ("tiny pp2 first1", dict(PP=2, PP_FIRST=1), [], False),
    ("tiny cp2 tp2", dict(CP=2, TP=2, SEQ_LEN=512), [], False),
    ("tiny sp", dict(TP=2, SP=1), [], False),
    ("vision own ranks", dict(TP=2, VISION_TP=1, VISION_NPROC=1), [], False),
    ("vision default own", dict(TP=2, VISION_NPROC=1), [], False),
    ("vision on language ranks", dict(TP=2, VISION_TP=1), [], False),
    ("tokens packing", dict(PACKING="tokens", SEQ_LEN=512, PACKED_SEQ_LENGTH=1024), [], False),
    ("padded", dict(PACKED=0, MTP=1), [], False),
    (
        "batch and schedule",
        dict(TRAIN_ITERS=50, MBS=1, GBS=8, LR="3e-4", LR_WARMUP_ITERS=2, LR_DECAY_ITERS=40),
        [],
        False,
    ),
    ("lora", dict(LORA_RANK=8, LORA_ALPHA=16, LORA_TARGETS="in_proj,out_proj"), [], False),
    ("lora moe", dict(MOE=1, LORA_RANK=4), [], False),
    ("lora moe no experts", dict(MOE=1, LORA_RANK=4, LORA_TARGETS="in_proj,linear_qkv"), [], False),
    (
        "jsonl with every own-data variable",
        dict(
            JSONL,
            VALID_DATA_PATH="/data/valid.jsonl",
            MEDIA_ROOT="/media",
            STRICT_DATA=1,
            REMOTE_MEDIA=1,
            MEDIA_ANYWHERE=1,
            VIDEO_FPS="1.5",
            VIDEO_MAX_FRAMES=64,
            VIDEO_MAX_PIXELS=50176,
        ),
        [],
        False,
    ),
    ("jsonl fraction", dict(JSONL, VALID_FRACTION="0.02"), [], False),
    ("energon", dict(JSONL, DATASET="energon", STRICT_DATA=1), [], False),
    ("cord_v2", dict(JSONL, DATASET="cord_v2"), [], False),
    ("mock_mix", dict(DATASET="mock_mix"), [], False),
    ("checkpoints", dict(CKPT_SAVE="/ckpt/save", SAVE_INTERVAL=5, CKPT_LOAD="/ckpt/start"), [], False),
    ("resume fresh", dict(CKPT_LOAD="/ckpt/start", CKPT_RESUME=f"{TMP}/run"), [], False),
    ("resume saved", dict(CKPT_RESUME=TMP), [], False),
    ("resume saved new schedule", dict(CKPT_RESUME=TMP, LR_WARMUP_ITERS=3), [], False),
    ("import shape", dict(CKPT_LOAD=f"{TMP}/import"), [], False),
    ("hf config", dict(HF_CONFIG=f"{TMP}/import/hf_config.json", MTP=0), [], False),
    ("master port", dict(MASTER_PORT=29123), [], False),
    ("te on gpu", dict(MODEL_VARIANT="9b", TRANSFORMER_IMPL="transformer_engine"), [], True),
    ("alltoall gpu", dict(MODEL_VARIANT="35b_a3b", MOE_DISPATCHER="alltoall"), [], True),
    ("refused flag", {}, ["--tensor-model-parallel-size", "2"], False),
    ("refused tp", dict(TP=3), [], False),
    ("refused gbs", dict(VISION_NPROC=1, NPROC=3, GBS=2), [], False),
    ("refused gpus", dict(MODEL_VARIANT="9b", GPUS=12), [], True),
    ("refused te", dict(TRANSFORMER_IMPL="transformer_engine"), [], False),
    ("refused limit", dict(TRAIN_ITERS=2**50, GBS=2**10, SEQ_LEN=2**10), [], False),
    ("refused schedule", dict(LR_WARMUP_ITERS=30), [], False),
    ("refused pp", dict(PP=3), [], False),
    ("refused vision", dict(VISION_NPROC=3, NPROC=5), [], False),
]


def _folder(tmp: str) -> None:
    """The checkpoints the cases name: a saved run, and an import that carries its model shape."""
    with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    os.makedirs(os.path.join(tmp, "import"))
    with open(os.path.join(tmp, "import", "hf_config.json"), "w") as f:
        json.dump(to_hf_config_dict(get_variant("tiny")), f)


_PLANNED: dict[tuple, subprocess.CompletedProcess] = {}


def _planner_once(command, **kwargs):
    """The layout planner's answer to one question, asked once (its search takes seconds); a
    command that is not the planner runs as it would."""
    if "examples.multimodal_dev.tools.plan_layout" not in command:
        return RUN(command, **kwargs)
    key = (tuple(command), tuple(sorted(kwargs.items())))
    if key not in _PLANNED:
        _PLANNED[key] = RUN(command, **kwargs)
    return _PLANNED[key]


def dry_run(monkeypatch, capsys, environ: dict, argv: list[str], gpu: bool, tmp: str) -> str:
    """What the run script prints for these settings, with its exit status; the host is ``gpu``,
    with Transformer Engine on a GPU host."""
    from examples.multimodal_dev.launcher import launch

    env = {"DRY_RUN": "1", **{k: str(v).replace(TMP, tmp) for k, v in environ.items()}}
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(launch, "has_gpu", lambda: gpu)
    monkeypatch.setattr(launch, "te_imports", lambda: gpu)
    monkeypatch.setattr(subprocess, "run", _planner_once)
    try:
        launch.main(list(argv))
        status = 0
    except SystemExit as stop:
        status = stop.code
    monkeypatch.undo()
    out, err = capsys.readouterr()
    lines = [*out.splitlines(), *(f"stderr: {line}" for line in err.splitlines()), f"exit {status}"]
    return "\n".join(lines).replace(tmp, TMP)


def _golden() -> dict[str, str]:
    if not os.path.exists(GOLDEN):
        return {}
    with open(GOLDEN) as f:
        sections = f.read().split("\n## ")[1:]
    return dict(section.rstrip("\n").split("\n", 1) for section in sections)


def test_dry_run_output_is_unchanged(monkeypatch, capsys, tmp_path):
    _folder(str(tmp_path))
    seen = {name: dry_run(monkeypatch, capsys, env, argv, gpu, str(tmp_path)) for name, env, argv, gpu in CASES}
    assert len(seen) == len(CASES), "two cases share a name"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        with open(GOLDEN, "w") as f:
            f.write("# run_qwen35_vl.sh DRY_RUN=1 output (tests/unit/test_dry_run_golden.py)\n")
            f.write("".join(f"\n## {name}\n{text}\n" for name, text in seen.items()))
        pytest.skip("rewrote dry_run_golden.txt")
    golden = _golden()
    assert list(golden) == list(seen), "the cases differ from the file's (UPDATE_GOLDEN=1 rewrites it)"
    for name, text in seen.items():
        assert text == golden[name], f"{name}:\n{text}\n--- was ---\n{golden[name]}"


# The variables users set, frozen as a command line's options are: a new one is a new promise to every
# user (a README row, a check, a flag it becomes), so adding one changes this list in the same commit.
FROZEN_VARIABLES = """
MODEL_VARIANT TP CP EP PP ETP VP PP_FIRST PP_LAST SP FSDP NPROC NNODES NODE_RANK MASTER_ADDR DATASET TRAIN_ITERS
MBS GBS SEQ_LEN LR PACKED PACKING PACKED_SEQ_LENGTH MOE MTP CKPT_LOAD HF_CONFIG CKPT_SAVE SAVE_INTERVAL
CKPT_RESUME DRY_RUN GPUS VISION_TP VISION_NPROC LR_WARMUP_ITERS LR_DECAY_ITERS DATA_PATH HF_PROCESSOR_PATH
VALID_DATA_PATH VALID_FRACTION MEDIA_ROOT MEDIA_ANYWHERE REMOTE_MEDIA STRICT_DATA VIDEO_FPS VIDEO_MAX_FRAMES
VIDEO_MAX_PIXELS LORA_RANK LORA_ALPHA LORA_TARGETS LORA_BASE GROUPED_EXPERTS MOE_DISPATCHER TRANSFORMER_IMPL MASTER_PORT
JOIN_TIMEOUT COLLECTIVE_TIMEOUT
FORK_RANKS UNCHECKED_VARIABLES
TRAIN_MODE DPO_BETA GRPO_SAMPLES GRPO_MAX_NEW_TOKENS GRPO_REWARD GRPO_KL_WEIGHT GRPO_CLIP
""".split()


def test_no_new_variables():
    from examples.multimodal_dev.launcher.variables import NAMES

    table = sorted(NAMES)
    assert table == sorted(FROZEN_VARIABLES), (
        f"added: {sorted(set(table) - set(FROZEN_VARIABLES))}, removed: {sorted(set(FROZEN_VARIABLES) - set(table))}"
    )

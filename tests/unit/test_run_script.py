"""``run_qwen35_vl.sh`` (``launcher/launch.py`` behind it): DRY_RUN prints, for every variant, model
flags equal to the variant table
(and ``check_model_flags`` accepts them); impossible settings fail naming the variable."""

import os
import re
import shlex
import subprocess

import pytest
from launch import on_warm_engine

from examples.multimodal_dev.arguments import add_multimodal_args
from examples.multimodal_dev.checkpoint.run_shape import declared_shape
from examples.multimodal_dev.launcher import from_env, launch, run_config
from examples.multimodal_dev.launcher import variables as run_variables
from examples.multimodal_dev.launcher.from_env import Host
from examples.multimodal_dev.models.common.config_from_args import given_flags, megatron_parser
from examples.multimodal_dev.models.megatron_args import apply_model_shape, check_model_flags
from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS, get_variant

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(*flags, **env):
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "DRY_RUN": "1", **{k: str(v) for k, v in env.items()}},
    )
    return proc.returncode, proc.stdout, proc.stderr


def _flags(command: str) -> dict:
    words = shlex.split(command.strip().splitlines()[-1])
    out, i = {}, 0
    while i < len(words):
        if words[i].startswith("--"):
            has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            out[words[i][2:].replace("-", "_")] = words[i + 1] if has_value else True
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def _as_the_training_script_reads(argv: list[str]):
    """``argv`` parsed once, the model flags it does not give taken from the shape it names (checked_args)."""
    parser = megatron_parser(add_multimodal_args)
    args = parser.parse_args(argv)
    apply_model_shape(args, declared_shape(args)[0], given_flags(parser, argv))
    return args


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_dry_run_command_gives_megatron_the_variants_numbers(variant):
    """The command names the model; the training script (``apply_model_shape`` after its one parse)
    gives megatron's model flags the variant's numbers, and ``check_model_flags`` accepts them."""
    rc, out, err = _script(MODEL_VARIANT=variant)
    assert rc == 0, err
    words = shlex.split(out.strip().splitlines()[-1])
    argv = words[words.index("examples.multimodal_dev.pretrain_multimodal") + 1 :]
    assert not {"--num-layers", "--hidden-size", "--num-experts", "--vocab-size"} & set(argv)  # said once: the table
    args = _as_the_training_script_reads(argv)
    shape, source = declared_shape(args)
    text = get_variant(variant).text
    assert shape == get_variant(variant) and args.model_variant == variant
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        text.num_layers,
        text.hidden_size,
        text.num_attention_heads,
    )
    assert (args.num_query_groups, args.kv_channels, args.vocab_size) == (
        text.num_kv_heads,
        text.head_dim,
        text.vocab_size,
    )
    assert args.group_query_attention and args.max_position_embeddings == args.seq_length
    if text.is_moe:
        assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (
            text.num_experts,
            text.moe_top_k,
            text.moe_ffn_hidden_size,
        )
    else:
        assert args.num_experts is None and args.ffn_hidden_size == text.ffn_hidden_size
    check_model_flags(args, shape, source)
    given = _as_the_training_script_reads(argv + ["--num-layers", str(text.num_layers + 1)])
    with pytest.raises(ValueError, match=f"--num-layers {text.num_layers + 1} \\(the variant '{variant}' has "):
        check_model_flags(given, shape, source)  # a flag given wins over the default, and must agree


def test_model_flag_mismatch_is_named():
    class Args:
        num_layers, hidden_size, num_attention_heads = 5, 128, 4

    with pytest.raises(ValueError, match=r"--num-layers 5 \(the variant 'tiny' has 4\)"):
        check_model_flags(Args(), get_variant("tiny"), "variant 'tiny'")


# The user's-data variables and the flags they become (run_qwen35_vl.sh, OWN_DATA)
OWN_DATA_FLAGS = {
    "VALID_DATA_PATH": ("/data/valid.jsonl", "eval_data_path", "/data/valid.jsonl"),
    "VALID_FRACTION": ("0.02", "valid_fraction", "0.02"),
    "MEDIA_ROOT": ("/media", "media_root", "/media"),
    "STRICT_DATA": ("1", "strict_data", True),
    "REMOTE_MEDIA": ("1", "allow_remote_media", True),
    "MEDIA_ANYWHERE": ("1", "allow_media_anywhere", True),
    "VIDEO_FPS": ("1.5", "video_fps", "1.5"),
    "VIDEO_MAX_FRAMES": ("64", "video_max_frames", "64"),
    "VIDEO_MAX_PIXELS": ("50176", "video_max_pixels", "50176"),
}


@pytest.mark.parametrize("variable", list(OWN_DATA_FLAGS))
def test_each_own_data_variable_reaches_its_flag(variable):
    value, flag, expected = OWN_DATA_FLAGS[variable]
    jsonl = dict(DATASET="jsonl", DATA_PATH="/data/train.jsonl", HF_PROCESSOR_PATH="/processor")
    rc, out, err = _script(**jsonl, **{variable: value})
    assert rc == 0, err
    flags = _flags(out)
    assert flags.get(flag) == expected, (variable, flags.get(flag))
    assert not {f for _, f, _ in OWN_DATA_FLAGS.values() if f != flag} & set(flags)  # and no other
    if expected is True:  # a switch: 0 leaves it out
        rc, out, err = _script(**jsonl, **{variable: "0"})
        assert rc == 0 and flag not in _flags(out), err


def test_lora_variables_reach_their_flags_on_the_local_backend():
    """One variable turns LoRA on; the other two reach their flags when it does (without it they would
    be ignored, so they are refused), and the backend is megatron-core's local linears unless
    TRANSFORMER_IMPL says otherwise."""
    rc, out, err = _script(LORA_RANK="8", LORA_ALPHA="16", LORA_TARGETS="in_proj,out_proj")
    assert rc == 0, err
    flags = _flags(out)
    assert (flags["lora_rank"], flags["lora_alpha"], flags["lora_targets"]) == ("8", "16", "in_proj,out_proj")
    assert flags["transformer_impl"] == "local"
    rc, out, err = _script(LORA_ALPHA="16", LORA_TARGETS="in_proj")
    assert rc == 2 and "LORA_ALPHA=16 without LORA_RANK" in err, (rc, err)


# Read by the process the launch starts (launcher/torchrun.py)
def test_the_readme_variable_table_is_the_launchers_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert run_variables.markdown() in f.read(), "README.md's variable table differs from launcher/variables.py"


@pytest.mark.parametrize(
    "env,gpu,grouped,dispatcher",
    [
        (dict(MOE="1"), False, True, "allgather"),
        (dict(MOE="1", GROUPED_EXPERTS="0"), False, False, "allgather"),
        (dict(MOE="1", LORA_RANK="4"), False, True, "allgather"),  # adapters on the grouped experts (lora/grouped.py)
        (dict(MOE="1", LORA_RANK="4", LORA_TARGETS="in_proj,linear_qkv"), False, True, "allgather"),
        (dict(MODEL_VARIANT="35b_a3b"), True, True, "allgather"),  # EP=1: no all-to-all for nothing
        (dict(MODEL_VARIANT="35b_a3b", EP="2", NPROC="2"), True, True, "alltoall"),
        (dict(MODEL_VARIANT="9b"), True, None, None),  # dense: no MoE flags at all
    ],
)
def test_moe_experts_and_dispatcher_fit_the_layout(env, gpu, grouped, dispatcher):
    plan = launch.prepare({"TRANSFORMER_IMPL": "local", **env}, [], Host(gpu), launch.Launch())
    args = plan.torchrun
    if grouped is None:
        assert "--moe-grouped-gemm" not in args and "--moe-token-dispatcher-type" not in args
        return
    assert ("--moe-grouped-gemm" in args) == grouped
    assert args[args.index("--moe-token-dispatcher-type") + 1] == dispatcher
    said = [line for line in plan.said if line.startswith("MoE: ")]
    assert len(said) == 1 and f"{dispatcher} token dispatcher" in said[0], plan.said


def test_lora_on_te_experts_runs_them_as_sequential_mlp():
    """TE's grouped experts take no adapters: with LoRA on the experts, TRANSFORMER_IMPL=transformer_engine
    defaults to SequentialMLP, whose TE linears do; the local backend keeps the grouped experts."""
    from examples.multimodal_dev.launcher.from_env import from_env

    env = dict(MODEL_VARIANT="tiny", MOE="1", LORA_RANK="4")
    for impl, grouped in (("transformer_engine", False), ("local", True)):
        config, _, _ = from_env({**env, "TRANSFORMER_IMPL": impl}, Host(True), [])
        assert config.backend.grouped_experts is grouped, impl


ADDED = """
    beta2_var: float = variable(
        "ADAM_BETA2", 0.95, parse=p.positive_number("0.95"), doc=("0.95", "AdamW's beta2"), flag="--adam-beta2-x"
    )
"""
PROBE = """
import json, sys
from examples.multimodal_dev.launcher import launch, variables
from examples.multimodal_dev.launcher.from_env import Host
from examples.multimodal_dev.launcher.run_config import LaunchError
out = {"table": variables.markdown(), "refused": launch.VARIABLE_OF_FLAG.get("--adam-beta2-x")}
out["argv"] = launch.prepare({"ADAM_BETA2": "0.9", "DRY_RUN": "1"}, [], Host(False), launch.Launch()).torchrun
for environ in ({"ADAM_BETA2": "x"}, {"ADAM_BETA": "0.9"}):
    try:
        launch.prepare(environ, [], Host(False), launch.Launch())
    except LaunchError as err:
        out.setdefault("errors", []).append(str(err))
print(json.dumps(out))
"""


def test_a_setting_declared_in_one_place_is_in_the_table_the_flags_and_the_refusals(tmp_path):
    """One field added to a copy of ``run_config.py`` (nothing else edited): README's row, the parse that
    names the variable, megatron's flag, the extra flag refused, and its near misses refused."""
    import json
    import shutil
    import subprocess
    import sys

    package = tmp_path / "examples" / "multimodal_dev"
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    declarations = package / "launcher" / "run_config.py"
    text = declarations.read_text()
    anchor = "    min_lr_ratio: float = 0.1\n"
    declarations.write_text(text.replace(anchor, ADDED.lstrip("\n") + anchor, 1))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert "| `ADAM_BETA2` | 0.95 | AdamW's beta2 |" in out["table"]
    assert out["refused"] == "ADAM_BETA2"
    assert out["argv"][-2:] == ["--adam-beta2-x", "0.9"], out["argv"]
    assert out["errors"] == [
        "ADAM_BETA2=x: expected a positive number such as 0.95",
        "ADAM_BETA is not a variable of the script's: did you mean ADAM_BETA2? (a variable of your own that "
        "looks like one: UNCHECKED_VARIABLES=ADAM_BETA)",
    ]


def test_the_launch_reads_the_environment_through_the_table_only():
    env = from_env.Environment({"TP": "2", "NOT_A_VARIABLE": "1"})
    assert env.get("TP") == "2"
    with pytest.raises(AssertionError, match="NOT_A_VARIABLE is not in variables.py's table"):
        env.get("NOT_A_VARIABLE")


def _video(**env) -> dict:
    """A JSONL run's settings (VIDEO_* apply to it), with ``env``."""
    return dict(DATASET="jsonl", DATA_PATH="x", HF_PROCESSOR_PATH="p", **env)


def test_the_video_limits_are_those_of_a_records_own_keys():
    from examples.multimodal_dev.data.video import OVERRIDE_LIMITS

    limits = {names[0]: limit for names, limit, _ in run_variables.LIMITS}
    assert limits["VIDEO_FPS"] == OVERRIDE_LIMITS["fps"]
    assert limits["VIDEO_MAX_FRAMES"] == OVERRIDE_LIMITS["max_frames"]
    assert limits["VIDEO_MAX_PIXELS"] == OVERRIDE_LIMITS["max_pixels"]


@pytest.mark.parametrize(
    "env,message",
    [
        (dict(EP=2), "EP=2 needs an MoE variant"),
        (dict(MODEL_VARIANT="35b_a3b", EP=3, NPROC=3), "EP=3 does not divide the 256 experts"),
        (dict(TP=3), "TP=3 does not divide the 4 attention heads"),
        (dict(TP=2, CP=4, MODEL_VARIANT="tiny"), "CP=4 does not divide the per-TP-rank Gated DeltaNet heads"),
        (dict(SP=1), "SP=1 needs TP>1"),
        (dict(TP=2, MOE=1, SP=0), "SP=0 with TP=2: megatron-core requires sequence parallelism for MoE"),
        (dict(TP=2, NPROC=3), "NPROC=3 is not divisible by TP\\*CP\\*PP=2"),
        (dict(MODEL_VARIANT="nope"), "MODEL_VARIANT=nope: unknown --model-variant .nope.; valid: 0.8b"),
        (dict(DATASET="cord_v2"), "DATASET=cord_v2 needs DATA_PATH"),
        (dict(DATASET="webvid"), "DATASET=webvid must be mock, mock_mix, mock_video, cord_v2, jsonl or energon"),
        (dict(LORA_RANK="-4"), "LORA_RANK=-4 must be 0 \\(off\\) or a positive rank"),
        (dict(LORA_ALPHA=8), "LORA_ALPHA=8 without LORA_RANK: there are no adapters \\(set LORA_RANK\\)"),
        (dict(LORA_TARGETS="in_proj"), "LORA_TARGETS=in_proj without LORA_RANK: there are no adapters"),
        (dict(LORA_BASE="/base"), "LORA_BASE=/base without LORA_RANK: there are no adapters"),
        (dict(DATA_PATH="/d.jsonl"), "DATA_PATH=/d.jsonl with DATASET=mock: the mock data reads no files"),
        (dict(DATASET="mock_mix", HF_PROCESSOR_PATH="/p"), "HF_PROCESSOR_PATH=/p with DATASET=mock_mix"),
        (dict(TRAIN_ITER=7), "TRAIN_ITER is not a variable of the script's: did you mean TRAIN_ITERS\\? \\(a var"),
        (dict(train_iters=7), "train_iters is not a variable of the script's: did you mean TRAIN_ITERS"),
        (dict(LORA_RANKS=4), "LORA_RANKS is not a variable of the script's: did you mean LORA_RANK\\?"),
        (dict(CKPT_SAVED="/s"), "CKPT_SAVED is not a variable of the script's: did you mean CKPT_SAVE\\?"),
        (dict(FSPD=1), "FSPD is not a variable .* did you mean FSDP\\? .*UNCHECKED_VARIABLES=FSPD\\)$"),
        (dict(FSPD=1, UNCHECKED_VARIABLES="X,FSPD", TRAIN_ITER=1), "TRAIN_ITER is not a variable"),
        (dict(DATASET="jsonl"), "DATASET=jsonl needs DATA_PATH"),
        (dict(STRICT_DATA="1"), "apply to DATASET=jsonl \\(and energon\\) only \\(DATASET=mock\\)"),
        (
            dict(DATASET="jsonl", DATA_PATH="x", HF_PROCESSOR_PATH="p", VALID_FRACTION="1.5"),
            "VALID_FRACTION=1.5: expected a fraction below 1",
        ),
        (dict(MBS=0), "MBS=0 must be a positive integer"),
        (dict(TP="abc"), "TP=abc must be a positive integer"),
        (dict(SAVE_INTERVAL="x", CKPT_SAVE="/nonexistent"), "SAVE_INTERVAL=x must be a positive integer"),
        (dict(LR_DECAY_ITERS="soon"), "LR_DECAY_ITERS=soon must be a number of iterations"),
        (dict(PP=3), "PP=3: the 4 decoder layers do not split evenly over 3 stages"),
        (dict(PP=2, VP=4), "VP=4: pipeline stage 0 holds 2 layers, not a multiple of 4"),
        (dict(VP=2), "VP=2 needs pipeline parallelism"),
        (dict(PP=2, PP_FIRST=4), "PP_FIRST=4: must be between 1 and 3"),
        (dict(PP=2, PP_FIRST="x"), "PP_FIRST=x must be a number of decoder layers"),
        (dict(MOE=1, EP=2, ETP=2, NPROC=2), "EP=2: NPROC/PP=2 is not divisible by EP\\*ETP=4"),
        (dict(PACKING="budget"), "PACKING=budget: expected samples or tokens"),
        (dict(PACKING="tokens", PACKED_SEQ_LENGTH="2k"), "PACKED_SEQ_LENGTH=2k must be a positive integer"),
        (dict(LR="1e999"), "LR=1e999: expected a finite learning rate"),
        (dict(MOE=1, GROUPED_EXPERTS=2), "GROUPED_EXPERTS=2: expected 0 or 1"),
        (
            dict(MOE=1, LORA_RANK=4, GROUPED_EXPERTS=1, TRANSFORMER_IMPL="transformer_engine"),
            "GROUPED_EXPERTS=1 with TRANSFORMER_IMPL=transformer_engine and LoRA on linear_fc1/linear_fc2",
        ),
        (dict(MOE=1, MOE_DISPATCHER="alltoall"), "MOE_DISPATCHER=alltoall needs GPUs"),
        (dict(MOE=1, MOE_DISPATCHER="flex"), "MOE_DISPATCHER=flex: expected allgather or alltoall"),
        (dict(CP=2, SEQ_LEN=335), "SEQ_LEN=335 must be a multiple of 2\\*CP=4"),
        (dict(LR_WARMUP_ITERS=30), "LR_WARMUP_ITERS=30 must be smaller than the decay iterations \\(TRAIN_ITERS=30\\)"),
        (
            dict(LR_WARMUP_ITERS=5, LR_DECAY_ITERS=5),
            "LR_WARMUP_ITERS=5 must be smaller than the decay iterations \\(LR_DECAY_ITERS=5\\)",
        ),
        (dict(VISION_TP=0), "VISION_TP=0 must be a positive integer"),
        (dict(VISION_NPROC="-1"), "VISION_NPROC=-1 must be a non-negative integer"),
        (dict(VISION_TP=3), "VISION_TP=3 does not divide the 2 vision attention heads$"),
        (dict(TP=4), "VISION_TP=4 does not divide the 2 vision attention heads \\(VISION_TP is TP unless set\\)"),
        (dict(VISION_TP=2), "VISION_TP=2 does not divide TP=1"),
        (dict(TP=2, VISION_TP=2, VISION_NPROC=1), "VISION_NPROC=1 is not divisible by VISION_TP=2"),
        (dict(VISION_NPROC=2, NPROC=2), "VISION_NPROC=2 leaves no ranks for the language model \\(NPROC=2\\)"),
        (
            dict(TP=2, VISION_TP=1, VISION_NPROC=1, NPROC=4),
            "\\(NPROC-VISION_NPROC\\)=3 is not divisible by TP\\*CP\\*PP=2",
        ),
        (
            dict(MOE=1, EP=2, ETP=2, VISION_NPROC=1, NPROC=3),
            "EP=2: \\(NPROC-VISION_NPROC\\)/PP=2 is not divisible by EP\\*ETP=4",
        ),
        (dict(SEQ_LEN=99999999998), "SEQ_LEN=99999999998 is over 16777216: rotary positions are exact in fp32"),
        (dict(TRAIN_ITERS=10**21), f"TRAIN_ITERS={10**21} is over {2**63 - 1}: megatron counts iterations in int64"),
        (
            dict(TRAIN_ITERS=2**50, GBS=2**10, SEQ_LEN=2**10),
            f"TRAIN_ITERS\\*GBS\\*SEQ_LEN={2**70} \\(TRAIN_ITERS={2**50}, GBS=1024, SEQ_LEN=1024\\) is over "
            f"{2**63 - 1}: the tokens a run sees are counted in int64",
        ),
        (dict(MBS=2**12, GBS=2**12, SEQ_LEN=2**20), "MBS\\*SEQ_LEN=4294967296 .* int32 cu_seqlens"),
        (dict(PACKING="tokens", PACKED_SEQ_LENGTH=2**40), "PACKED_SEQ_LENGTH=1099511627776 is over 16777216"),
        (dict(TP=2**40), "TP=1099511627776 is over 2147483647: torch.distributed numbers ranks in int32"),
        (dict(VISION_NPROC=2**31), "VISION_NPROC=2147483648 is over 2147483647"),
        (dict(SAVE_INTERVAL=2**64, CKPT_SAVE="/s"), f"SAVE_INTERVAL={2**64} is over {2**63 - 1}"),
        (dict(LR_DECAY_ITERS=2**64), f"LR_DECAY_ITERS={2**64} is over {2**63 - 1}"),
        (dict(LORA_RANK=2**31), "LORA_RANK=2147483648 is over 2147483647: an adapter's rank is a GEMM dimension"),
        (dict(GPUS=2**32), "GPUS=4294967296 is over 2147483647"),
        (dict(MASTER_PORT=70000), "MASTER_PORT=70000 is over 65535: the largest TCP port"),
        (dict(MASTER_PORT="http"), "MASTER_PORT=http must be a positive integer"),
        (_video(VIDEO_FPS="0"), "VIDEO_FPS=0: expected a positive number"),
        (_video(VIDEO_FPS="1000.5"), "VIDEO_FPS=1000.5 is over 240: no video needs more frames a second"),
        (_video(VIDEO_FPS="1e9"), "VIDEO_FPS=1e9 is over 240: no video needs more frames a second"),
        (_video(VIDEO_FPS="two"), "VIDEO_FPS=two: expected a positive number such as 2, 0.5 or 5e-1"),
        (_video(VIDEO_MAX_FRAMES=2**20), "VIDEO_MAX_FRAMES=1048576 is over 16384"),
        (_video(VIDEO_MAX_PIXELS=2**40), "VIDEO_MAX_PIXELS=1099511627776 is over 67108864"),
        (dict(VISION_NPROC=1, NPROC=3, GBS=2), "GBS=2 is not a multiple of MBS\\*DP=4"),  # DP counts the language ranks
        (dict(CP=2, VISION_NPROC=1), "CP=2 with VISION_NPROC=1: megatron-core 0.19.2's bridge"),
        (dict(PP=2, VP=2, VISION_NPROC=1), "VP=2 with VISION_NPROC=1: only the non-interleaved pipeline schedule"),
        (
            dict(VISION_NPROC=3, NPROC=5),
            "VISION_NPROC=3 / VISION_TP=1 = 3 vision data-parallel ranks and 2 language .* "
            "\\(VISION_TP unset: VISION_NPROC / the language model's DP where that divides, "
            "else 1 where VISION_NPROC divides that DP, else TP\\)$",
        ),
    ],
)
def test_impossible_settings_fail_with_the_variable(env, message):
    import re

    rc, _, err = _script(MODEL_VARIANT=env.pop("MODEL_VARIANT", "tiny"), **env)
    assert rc != 0 and re.search(message, err), err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vision-nproc", "1"], "--vision-nproc: set VISION_NPROC instead"),
        (["--vision-tensor-parallel-size=2"], "--vision-tensor-parallel-size: set VISION_TP instead"),
        (["--seed", "3", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size: set TP instead"),
    ],
)
def test_a_flag_that_would_replace_a_variable_is_refused(flags, message):
    """Extra flags win in megatron's parser, but the script sized the run and printed its layout
    from the variable: the two would disagree."""
    rc, _, err = _script(*flags, MODEL_VARIANT="tiny")
    assert rc == 2 and err.strip() == f"run_qwen35_vl.sh: {message} (the script sizes the run from it)", err


def test_pipeline_settings_reach_megatron_and_layouts_are_printed():
    rc, out, err = _script(MODEL_VARIANT="tiny", PP=2, VP=2)
    assert rc == 0, err
    flags = _flags(out)
    assert flags["pipeline_model_parallel_size"] == "2" and flags["num_virtual_stages_per_pipeline_rank"] == "2"
    assert flags["nproc_per_node"] == "2"
    rc, out, err = _script(MODEL_VARIANT="tiny", PP=2, PP_FIRST=1)
    assert _flags(out)["decoder_first_pipeline_num_layers"] == "1" and "decoder_last_pipeline_num_layers" not in _flags(
        out
    )
    from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS

    rc, out, err = _script(MODEL_VARIANT="122b_a10b")  # the planner's choice at the default count
    tp, pp, vp, cp, ep, etp, first, last, gpus = LAYOUTS["122b_a10b"]
    assert rc == 0 and f"# planned cluster layout: TP={tp} PP={pp} CP={cp} EP={ep} ETP={etp}" in out, out
    assert f"on {gpus} GPUs" in out and out.strip().splitlines()[-1].startswith("torchrun")
    rc, out, err = _script(MODEL_VARIANT="9b", GPUS=64)  # any count asked
    assert rc == 0 and "on 64 GPUs" in out, err
    rc, out, err = _script(MODEL_VARIANT="9b", GPUS=12)
    assert (
        rc != 0
        and err.strip().splitlines()[-1]
        == "run_qwen35_vl.sh: GPUS=12: --gpus 12: not a whole number of nodes of --gpus-per-node 8"
    ), err


def test_vision_layout_reaches_megatron_and_its_rank_table_is_printed():
    rc, out, err = _script(MODEL_VARIANT="tiny", TP=2, VISION_TP=1, VISION_NPROC=1)
    assert rc == 0, err
    flags = _flags(out)
    assert (flags["vision_nproc"], flags["vision_tensor_parallel_size"], flags["nproc_per_node"]) == ("1", "1", "3")
    assert (
        "use_distributed_optimizer" in flags
    )  # the tower's ranks share the grad norm's shards (vision_ranks/groups.py)
    lines = out.strip().splitlines()
    assert lines[-3:-1] == [
        "# ranks 0    vision tower    TP=1 DP=1",
        "# ranks 1-2  language model  TP=2 CP=1 DP=1 PP=1",
    ]
    assert lines[-1].startswith("torchrun")
    # unset, VISION_TP gives the tower a replica for each of the language model's: VISION_NPROC / DP
    rc, out, err = _script(MODEL_VARIANT="tiny", TP=2, VISION_NPROC=1)
    assert rc == 0 and "vision_tensor_parallel_size" not in _flags(out), err  # the training script's default
    assert "# ranks 0    vision tower    TP=1 DP=1" in out
    rc, out, err = _script(MODEL_VARIANT="tiny", VISION_NPROC=2)
    assert rc == 0 and "# ranks 0-1  vision tower    TP=2 DP=1" in out, err
    rc, out, err = _script(MODEL_VARIANT="tiny", TP=2, VISION_TP=2, VISION_NPROC=2)  # set, it is passed on
    assert rc == 0 and _flags(out)["vision_tensor_parallel_size"] == "2" and "TP=2 DP=1" in out, err
    rc, out, err = _script(MODEL_VARIANT="tiny", TP=2, VISION_TP=1)  # on the language model's ranks
    flags = _flags(out)
    assert rc == 0 and flags["vision_tensor_parallel_size"] == "1" and "vision_nproc" not in flags
    assert (
        flags["nproc_per_node"] == "2"
        and "# ranks 0-1  vision tower    TP=1 DP=2 (on the language model's ranks)" in out
    )
    rc, out, err = _script(MODEL_VARIANT="tiny", TP=2, VISION_TP=2)  # the default layout: no table, no flags
    flags = _flags(out)
    assert (
        rc == 0 and "vision_tensor_parallel_size" not in flags and "vision_nproc" not in flags and "# ranks" not in out
    )


def test_token_budget_packing_reaches_megatron_with_one_row_a_micro_batch():
    rc, out, err = _script(MODEL_VARIANT="tiny", PACKING="tokens", SEQ_LEN=512)
    assert rc == 0, err
    flags = _flags(out)
    assert (flags["packing"], flags["packed_seq_length"], flags["micro_batch_size"]) == ("tokens", "512", "1")
    rc, out, err = _script(MODEL_VARIANT="tiny", PACKING="tokens", PACKED_SEQ_LENGTH=1024)
    assert _flags(out)["packed_seq_length"] == "1024" and "packing" not in _flags(_script(MODEL_VARIANT="tiny")[1])


def test_cpu_dry_run_uses_the_engine_with_the_local_backend():
    rc, out, err = _script(MODEL_VARIANT="tiny")
    assert rc == 0, err
    flags = _flags(out)
    assert flags["transformer_impl"] == "local" and flags["distributed_backend"] == "gloo"
    assert "bf16" not in flags and flags["log_throughput"] is True
    assert "standalone" in flags and "master_port" not in flags  # a free port unless MASTER_PORT is given
    assert "backend local (CPU host" in out
    rc, out, _ = _script(MODEL_VARIANT="tiny", MASTER_PORT=29123)
    assert _flags(out)["master_port"] == "29123"


@pytest.mark.parametrize(
    "impl,message",
    [
        ("transformer_engine", "TRANSFORMER_IMPL=transformer_engine needs a GPU; this host has none"),
        ("fast", "TRANSFORMER_IMPL=fast: expected transformer_engine or local"),
    ],
)
def test_backend_choice_is_validated(impl, message):
    rc, _, err = _script(MODEL_VARIANT="tiny", TRANSFORMER_IMPL=impl)
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_resume_with_a_starting_checkpoint_loads_it_while_the_resume_directory_is_empty(tmp_path):
    """CKPT_LOAD with CKPT_RESUME: megatron's --pretrained-checkpoint is loaded (as --finetune) while
    --load holds no checkpoint, so the first run starts from CKPT_LOAD's weights, not from random."""
    rc, out, _ = _script(CKPT_LOAD=str(tmp_path / "start"), CKPT_RESUME=str(tmp_path / "run"))
    flags = _flags(out)
    assert rc == 0 and flags["pretrained_checkpoint"] == str(tmp_path / "start")
    assert flags["load"] == flags["save"] == str(tmp_path / "run") and "finetune" not in flags


def test_a_save_folder_beside_the_resume_folder_gets_the_saves_and_a_deliberate_name_passes(tmp_path):
    """CKPT_SAVE with CKPT_RESUME: resumed from CKPT_RESUME, saved to CKPT_SAVE (it had gone into the
    resumed folder); a variable of the user's listed in UNCHECKED_VARIABLES is not taken for a misspelling."""
    rc, out, err = _script(
        CKPT_RESUME=str(tmp_path / "run"), CKPT_SAVE=str(tmp_path / "next"), FSPD=1, UNCHECKED_VARIABLES="FSPD"
    )
    flags = _flags(out)
    assert rc == 0 and flags["load"] == str(tmp_path / "run") and flags["save"] == str(tmp_path / "next"), err


@pytest.mark.parametrize(
    "value, cuda, nproc, forks",
    [
        (None, False, 3, True),
        (None, True, 3, False),
        (None, False, 2, False),
        ("0", False, 4, False),
        ("1", False, 1, True),
        ("0", True, 2, False),
    ],
)
def test_ranks_fork_from_the_preloaded_engine_only_without_cuda(monkeypatch, value, cuda, nproc, forks):
    """By default where there is no CUDA and the ranks outnumber the cores (2 here)."""
    from examples.multimodal_dev.launcher.torchrun import forks_ranks

    if value is None:
        monkeypatch.delenv("FORK_RANKS", raising=False)
    else:
        monkeypatch.setenv("FORK_RANKS", value)
    assert forks_ranks(cuda, nproc, 2) is forks


@pytest.mark.parametrize(
    "value, cuda, message",
    [
        ("1", True, "FORK_RANKS=1 needs a host without CUDA"),
        ("yes", False, "FORK_RANKS=yes: expected 0 (fresh interpreters) or 1 (fork)"),
    ],
)
def test_a_rank_start_that_cannot_work_is_refused_by_name(monkeypatch, value, cuda, message):
    from examples.multimodal_dev.launcher.torchrun import forks_ranks

    monkeypatch.setenv("FORK_RANKS", value)
    with pytest.raises(SystemExit, match=re.escape(message)):
        forks_ranks(cuda, 2, 2)


def test_a_mistake_found_by_the_training_script_is_one_line_without_tracebacks(tmp_path):
    """A mistake only the training script can see (a data path that does not exist) stops every
    rank with one line; the launcher adds one more and no traceback of its own."""
    rc, out, err = _script(
        DRY_RUN=0,
        DATASET="cord_v2",
        DATA_PATH=str(tmp_path / "nothing"),
        HF_PROCESSOR_PATH=str(tmp_path / "nothing"),
        TRAIN_ITERS=1,
    )
    assert rc == 1
    output = out + err
    assert f"pretrain_multimodal.py: --data-path '{tmp_path / 'nothing'}': no such file or directory" in output
    assert "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == "torchrun: rank 0 stopped (exit code 1); its output above says why"
    # (--packing tokens with MBS=2, on a warm engine and cold: tests/unit/test_warm_engine.py)
    warm = {k: v for k, v in on_warm_engine(dict(os.environ)).items() if k in ("ENGINE_SERVER", "PYTHONPATH")}
    rc, out, err = _script("--attention-backend", "flash", DRY_RUN=0, TRAIN_ITERS=1, **warm)
    assert (
        rc == 1
        and "pretrain_multimodal.py: --attention-backend flash on the local backend: varlen attention "
        "needs a CUDA device"
        in out + err
        and "Traceback" not in out + err
    ), (out + err)[-3000:]


def test_the_recipe_example_in_the_docs_runs_as_written():
    """docs/training.md's Python example: a recipe changed with ``replace`` becomes checked flags, what
    the host and the model decide filled in; an impossible change is refused by its variable's name."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        page = f.read()
    section = page[page.index("## The run as one value") :]
    code = section[
        section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))
    ]
    scope: dict = {}
    exec(compile(code, "docs/training.md", "exec"), scope)
    flags = _flags(shlex.join(scope["argv"]))
    assert (flags["tensor_model_parallel_size"], flags["global_batch_size"], flags["model_variant"]) == (
        "2",
        "16",
        "proxy",
    )
    assert flags["sequence_parallel"] is True and flags["moe_grouped_gemm"] is True  # MoE at TP=2; grouped experts
    assert (flags["transformer_impl"], flags["bf16"]) == ("local", True)
    bad = scope["replace"](scope["config"], layout=scope["replace"](scope["config"].layout, tp=3))
    with pytest.raises(run_config.LaunchError, match="TP=3 does not divide"):
        launch.argv_of(bad, Host(gpu=True))

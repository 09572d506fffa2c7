"""The variables ``run_qwen35_vl.sh`` reads: one row each (or one row for a few that go together),
with its default and meaning. README.md's variable table is ``markdown()`` of this table, held equal
by a test; ``launcher/from_env.py`` reads the environment only through these names."""

from __future__ import annotations

# (names, default, meaning), in Markdown as the README shows them
VARIABLES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (
        ("MODEL_VARIANT",),
        "`tiny` without a GPU, `proxy` with one (the script says which)",
        "`tiny`, `proxy`, `0.8b`, `2b`, `4b`, `9b`, `27b`, `35b_a3b`, `122b_a10b`, `397b_a17b`",
    ),
    (("TP", "CP", "EP", "PP"), "1", "tensor / context / expert / pipeline parallel sizes"),
    (("ETP",), "`TP`", "expert tensor parallel size (1: whole experts per rank)"),
    (("VP",), "1", "virtual pipeline stages per pipeline rank (the interleaved schedule)"),
    (("PP_FIRST", "PP_LAST"), "even split", "decoder layers on the first / last pipeline stage"),
    (("SP",), "1 for MoE with `TP>1` (megatron-core requires it), else 0", "sequence parallelism over the TP ranks"),
    (
        ("FSDP",),
        "0",
        "Megatron-FSDP: weights, gradients and optimizer state sharded over the data-parallel ranks, checkpoints "
        "in `fsdp_dtensor` ([docs/parallelism.md](docs/parallelism.md#megatron-fsdp))",
    ),
    (("NPROC",), "`TP*CP*PP` (+`VISION_NPROC`) / `NNODES`", "processes (torchrun) on each node"),
    (
        ("NNODES", "NODE_RANK"),
        "1, 0; in an `srun` step the step's node count and this node's id (`SLURM_STEP_NUM_NODES`, `SLURM_NODEID`)",
        "nodes of the run and this node's place among them: every node runs the script with the same settings "
        "and its own `NODE_RANK` (`NNODES*NPROC` processes in all; [docs/training.md](docs/training.md#many-nodes))",
    ),
    (
        ("MASTER_ADDR",),
        "unset; in an `srun` step the first host of `SLURM_STEP_NODELIST`",
        "`NNODES>1`: the host of node 0, where the ranks meet (torchrun's static rendezvous on `MASTER_PORT`)",
    ),
    (
        ("DATASET",),
        "`mock`",
        "`mock` (no files), `mock_mix` (no files; the length and image mix of a real SFT set, "
        "`data/mock_mix.py`), `mock_video` (no files; the mock's images plus a video in half the "
        "conversations), `cord_v2`, `jsonl` (your own conversations) or `energon` (Megatron-Energon shards); "
        "the last three need `DATA_PATH`, `HF_PROCESSOR_PATH` ([docs/data.md](docs/data.md))",
    ),
    (
        ("TRAIN_ITERS", "MBS", "GBS", "SEQ_LEN", "LR"),
        "CPU: 30 2 4 1024 2e-3; GPU: 20 1 8 4096 1e-4",
        "iterations, micro / global batch, per-sample token budget, peak LR",
    ),
    (("PACKED",), "1", "1: THD packing of each micro-batch; 0: padded BSHD"),
    (
        ("PACKING", "PACKED_SEQ_LENGTH"),
        "`samples`, `SEQ_LEN`",
        "`samples`: a micro-batch packs `MBS` conversations; `tokens`: a micro-batch is one row of "
        "`PACKED_SEQ_LENGTH` tokens, `GBS` counts rows, `MBS` is 1 ([docs/data.md](docs/data.md))",
    ),
    (("MOE",), "0", "`tiny` only: 4 experts (top-2) so EP runs on CPU"),
    (
        ("MTP",),
        "1 if `HF_CONFIG` has an MTP head, else 0",
        "1 also trains the multi-token-prediction head (`--mtp-num-layers 1`); its loss is logged as `mtp_1 loss`",
    ),
    (
        ("CKPT_LOAD",),
        "",
        "start from these weights (`--finetune`: fresh optimizer, iteration 0); an import from Hugging Face "
        "also supplies the model shape",
    ),
    (
        ("HF_CONFIG",),
        "`CKPT_LOAD/hf_config.json` if present",
        "take the model shape from a Hugging Face `config.json` instead of `MODEL_VARIANT`",
    ),
    (("CKPT_SAVE", "SAVE_INTERVAL"), "`TRAIN_ITERS`", "save there every `SAVE_INTERVAL` iterations and at the end"),
    (
        ("CKPT_RESUME",),
        "",
        "load from and save to this directory: exact resume (weights, AdamW, LR schedule, RNG, data "
        "position); with `CKPT_LOAD` too, the first run starts from `CKPT_LOAD`'s weights (megatron's "
        "`--pretrained-checkpoint`) and later runs resume",
    ),
    (
        ("DRY_RUN",),
        "0",
        "1: print the command and exit, with the layout the planner chooses for `GPUS` H100s "
        "([docs/planner.md](docs/planner.md))",
    ),
    (
        ("GPUS",),
        "`9b` ... `397b_a17b`: the count in [docs/planner.md](docs/planner.md)",
        "`DRY_RUN` only: the cluster's GPU count to plan for",
    ),
    (
        ("VISION_TP",),
        "`TP`; with `VISION_NPROC`: a vision replica for each language one, else 1 where `VISION_NPROC` "
        "divides the language model's DP",
        "the vision tower's tensor-parallel size, the rest of its ranks its data parallelism; on the language"
        " model's ranks a divisor of `TP` (`vision_ranks/layout.py`)",
    ),
    (
        ("VISION_NPROC",),
        "0: the tower runs on the language model's first-stage ranks",
        "ranks 0 .. `VISION_NPROC`-1 run only the vision tower, the others only the language model",
    ),
    (
        ("LR_WARMUP_ITERS", "LR_DECAY_ITERS"),
        "`TRAIN_ITERS`/10, `TRAIN_ITERS`",
        "the LR schedule (cosine to LR/10); when resuming, setting either replaces the checkpoint's schedule",
    ),
    (
        ("DATA_PATH", "HF_PROCESSOR_PATH"),
        "",
        "`cord_v2`, `jsonl`, `energon`: the data, and the Hugging Face processor (tokenizer and image processor)",
    ),
    (
        ("VALID_DATA_PATH", "VALID_FRACTION"),
        "none, 0",
        "`jsonl`: the validation records, or the fraction of `DATA_PATH`'s records held out for validation",
    ),
    (
        ("MEDIA_ROOT",),
        "each JSONL's folder",
        "`jsonl`: where relative media paths resolve, and the folder media must lie in",
    ),
    (("MEDIA_ANYWHERE",), "0", "`jsonl`: 1 admits media paths outside the JSONL's folder or `MEDIA_ROOT`"),
    (("REMOTE_MEDIA",), "0", "`jsonl`: 1 fetches http(s) images and videos named in the records"),
    (
        ("STRICT_DATA",),
        "0",
        "`jsonl`, `energon`: 1 stops the run at the first bad record in one line, instead of a counted skip",
    ),
    (
        ("VIDEO_FPS", "VIDEO_MAX_FRAMES", "VIDEO_MAX_PIXELS"),
        "2, 768, qwen-vl-utils'",
        "`jsonl`, `energon`: frames sampled per second of video, the most frames, the largest area of one "
        "frame after resizing",
    ),
    (
        ("LORA_RANK",),
        "0",
        "LoRA fine-tuning: adapters of this rank, every other weight frozen; with `CKPT_LOAD` (an import "
        "from Hugging Face) they adapt its weights ([docs/lora.md](docs/lora.md))",
    ),
    (
        ("LORA_ALPHA", "LORA_TARGETS"),
        "`LORA_RANK`, every linear of the language model",
        "the adapters' scale alpha / rank, and the linears that get one (`lora/targets.py`)",
    ),
    (
        ("LORA_BASE",),
        "where the checkpoint names it",
        "where the base of a LoRA checkpoint's adapters is now, if it moved since the save: a LoRA run's "
        "checkpoints hold the adapters, not the base ([docs/lora.md](docs/lora.md))",
    ),
    (
        ("GROUPED_EXPERTS",),
        "1 for MoE, 0 with LoRA on `linear_fc1` / `linear_fc2` on `transformer_engine`",
        "1: each MoE layer's routed experts as two grouped GEMMs (`--moe-grouped-gemm`: "
        "`models/common/grouped_experts.py` on `local`, megatron's `TEGroupedMLP` on `transformer_engine`); "
        "0: megatron-core's `SequentialMLP`, one MLP call per expert. Same checkpoint keys either way, "
        "LoRA's adapters included (`lora/grouped.py` on the local grouped experts)",
    ),
    (
        ("MOE_DISPATCHER",),
        "`alltoall` on GPUs where `EP>1`, else `allgather` (the script says which)",
        "the MoE token dispatcher (`--moe-token-dispatcher-type`): `allgather` or `alltoall` (GPUs only: "
        "gloo has no uneven all-to-all)",
    ),
    (
        ("TRANSFORMER_IMPL",),
        "`transformer_engine` on a GPU host where it imports, else `local` (the script says which)",
        "module backend; both write the same checkpoint keys (Transformer Engine / Megatron-Bridge names)",
    ),
    (
        ("MASTER_PORT",),
        "a free port (`torchrun --standalone`); 29500 where `NNODES>1`",
        "rendezvous port on `MASTER_ADDR`, the same on every node",
    ),
    (
        ("JOIN_TIMEOUT",),
        "600",
        "`NNODES>1`: seconds node 0 waits for every node to join; then every node stops on one line naming "
        "the nodes that never joined (a node that cannot reach node 0 in that time names it)",
    ),
    (
        ("COLLECTIVE_TIMEOUT",),
        "10 (megatron's)",
        "minutes a collective waits for a rank that does not come (a node that hangs) before the run stops "
        "(`--distributed-timeout-minutes`); a node that dies stops the others at once",
    ),
    (
        ("FORK_RANKS",),
        "1 without CUDA where `NPROC` exceeds the cores, else 0",
        "1: the ranks fork from one process that imported torch, megatron-core and transformers once (about 6"
        " s of CPU saved a rank, where the ranks would queue for the cores to import); 0: each rank is a "
        "fresh interpreter, as torchrun starts it (`launcher/torchrun.py`)",
    ),
)

NAMES = frozenset(name for names, _, _ in VARIABLES for name in names)


def markdown() -> str:
    """README.md's table of the variables."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for names, default, meaning in VARIABLES:
        cells = (" ".join(f"`{name}`" for name in names), default, meaning)
        rows.append(" ".join(["|", *(f"{cell} |" if cell else "|" for cell in cells)]))
    return "\n".join(rows) + "\n"


# The largest value of each numeric variable (or product of variables), and what holds it: past these
# a run cannot be what was asked (positions that round, counters that wrap), or asks more than any
# input needs. Python's ints never overflow, so nothing before torch would notice.
INT32, INT64 = 2**31 - 1, 2**63 - 1
RANKS = "torch.distributed numbers ranks in int32"
ITERATIONS = "megatron counts iterations in int64"
LIMITS: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("SEQ_LEN",), 2**24, "rotary positions are exact in fp32 up to 2^24"),
    (("PACKED_SEQ_LENGTH",), 2**24, "rotary positions are exact in fp32 up to 2^24"),
    *(((name,), INT64, ITERATIONS) for name in ("TRAIN_ITERS", "SAVE_INTERVAL", "LR_WARMUP_ITERS", "LR_DECAY_ITERS")),
    *(
        ((name,), INT32, RANKS)
        for name in ("TP", "CP", "EP", "ETP", "PP", "VP", "VISION_TP", "VISION_NPROC", "NPROC", "NNODES")
    ),
    (("NODE_RANK",), INT32, RANKS),
    (("GPUS",), INT32, RANKS),
    (("LORA_RANK",), INT32, "an adapter's rank is a GEMM dimension, int32 in cuBLAS"),
    # the largest a record's own video keys may ask (data/video.py's OVERRIDE_LIMITS; a test holds them equal)
    (("VIDEO_FPS",), 240, "no video needs more frames a second"),
    (("VIDEO_MAX_FRAMES",), 1 << 14, "no video needs more frames"),
    (("VIDEO_MAX_PIXELS",), 1 << 26, "a frame of 8192 x 8192"),
    (("MASTER_PORT",), 65535, "the largest TCP port"),
    (("JOIN_TIMEOUT",), 7 * 24 * 3600, "a week: a node not there by then is not coming"),
    (("COLLECTIVE_TIMEOUT",), 7 * 24 * 60, "a week: a rank not there by then is not coming"),
    # products after their factors: a value past its own limit is named alone
    (("MBS", "SEQ_LEN"), INT32, "a micro-batch's tokens are indexed by int32 cu_seqlens"),
    (("NNODES", "NPROC"), INT32, RANKS),
    (("TRAIN_ITERS", "GBS", "SEQ_LEN"), INT64, "the tokens a run sees are counted in int64"),
)


def limit_problem(values: dict[str, str]) -> str | None:
    """The first of ``LIMITS`` that the variables set in ``values`` exceed, as one line naming the
    variables, their values and the limit; None when every one holds. Values are already checked
    to be numbers."""
    for names, limit, why in LIMITS:
        if not all(name in values for name in names):
            continue
        given = [values[name] for name in names]
        product = 1
        for value in given:
            product *= float(value) if any(c in value for c in ".eE") else int(value)
        if product > limit:
            what = "*".join(names) + f"={product}" if len(names) > 1 else f"{names[0]}={given[0]}"
            parts = f" ({', '.join(f'{n}={v}' for n, v in zip(names, given))})" if len(names) > 1 else ""
            return f"{what}{parts} is over {limit}: {why}"
    return None

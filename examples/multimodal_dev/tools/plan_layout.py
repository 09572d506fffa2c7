"""Plan the parallel layout of a run: which TP / CP / PP / VP / EP / ETP, Megatron-FSDP and recompute
fit the GPUs' memory and run a step fastest, predicted from the model's shape (no GPU needed).

    python -m examples.multimodal_dev.tools.plan_layout VARIANT [--gpus N] [--gpu h100|h200|b200]
        [--gpu-memory GIB] [--gpus-per-node 8] [--seq-len 4096] [--micro-batch 1]
        [--global-batch 512] [--efficiency 0.5] [--peak-tflops F] [--nvlink-gbs B]
        [--network-gbs B] [--recompute auto|none|full] [--no-distributed-optimizer] [--fsdp] [--top 3]
        [--data-path JSONL --hf-processor-path DIR [--media-root DIR] [--data-samples 512]] [--brief]
        [--layout "TP=1 PP=2 EP=8 ..."] [--docs-table]

VARIANT: a released variant or ``--hf-config config.json``. A micro-batch is ``--micro-batch``
rows of ``--seq-len`` tokens packed from ``mock_mix``'s conversation mix, or from your JSONL's
(``--data-path``, read as training reads it, no pixels decoded) (``--packing tokens``);
``--global-batch`` counts rows. Memory is the busiest pipeline stage's rank; time is predicted
(``planner/layout_cost.py`` says what is counted and what is assumed hidden), at ``--efficiency``
of the GPU's peak on the model's FLOPs. The figures are predictions, not measurements: memory
parts are checked on CPU (weights, gradients and optimizer state exactly against meta-device
builds; activations within 10 % of a CPU run), step times cannot be checked without GPUs.
``--brief`` prints the best layout's run-script settings on one line (the run script's DRY_RUN).
``--layout`` costs one given layout instead of searching (keys as ``tools/rank_memory``'s, and
``FSDP=1``). ``--fsdp`` also tries layouts of one pipeline stage under Megatron-FSDP (the run
script's ``FSDP=1``), except with ``--lora-rank`` or ``--vision-chunk-patches``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import time

from examples.multimodal_dev.models.setting_names import FSDP_REFUSALS
from examples.multimodal_dev.planner.launch_layout import MAX_GPUS
from examples.multimodal_dev.planner.layout_cost import GIB, HARDWARE, Hardware


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.multimodal_dev.tools.plan_layout", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("variant", nargs="?", help="released variant (or give --hf-config)")
    p.add_argument("--hf-config", help="a Hugging Face config.json instead of a variant")
    p.add_argument("--gpus", type=int, help="GPUs of the cluster [9b ... 397b_a17b: docs/planner.md's count]")
    p.add_argument("--gpu", default="h100", choices=sorted(HARDWARE))
    p.add_argument("--gpu-memory", type=float, help="GiB per GPU [the --gpu's]")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of a packed row [4096]")
    p.add_argument("--micro-batch", type=int, default=1, help="rows a micro-batch [1]")
    p.add_argument("--global-batch", type=int, default=512, help="rows a step [512: 2M tokens of 4096]")
    p.add_argument("--efficiency", type=float, default=0.5, help="of peak FLOP/s on the model's FLOPs [0.5]")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU [the --gpu's]")
    p.add_argument("--nvlink-gbs", type=float, help="GB/s per GPU within a node [the --gpu's]")
    p.add_argument("--network-gbs", type=float, help="GB/s per GPU across nodes [the --gpu's]")
    p.add_argument(
        "--data-path",
        help="your conversation JSONL (file, folder or blend): plan for its mix "
        "instead of mock_mix's (needs --hf-processor-path)",
    )
    p.add_argument("--data-samples", type=int, default=512, help="conversations of --data-path to read [512]")
    p.add_argument("--hf-processor-path", help="the processor that tokenizes --data-path")
    p.add_argument("--media-root", help="where --data-path's relative media paths start")
    p.add_argument(
        "--allow-media-anywhere",
        action="store_true",
        help="read media outside --data-path's folder (or --media-root), as training's flag",
    )
    p.add_argument("--reserve", type=float, default=0.1, help="share of GPU memory kept back [0.1]")
    p.add_argument("--recompute", default="auto", choices=("auto", "none", "full"))
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="also try Megatron-FSDP (FSDP=1) layouts")
    p.add_argument(
        "--vision-chunk-patches",
        type=int,
        default=0,
        help="the tower in chunks of at most N patches, as training's flag",
    )
    p.add_argument("--lora-rank", type=int, default=0, help="plan a LoRA run: adapters of this rank, the base frozen")
    p.add_argument("--lora-targets", help="the adapters' linears, as the training flag [its default]")
    p.add_argument("--top", type=int, default=3, help="layouts to print [3]")
    p.add_argument("--brief", action="store_true", help="one line: the best layout's run-script settings")
    p.add_argument(
        "--docs-table",
        "--readme-table",
        action="store_true",
        help="docs/planner.md's table: every variant with a default count, planned with these settings",
    )
    p.add_argument("--layout", help='cost this layout only, e.g. "TP=1 PP=2 EP=8 FIRST=16 LAST=24" or "TP=2 FSDP=1"')
    return p


# Megatron-Bridge's H100 BF16 performance recipes for Qwen3.5-VL (perf_recipes/qwen_vl/h100/
# qwen35_vl.py), for docs/planner.md's comparison; the dense variants have none.
BRIDGE_H100 = {
    "35b_a3b": "TP=1 PP=2 EP=8 (16 + 24 layers), 16 GPUs, GBS 512",
    "122b_a10b": "TP=2 PP=8 VP=2 EP=16, 128 GPUs",
    "397b_a17b": "TP=2 PP=8 VP=4 EP=32, 256 GPUs",
}
TABLE_HEADER = (
    "| variant | GPUs | planned layout | fullest rank GiB: state + activations | step s | TFLOP/s per GPU "
    "| tokens/s per GPU | Megatron-Bridge recipe |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_row(result) -> str:
    """docs/planner.md's row of a variant planned at its default count."""
    req, best = result.request, result.plans[0]
    m, t = best.busiest, best.time
    tokens = req.global_batch * req.mix.seq_len / t.total / req.gpus
    return (
        f"| `{req.name}` | {req.gpus} | {run_settings(best, req, data=False)} {notes(best)} | "
        f"{(m.weights + m.grads + m.optimizer) / GIB:.1f} + "
        f"{m.activations / GIB:.1f} = {m.total / GIB:.1f} | {t.total:.2f} | {best.tflops_per_gpu(req):.0f} | "
        f"{tokens:,.0f} | {BRIDGE_H100.get(req.name, '-')} |"
    )


MAX_GLOBAL_BATCH = 1 << 20  # rows a step: 4T tokens of 4096; the planner draws a row per sample


def _fail(message: str):
    raise SystemExit(f"plan_layout: {message}")


def request_from_args(args):
    """The planner's Request, every setting checked (one line naming the flag otherwise)."""
    from examples.multimodal_dev.planner.layout_plan import Request

    shape, name = _shape_and_name(args)
    _check_run_size(args, name)
    _check_shares(args)
    hardware = _hardware(args)
    recompute = {"auto": (None, "full"), "none": (None,), "full": ("full",)}[args.recompute]
    lora = _lora(args)
    if args.vision_chunk_patches < 0:
        _fail(f"--vision-chunk-patches {args.vision_chunk_patches}: must be 0 (off) or a patch count")
    return Request(
        name,
        shape,
        args.gpus,
        hardware,
        _mix(args, shape),
        args.global_batch,
        args.micro_batch,
        args.efficiency,
        args.reserve,
        not args.no_distributed_optimizer,
        recompute,
        lora,
        args.vision_chunk_patches,
        args.fsdp,
    )


def _shape_and_name(args):
    """(shape, name) of the model to plan: --hf-config's, else the released VARIANT's."""
    from examples.multimodal_dev.models import default_model

    variants = default_model().variants
    if args.hf_config:
        from_hf_config = default_model().shape_from_hf
        try:
            return from_hf_config(args.hf_config), args.hf_config
        except (OSError, ValueError, KeyError) as err:
            _fail(f"--hf-config {args.hf_config}: {err}")
    if args.variant in variants:
        return variants[args.variant], args.variant
    _fail(f"variant {args.variant!r}: expected one of {', '.join(variants)} (or --hf-config)")


def _check_run_size(args, name: str) -> None:
    """The counts (GPUs, batches, rows), --gpus defaulting to docs/planner.md's count for ``name``; the
    caps keep the planner's search and its row drawing bounded."""
    from examples.multimodal_dev.planner.layout_plan import MIN_CP_TOKENS
    from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS

    if args.gpus is None:
        if name not in LAYOUTS:
            _fail(f"--gpus: needed for {name} (a GPU count is given by default for {', '.join(LAYOUTS)} only)")
        args.gpus = LAYOUTS[name][-1]
    for flag, value, low in (
        ("--gpus", args.gpus, 1),
        ("--gpus-per-node", args.gpus_per_node, 1),
        ("--micro-batch", args.micro_batch, 1),
        ("--global-batch", args.global_batch, 1),
        ("--top", args.top, 1),
        ("--data-samples", args.data_samples, 1),
        ("--seq-len", args.seq_len, MIN_CP_TOKENS // 8),
    ):
        if value < low:
            _fail(f"{flag} {value}: must be at least {low}")
    if args.gpus > MAX_GPUS:
        _fail(f"--gpus {args.gpus}: at most {MAX_GPUS} (the planner's search over layouts grows with the count)")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        _fail(f"--gpus {args.gpus}: not a whole number of nodes of --gpus-per-node {args.gpus_per_node}")
    if args.global_batch > MAX_GLOBAL_BATCH:
        _fail(f"--global-batch {args.global_batch}: at most {MAX_GLOBAL_BATCH} rows a step")


def _check_shares(args) -> None:
    """--efficiency and --reserve are shares of the GPU's peak and memory."""
    if not 0 < args.efficiency <= 1:
        _fail(f"--efficiency {args.efficiency}: a share of peak, in (0, 1]")
    if not 0 <= args.reserve < 1:
        _fail(f"--reserve {args.reserve}: a share of the GPU's memory, in [0, 1)")


def _hardware(args) -> Hardware:
    """The --gpu's figures, each overridden by its flag where given."""
    base = HARDWARE[args.gpu]
    for flag, value in (
        ("--gpu-memory", args.gpu_memory),
        ("--peak-tflops", args.peak_tflops),
        ("--nvlink-gbs", args.nvlink_gbs),
        ("--network-gbs", args.network_gbs),
    ):
        if value is not None and not (0 < value < math.inf):
            _fail(f"{flag} {value}: must be a positive finite number")
    return Hardware(
        base.name,
        args.peak_tflops or base.peak_tflops,
        args.gpu_memory or base.memory_gib,
        args.nvlink_gbs or base.nvlink_gbs,
        args.network_gbs or base.network_gbs,
        args.gpus_per_node,
    )


def _lora(args):
    from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS, LoraSettings, parse_targets

    if args.lora_rank < 0:
        _fail(f"--lora-rank {args.lora_rank}: must be 0 (off) or a positive rank")
    if args.lora_targets and not args.lora_rank:
        _fail(f"--lora-targets {args.lora_targets}: needs --lora-rank")
    if not args.lora_rank:
        return None
    try:
        targets = parse_targets(args.lora_targets) if args.lora_targets else DEFAULT_TARGETS
    except ValueError as err:
        _fail(str(err))
    return LoraSettings(args.lora_rank, targets)


def _mix(args, shape):
    from examples.multimodal_dev.planner.layout_mix import Mix

    if not args.data_path:
        if args.hf_processor_path or args.media_root or args.allow_media_anywhere:
            _fail(
                "--hf-processor-path / --media-root / --allow-media-anywhere: they describe --data-path, which is "
                "not given"
            )
        return Mix.mock_mix(shape, args.seq_len)
    if not args.hf_processor_path:
        _fail(f"--data-path {args.data_path}: needs --hf-processor-path (the tokenizer that counts its tokens)")
    from examples.multimodal_dev.data.jsonl import build_datasets
    from examples.multimodal_dev.data.sample import DataError

    try:
        train, _, _ = build_datasets(
            args.seq_len,
            (args.data_samples, 0, 0),
            data_path=args.data_path,
            hf_processor_path=args.hf_processor_path,
            media_root=args.media_root,
            allow_media_anywhere=args.allow_media_anywhere,
        )
        return Mix.from_dataset(shape, args.seq_len, train, f"--data-path {args.data_path}", args.data_samples)
    except (DataError, OSError, ValueError) as err:
        _fail(" ".join(str(err).split()))


RECOMPUTE_FLAGS = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def run_settings(plan, request, data: bool = True) -> str:
    """The run script's environment for a plan. The rows are token-budget packed
    (``PACKING=tokens``), where a micro-batch is one row: MBS rows of SEQ_LEN tokens become one row
    of MBS x SEQ_LEN (``PACKED_SEQ_LENGTH``), the same tokens."""
    lay, mbs, seq = plan.candidate.layout, plan.candidate.mbs, request.mix.seq_len
    env = [f"TP={lay.tp}", f"PP={lay.pp}", f"CP={lay.cp}"]
    env += [f"EP={lay.ep}", f"ETP={lay.etp}"] if lay.ep > 1 else []
    env += [f"VP={lay.vp}"] if lay.vp else []
    env += [f"PP_FIRST={lay.first}", f"PP_LAST={lay.last}"] if lay.first else []
    env += ["FSDP=1"] if lay.fsdp else []
    if data:
        env += ["PACKING=tokens", f"SEQ_LEN={seq}"] + ([f"PACKED_SEQ_LENGTH={mbs * seq}"] if mbs > 1 else [])
        env += [f"GBS={request.global_batch // mbs}"]
    if request.lora:
        from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS

        env += [f"LORA_RANK={request.lora.rank}"]
        env += [f"LORA_TARGETS={','.join(request.lora.targets)}"] if request.lora.targets != DEFAULT_TARGETS else []
    return " ".join(env)


def extra_flags(request) -> str:
    """Training flags the plan assumes that no run-script variable sets."""
    return f" --vision-chunk-patches {request.vision_chunk_patches}" if request.vision_chunk_patches else ""


def notes(plan) -> str:
    """(DP=.., recompute full): what the settings imply or add."""
    return f"(DP={plan.candidate.layout.dp}" + (", recompute full)" if plan.candidate.recompute else ")")


SBATCH = "examples/multimodal_dev/launcher/qwen35_vl.sbatch"


def command(plan, request) -> str:
    """What to run for the plan, as printed: the model, the layout, the processes on each node; on
    several nodes through the sbatch script (one launcher a node: NNODES, NODE_RANK and MASTER_ADDR come
    from the SLURM step, launcher/slurm.py)."""
    from examples.multimodal_dev.models import default_model

    flags = (f" {RECOMPUTE_FLAGS}" if plan.candidate.recompute else "") + extra_flags(request)
    in_table = request.name in default_model().variants
    model = f"MODEL_VARIANT={request.name}" if in_table else f"HF_CONFIG={shlex.quote(request.name)}"
    nodes = max(request.gpus // request.hardware.gpus_per_node, 1)
    settings = f"{model} {run_settings(plan, request)} NPROC={request.gpus // nodes}"
    if nodes == 1:
        return f"{settings} bash run_qwen35_vl.sh{flags}"
    return f"{settings} sbatch --nodes={nodes} {SBATCH}{flags}"


def no_fit_advice(result) -> str:
    """What to change when every layout was refused: memory wants more GPUs, a batch that no layout's
    data parallelism divides wants fewer GPUs or a larger --global-batch."""
    if result.refused and all(why.startswith("GBS") for why in result.refused):
        return (
            f"no layout fits: --global-batch {result.request.global_batch} is not a multiple of any layout's DP x "
            f"MBS on {result.request.gpus} GPUs; raise --global-batch or lower --gpus"
        )
    return "no layout fits: raise --gpus, lower --seq-len / --micro-batch, or allow --recompute full"


def checkpoint_line(shape, lora) -> str:
    """What one save writes, whatever the layout: bf16 weights and the trained parameters' fp32 main
    copy and Adam moments (12 bytes each); a LoRA run's saves hold its adapters alone
    (``checkpoint/adapters_only.py``), the frozen base read from the checkpoint it names."""
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.rank_params import adapter_params, stage_params

    whole = stage_params(shape, Layout(), 0)
    weights = 2 * (whole.dense + whole.expert) + 4 * whole.fp32
    if not lora:
        return (
            f"checkpoint: {(weights + 12 * whole.total) / GIB:,.1f} GiB a save (weights, fp32 main copy, Adam moments)"
        )
    adapters = adapter_params(shape, Layout(), 0, lora).total
    return (
        f"checkpoint: {14 * adapters / GIB:,.2f} GiB a save: the adapters ({adapters / 1e6:,.1f} M parameters) and "
        f"their optimizer state; the frozen base ({weights / GIB:,.1f} GiB) is read from the checkpoint it names"
    )


def describe(result, seconds: float) -> str:
    req = result.request
    hw, mix = req.hardware, req.mix
    row = mix.mean_row
    lines = [
        f"{req.name} on {req.gpus} x {hw.name} ({hw.gpus_per_node} a node): {req.usable_bytes / GIB:.1f} GiB "
        f"usable a GPU ({req.reserve:.0%} of {hw.memory_gib:g} kept back); rows of {mix.seq_len} tokens from "
        f"{mix.name} (median row: {len(row.lengths)} conversations, {len(row.grids)} images; vision "
        f"{mix.vision_share():.0%} of the FLOPs), GBS {req.global_batch} rows, MBS {req.micro_batch}; compute "
        f"at {req.efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s, links {hw.nvlink_gbs:g} GB/s NVLink, "
        f"{hw.network_gbs:g} GB/s network",
        f"{result.examined} layouts in {seconds:.1f} s; refused: "
        + (", ".join(f"{n} {why}" for why, n in sorted(result.refused.items(), key=lambda kv: -kv[1])) or "none"),
        checkpoint_line(req.shape, req.lora),
    ]
    if not result.plans:
        lines.append(no_fit_advice(result))
    for i, p in enumerate(result.plans, 1):
        m, t = p.busiest, p.time
        stage = p.memory.index(m)
        tokens = req.global_batch * mix.seq_len / t.total / req.gpus
        lines += [
            f"#{i} {p.candidate.describe()}: step {t.total:.2f} s, {p.tflops_per_gpu(req):.0f} TFLOP/s and "
            f"{tokens:,.0f} tokens/s per GPU, {p.micro_batches} micro-batches",
            f"   memory GiB, stage {stage} of {len(p.memory)} (the fullest): weights {m.weights / GIB:.1f}, gradients "
            f"{m.grads / GIB:.1f}, optimizer {m.optimizer / GIB:.1f}, activations {m.activations / GIB:.1f} "
            f"({m.per_micro_batch / GIB:.2f} a micro-batch x {m.in_flight:g} in flight"
            + (f"; recompute saves {m.recompute_saves / GIB:.1f}" if p.candidate.recompute else "")
            + ")"
            + f" = {m.total / GIB:.1f} of {req.usable_bytes / GIB:.1f}; of which vision tower {m.vision / GIB:.1f}, "
            f"MTP head {m.mtp / GIB:.1f}",
            f"   step s: compute {t.compute:.2f}, TP/SP {t.tp:.2f}, CP {t.cp:.2f}, EP {t.ep:.2f}, PP {t.pp:.2f} "
            f"(bubble {t.parts['bubble']:.2f}), DP not hidden {t.dp:.2f}, DP imbalance {t.imbalance:.2f}; "
            f"busiest stage {t.parts['busiest_stage']}",
            f"   run {notes(p)}: {command(p, req)}",
        ]
    return "\n".join(lines)


def _one_layout(request, text: str):
    """A Result holding the given layout (each recompute setting asked for), or its refusal."""
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.layout_cost import Candidate
    from examples.multimodal_dev.planner.layout_plan import Result, evaluate

    try:
        layout = Layout.parse(text)
        if "GPUS=" in text.upper() and layout.gpus != request.gpus:
            raise ValueError(f"GPUS={layout.gpus} disagrees with --gpus {request.gpus}; give the count once")
        layout = dataclasses.replace(layout, gpus=request.gpus)  # the count is --gpus'
        layout.check(request.shape)
        if layout.fsdp:
            _check_fsdp_runs(request)
    except ValueError as err:
        _fail(f"--layout {text}: " + str(err).replace(":\n  ", ": ").replace("\n  ", "; "))
    result = Result(request, [])
    for rc in request.recompute:
        p = evaluate(request, Candidate(layout, request.micro_batch, rc))
        result.examined += 1
        if p.refused:
            result.refused[f"{p.candidate.describe()}: {p.refused}"] = 1
        else:
            result.plans.append(p)
    result.plans.sort(key=lambda p: p.time.total)
    return result


def _check_fsdp_runs(request) -> None:
    """ValueError naming the flag that Megatron-FSDP does not run with (the training script's reasons)."""
    if request.lora:
        raise ValueError(f"FSDP=1 with --lora-rank {request.lora.rank}: {FSDP_REFUSALS['lora']}")
    if request.vision_chunk_patches:
        raise ValueError(
            f"FSDP=1 with --vision-chunk-patches {request.vision_chunk_patches}: {FSDP_REFUSALS['vision_chunks']}"
        )


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.docs_table:
        from examples.multimodal_dev.planner.layout_plan import plan
        from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS

        print(TABLE_HEADER)
        for name in LAYOUTS:
            args.variant, args.gpus = name, None
            print(table_row(plan(request_from_args(args), keep=1)), flush=True)
        return 0
    if not args.variant and not args.hf_config:
        _fail("give a VARIANT or --hf-config")
    from examples.multimodal_dev.planner.layout_plan import plan

    request = request_from_args(args)
    start = time.perf_counter()
    if args.layout:
        result = _one_layout(request, args.layout)
    else:
        result = plan(request, keep=args.top)
    seconds = time.perf_counter() - start
    if args.brief:
        if not result.plans:
            _fail(f"{request.name} on {args.gpus} GPUs of {request.hardware.memory_gib:g} GiB: {no_fit_advice(result)}")
        best = result.plans[0]
        print(
            f"{run_settings(best, request)} {notes(best)} on {args.gpus} GPUs: "
            f"{best.busiest.total / GIB:.1f} GiB on the fullest rank, "
            f"step {best.time.total:.2f} s, {best.tflops_per_gpu(request):.0f} TFLOP/s per GPU (predicted, "
            f"{request.hardware.name})"
        )
        return 0
    print(describe(result, seconds))
    return 0 if result.plans else 1


if __name__ == "__main__":
    sys.exit(main())

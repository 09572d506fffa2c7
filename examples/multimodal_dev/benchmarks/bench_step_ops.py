"""The host's work per training step, counted: ATen ops dispatched and host syncs, through the
production step (``run_qwen35_vl.sh``'s launch, ``megatron.training``'s ``train_step``: forward and
backward of every micro-batch, the DDP gradient hooks, the optimizer), at the structure of a GPU run.

    python -m examples.multimodal_dev.benchmarks.bench_step_ops [--runs 35b_a3b-cut,proxy] [--steps 2]
        [--peer] [--gpu-kernels] [--layouts all|NAME,...] [--details [--by-caller]] [-- extra megatron flags]

A case keeps what sets the count of ops (layer types and count, expert count and top-k, vision
depth, sequence length, micro-batches per step) and takes what does not (widths, vocabulary, the
vision token ids) from the ``tiny`` variant, so a CPU step takes seconds:

    35b_a3b-cut   35b_a3b's 3 GDN + 1 attention layers, 256 experts top-8, 27 vision blocks
    proxy         the proxy variant: 4 layers of the 397B shape, 8 experts top-2, 27 vision blocks

both at SEQ_LEN 4096, MBS 4, GBS 8 (two packed micro-batches of four conversations, as the GPU
check's training row runs). The first step builds caches and is not counted; the next ``--steps``
are, and the table gives their mean. ``benchmarks/op_counter.py`` says what a sync is.
``--layouts`` counts the step at the layouts users launch instead (``LAYOUTS``: EP, TP with SP, PP
with VPP, CP, LoRA, the planner's 35b_a3b layout shape at 4 ranks), each rank of each its own row,
counted as on Hopper where ``--gpu-kernels`` is given. The layouts run megatron-core's allgather
dispatcher on this host (gloo has no uneven all-to-all), behind the grouped experts'
``models/common/sized_dispatch.py``; an EP row without a padded capacity is ``dropless``, whose
counts are read back once a MoE layer and micro-batch.
The peer is megatron-core's own local MoE path (``SequentialMLP``, which its local spec builds
whatever ``--moe-grouped-gemm`` says): ``--peer`` runs it beside this checkout's choice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CASES = ("35b_a3b-cut", "proxy")
WARM_STEPS = 1
RUN_SETTINGS = {"SEQ_LEN": "4096", "MBS": "4", "GBS": "8", "LR": "2e-4"}
DROP_AND_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
# name -> (run script variables, megatron flags): the layouts users launch, at 2 ranks (4 for the last)
LAYOUTS = {
    "EP=2 dropless": ({"EP": "2", "NPROC": "2"}, []),
    "EP=2 drop-and-pad": ({"EP": "2", "NPROC": "2"}, DROP_AND_PAD),
    "TP=2 SP": ({"TP": "2"}, []),
    "PP=2 VPP=2": ({"PP": "2", "VP": "2"}, []),
    "CP=2": ({"CP": "2"}, []),
    "LoRA r8": ({"LORA_RANK": "8"}, []),
    # plan_layout 35b_a3b --gpus 16 (TP=1 PP=2 CP=2 EP=8) in the 4 ranks a test may start
    "PP=2 CP=2 EP=2 dropless": ({"PP": "2", "CP": "2", "EP": "2", "NPROC": "4"}, []),
    "PP=2 CP=2 EP=2 drop-and-pad": ({"PP": "2", "CP": "2", "EP": "2", "NPROC": "4"}, DROP_AND_PAD),
}


# What the op count does not depend on, taken from the tiny variant
TINY_TEXT = (
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "mrope_section",
    "vocab_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
TINY_VISION = ("hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def case_shape(name: str):
    """The case's shape: the variant's structure (4 layers, its experts, its vision depth) at the tiny
    variant's widths."""
    from examples.multimodal_dev.models import default_model

    if name not in CASES:
        raise ValueError(f"--runs: unknown case {name!r}; valid: {', '.join(CASES)}")
    get_shape = default_model().shape_fn
    shape = get_shape("35b_a3b" if name == "35b_a3b-cut" else "proxy", mtp=False)
    tiny = get_shape("tiny", moe=True, mtp=False)
    text = replace(
        shape.text,
        num_layers=4,
        layer_types=(),  # the default hybrid pattern: 3 GDN + 1 attention
        moe_ffn_hidden_size=tiny.text.moe_ffn_hidden_size,
        shared_expert_ffn_hidden_size=tiny.text.shared_expert_ffn_hidden_size,
        **{f: getattr(tiny.text, f) for f in TINY_TEXT},
    )
    vision = replace(shape.vision, **{f: getattr(tiny.vision, f) for f in TINY_VISION})
    return replace(shape, text=text, vision=vision, **{f: getattr(tiny, f) for f in TOKEN_IDS})


def _launch_args(hf_config: str, steps: int, settings: dict, extra: list[str]) -> tuple[int, list[str]]:
    """(processes, pretrain_multimodal's flags) for the case, as the run script would give them on this host."""
    from examples.multimodal_dev.launcher import launch
    from examples.multimodal_dev.launcher.from_env import Host
    from examples.multimodal_dev.launcher.variables import NAMES

    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env.update(RUN_SETTINGS, HF_CONFIG=hf_config, TRAIN_ITERS=str(WARM_STEPS + steps), **settings)
    host = Host(gpu=launch.has_gpu(), transformer_engine=launch.te_imports)
    plan = launch.prepare(env, [], host, launch.Launch())
    module = plan.torchrun.index("--module")
    nproc = int(plan.torchrun[plan.torchrun.index("--nproc-per-node") + 1])
    return nproc, plan.torchrun[module + 2 :] + ["--mock-text-tokens", "1024", "--eval-iters", "0", *extra]


def count_case(name: str, steps: int, settings: dict, extra: list[str]) -> dict:
    """Launch one single-rank run of the case under the counter; its summary."""
    summaries = count_ranks(name, steps, settings, extra)
    if len(summaries) != 1:
        raise SystemExit(f"bench_step_ops: {settings} starts {len(summaries)} ranks; count it with --layouts")
    return summaries[0]


def count_ranks(name: str, steps: int, settings: dict, extra: list[str]) -> list[dict]:
    """Launch one run of the case under the counter, at the layout ``settings`` give; each rank's summary."""
    from examples.multimodal_dev.models import default_model

    with tempfile.TemporaryDirectory(prefix="bench_step_ops_") as tmp:
        hf_config = os.path.join(tmp, "config.json")
        with open(hf_config, "w") as f:
            json.dump(default_model().shape_to_hf(case_shape(name)), f)
        out = os.path.join(tmp, "counts")
        nproc, flags = _launch_args(hf_config, steps, settings, extra)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
        command += ["--module", "examples.multimodal_dev.benchmarks.bench_step_ops", "--worker", out, *flags]
        worker_env = {**os.environ, **{k: v for k, v in settings.items() if k.startswith("BENCH_")}}
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=worker_env)
        files = [f"{out}.{rank}.json" for rank in range(nproc)]
        if done.returncode != 0 or not all(os.path.exists(f) for f in files):
            raise SystemExit(f"bench_step_ops: the {name} run failed:\n{(done.stdout + done.stderr)[-4000:]}")
        summaries = []
        for path in files:
            with open(path) as f:
                summaries.append(json.load(f))
        return summaries


def gpu_kernels_as_calls(tally, hopper: bool = False) -> None:
    """Count each CPU stand-in for a fused GPU kernel as that one kernel: Gated DeltaNet's three FLA
    kernels (megatron.cpu's torch kernels on this host), the THD attention (a loop of SDPA calls
    per packed sample here, one varlen flash kernel on a GPU in bf16) and RMSNorm (torch's
    ``rms_norm`` is composite on a CPU, ``aten._fused_rms_norm`` on CUDA). ``hopper``: the chunked rule
    stays on the torch kernel, as on a Hopper GPU with the Triton that miscompiles FLA's (see
    ``megatron.cpu.torch_gdn_kernel_names``). Bound before the model is built: GatedDeltaNet keeps its
    rule function from construction."""
    import torch
    from megatron.core.ssm.gated_delta_net import common, gdn

    import megatron.cpu
    from examples.multimodal_dev.models.common import sdpa_attention
    from examples.multimodal_dev.models.common.sdpa_attention import SDPACoreAttention

    from .op_counter import as_one_kernel

    megatron.cpu.activate()  # binds the torch kernels first; main() finds it done
    rule, conv, norm = gdn.chunk_gated_delta_rule, gdn.causal_conv1d, common.l2norm

    def chunk_gated_delta_rule(q, k, v, g, beta, **kw):
        if hopper or kw.get("output_final_state") or kw.get("initial_state") is not None:
            return rule(q, k, v, g, beta, **kw)
        return as_one_kernel(tally, "fla_chunk_gated_delta_rule", lambda *t: rule(*t, **kw)[0], q, k, v, g, beta), None

    def causal_conv1d(x, weight, bias=None, **kw):
        return as_one_kernel(tally, "fla_causal_conv1d", lambda *t: conv(*t, **kw)[0], x, weight, bias), None

    def l2norm(x, *a, **kw):
        return as_one_kernel(tally, "fla_l2norm", lambda t: norm(t, *a, **kw), x)

    for module in (common, gdn):
        module.chunk_gated_delta_rule, module.causal_conv1d, module.l2norm = (
            chunk_gated_delta_rule,
            causal_conv1d,
            l2norm,
        )
    per_sample = SDPACoreAttention._forward_thd

    def forward_thd(self, query, key, value, params, causal):
        self._segments(params)  # the host's read of the segments stays counted: varlen reads them too
        return as_one_kernel(
            tally, "varlen_attention", lambda *t: per_sample(self, *t, params, causal), query, key, value
        )

    SDPACoreAttention._forward_thd = forward_thd
    # under CP the same kernel takes each local query chunk against its key prefix (cp_varlen.py)
    SDPACoreAttention._cp_takes_varlen = lambda self, query: True
    sdpa_attention.torch_varlen = lambda: _segment_pairs_as_one_kernel(tally)
    rms_norm = torch.nn.functional.rms_norm

    def fused_rms_norm(x, shape, weight=None, eps=None):
        return as_one_kernel(tally, "fused_rms_norm", lambda *t: rms_norm(t[0], shape, t[1], eps), x, weight)

    torch.nn.functional.rms_norm = fused_rms_norm


def _segment_pairs_as_one_kernel(tally):
    """A stand-in for torch's varlen kernel with key segments of their own (causal aligned to each
    segment's last key, as flash's), counted as the one kernel: SDPA per segment on this host."""
    import torch

    from examples.multimodal_dev.models.common.batch_memo import on_host

    from .op_counter import as_one_kernel

    def attend(q, k, v, cu_q, max_q, causal, scale, cu_k, max_k):
        q_bounds, k_bounds = on_host(cu_q).tolist(), on_host(cu_k).tolist()  # the kernel reads neither

        def run(q, k, v):
            outs = []
            for qa, qb, ka, kb in zip(q_bounds[:-1], q_bounds[1:], k_bounds[:-1], k_bounds[1:]):
                keep = torch.arange(kb - ka)[None] <= torch.arange(qb - qa)[:, None] + (kb - ka) - (qb - qa)
                heads = [t.transpose(0, 1)[None] for t in (q[qa:qb], k[ka:kb], v[ka:kb])]
                heads[1:] = [t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in heads[1:]]
                out = torch.nn.functional.scaled_dot_product_attention(
                    *heads, attn_mask=keep if causal else None, scale=scale
                )
                outs.append(out[0].transpose(0, 1))
            return torch.cat(outs)

        return as_one_kernel(tally, "varlen_attention", run, q, k, v)

    return attend


def worker(out: str) -> None:
    """Inside torchrun: count every train_step after the warm-up ones, then write the summary."""
    import megatron.training.training as training

    from examples.multimodal_dev import pretrain_multimodal

    from .op_counter import StepTally

    tally, calls = StepTally(by_caller=os.environ.get("BENCH_STEP_OPS_BY_CALLER") == "1"), [0]
    kernels = os.environ.get("BENCH_STEP_OPS_GPU_KERNELS")
    if kernels:
        gpu_kernels_as_calls(tally, hopper=kernels == "hopper")
    original = training.train_step

    def counted_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= WARM_STEPS:
            return original(*args, **kwargs)
        with tally.counting():
            return original(*args, **kwargs)

    training.train_step = counted_step
    pretrain_multimodal.main()
    with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(tally.summary(), f)


def _row(name: str, label: str, s: dict) -> str:
    return f"| {name} | {label} | {s['ops_per_step']:,.0f} | {s['syncs_per_step']:.0f} |"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        sys.argv = [sys.argv[0], *argv[2:]]
        worker(argv[1])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(CASES), help=f"cases, comma-separated: {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=2, help="counted steps after the warm-up one")
    parser.add_argument("--peer", action="store_true", help="also count megatron-core's SequentialMLP path")
    parser.add_argument("--details", action="store_true", help="print the top ops and every sync's caller")
    parser.add_argument("--by-caller", action="store_true", help="with --details: the lines that dispatch most ops")
    parser.add_argument(
        "--gpu-kernels",
        action="store_true",
        help="also count with the CPU stand-ins for FLA's kernels and varlen attention as one op each, "
        "and as on Hopper, where the chunked rule stays on torch's kernels",
    )
    parser.add_argument(
        "--layouts", default="", help=f"'all' or layouts, comma-separated, one row a rank: {', '.join(LAYOUTS)}"
    )
    parser.add_argument("extra", nargs="*", help="megatron flags added to the launch (after --)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: count at least one step")
    layouts = list(LAYOUTS) if args.layouts == "all" else [n for n in args.layouts.split(",") if n]
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts {args.layouts}: no layout {unknown[0]!r}; the layouts are all, {', '.join(LAYOUTS)}")
    if args.by_caller:
        os.environ["BENCH_STEP_OPS_BY_CALLER"] = "1"  # read by the worker
    if layouts:
        return count_layouts(args, layouts)
    contenders = {"this checkout": {}}
    if args.peer:
        contenders["megatron-core SequentialMLP"] = {"GROUPED_EXPERTS": "0"}
    if args.gpu_kernels:
        contenders["this checkout, GPU kernels as calls"] = {"BENCH_STEP_OPS_GPU_KERNELS": "1"}
        contenders["this checkout, as on Hopper (chunked rule on torch)"] = {"BENCH_STEP_OPS_GPU_KERNELS": "hopper"}
    print("| case | experts | ATen ops / step | host syncs / step |")
    print("|---|---|---|---|")
    for name in [r for r in args.runs.split(",") if r]:
        results = {}
        for label, settings in contenders.items():
            results[label] = count_case(name, args.steps, settings, args.extra)
            print(_row(name, label, results[label]), flush=True)
        if args.peer:
            ours, peer = results["this checkout"], results["megatron-core SequentialMLP"]
            print(f"|  | ratio (peer / ours) | {peer['ops_per_step'] / ours['ops_per_step']:.1f}x | |", flush=True)
        if args.details:
            for label, s in results.items():
                _print_details(f"{name}, {label}", s)
    return 0


def _print_details(title: str, summary: dict) -> None:
    """--details: the run's top ops, the lines that dispatch most (with --by-caller) and every sync's caller."""
    print(f"\n{title}: top ops {summary['top_ops']}", file=sys.stderr)
    for where, count in summary["callers"]:
        print(f"  {count:8.1f}  ops at {where}", file=sys.stderr)
    for kind, where, count in summary["syncs"]:
        print(f"  {count:8.1f}  {kind:28s} {where}", file=sys.stderr)


def _data_parallel(settings: dict) -> int:
    """The layout's DP size: its global batch grows with it, so every rank steps through the two
    micro-batches the single rank does."""
    nproc = int(settings.get("NPROC") or 1)
    model_parallel = 1
    for size in ("TP", "PP", "CP"):
        model_parallel *= int(settings.get(size) or 1)
    return max(1, nproc // model_parallel)


def count_layouts(args, layouts: list[str]) -> int:
    """One row a case, layout and rank, counted as on Hopper with --gpu-kernels (else as run here)."""
    kernels = {"BENCH_STEP_OPS_GPU_KERNELS": "hopper"} if args.gpu_kernels else {}
    counted = "as on Hopper" if args.gpu_kernels else "as run on this host"
    print(f"| case | layout, rank ({counted}) | ATen ops / step | host syncs / step |")
    print("|---|---|---|---|")
    for name in [r for r in args.runs.split(",") if r]:
        for layout in layouts:
            settings, flags = LAYOUTS[layout]
            settings = {**settings, **kernels, "GBS": str(int(RUN_SETTINGS["GBS"]) * _data_parallel(settings))}
            for rank, summary in enumerate(count_ranks(name, args.steps, settings, [*flags, *args.extra])):
                print(_row(name, f"{layout}, rank {rank}", summary), flush=True)
                if args.details:
                    _print_details(f"{name}, {layout}, rank {rank}", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

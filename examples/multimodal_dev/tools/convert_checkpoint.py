"""Hugging Face <-> Megatron checkpoints for Qwen3.5-VL, with a logit check.

    python -m examples.multimodal_dev.tools.convert_checkpoint import --hf-path HF --megatron-path CKPT
    python -m examples.multimodal_dev.tools.convert_checkpoint verify --hf-path HF --megatron-path CKPT
    python -m examples.multimodal_dev.tools.convert_checkpoint export --megatron-path CKPT --hf-path OUT \
        [--hf-processor-path HF] [--moe-layout packed]
    python -m examples.multimodal_dev.tools.convert_checkpoint export-peft --megatron-path CKPT --peft-path OUT \
        [--base-model-name-or-path NAME]

import   Hugging Face directory -> Megatron checkpoint (iteration 0, torch_dist, resharded to any
         TP/EP/PP by the run that loads it; ``--ckpt-format fsdp_dtensor`` for FSDP=1 runs)
export   Megatron checkpoint saved at any layout -> Hugging Face directory (config.json, sharded
         safetensors, tokenizer/processor files); a LoRA run's adapters merged into the base weights
export-peft  a LoRA run's checkpoint -> Hugging Face PEFT adapter (adapter_config.json,
         adapter_model.safetensors) for transformers' model of the base (``checkpoint/peft_adapter.py``)
verify   the HF model and the Megatron checkpoint (CPU, fp32) on the same deterministic text-only and
         image+text batches (or ``--prompt``/``--image``); exit 1 above ``--atol``. ``--hf-path`` and
         ``--hf-processor-path`` are local folders that must exist, or ``hf://NAME`` for the Hub

A user's mistake (a missing path, a damaged or foreign file, two models that differ) is one line,
``convert_checkpoint COMMAND: error: ...``, with exit status 2.

The work is done by ``checkpoint/hf_import.py``, ``hf_export.py``, ``peft_adapter.py`` and
``verify.py``; this file is the command. It runs on the CPU (it hides GPUs from itself) and holds a
bounded part of the model at any time (a tensor, a decoder layer in verify), not the model: the 397B
converts on a host with tens of GB. Long work prints a progress line (tensors, bytes, rate, time
left) on stderr. ``--help`` imports nothing heavy: torch and megatron-core load after the arguments
are read.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

if __name__ == "__main__":
    # Run as a command, conversion is a CPU job: hide GPUs before torch is imported. Imported as a
    # module (tests), it changes nothing in the importing process.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from examples.multimodal_dev.checkpoint.adapters_only import LORA_BASE_HELP
from examples.multimodal_dev.checkpoint.choices import CKPT_FORMATS, DTYPE_NAMES, MOE_LAYOUTS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> Megatron checkpoint (iteration 0)")
    imp.add_argument("--hf-path", required=True)
    imp.add_argument("--megatron-path", required=True)
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel size you will train with (checked)")
    imp.add_argument("--ep", type=int, default=1, help="expert-parallel size you will train with (checked)")
    imp.add_argument("--overwrite", action="store_true")
    imp.add_argument(
        "--allow-mixed-dtypes",
        action="store_true",
        help="import tensors stored in another dtype than the checkpoint's as they are",
    )
    imp.add_argument(
        "--ckpt-format",
        choices=CKPT_FORMATS,
        default="torch_dist",
        help="fsdp_dtensor for runs with FSDP=1 (Megatron-FSDP reads only its own format)",
    )
    exp = sub.add_parser("export", help="Megatron checkpoint (any TP/EP) -> Hugging Face directory")
    exp.add_argument("--megatron-path", required=True)
    exp.add_argument("--hf-path", required=True)
    exp.add_argument("--hf-processor-path", default=None, help="copy tokenizer/processor files from here")
    exp.add_argument("--hf-config-path", default=None, help="config.json to describe the model (else inferred)")
    exp.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="cast every tensor (default: as stored)")
    exp.add_argument("--max-shard-size-gb", type=float, default=2.0)
    exp.add_argument(
        "--moe-layout",
        choices=MOE_LAYOUTS,
        default="per-expert",
        help="MoE experts one tensor per expert as on the hub (default) or packed [E, ...]",
    )
    exp.add_argument("--overwrite", action="store_true")
    exp.add_argument("--lora-base", default=None, help=LORA_BASE_HELP)
    peft = sub.add_parser("export-peft", help="a LoRA run's checkpoint -> Hugging Face PEFT adapter")
    peft.add_argument("--megatron-path", required=True)
    peft.add_argument("--peft-path", required=True, help="folder for adapter_config.json and adapter_model.safetensors")
    peft.add_argument(
        "--base-model-name-or-path",
        default=None,
        help="the base model's Hub name or folder, recorded in adapter_config.json for PEFT to find it",
    )
    peft.add_argument("--hf-config-path", default=None, help="config.json to describe the model (else inferred)")
    peft.add_argument("--overwrite", action="store_true")
    peft.add_argument("--lora-base", default=None, help=LORA_BASE_HELP)
    ver = sub.add_parser("verify", help="logits of the Megatron checkpoint against the Hugging Face model")
    ver.add_argument("--hf-path", required=True, help="local Hugging Face folder, or hf://NAME for the Hub")
    ver.add_argument("--megatron-path", required=True)
    ver.add_argument("--atol", type=float, default=1e-3, help="largest allowed |logit difference| (fp32)")
    ver.add_argument("--prompt", default=None, help="text to run instead of the built-in batches")
    ver.add_argument("--image", default=None, help="an image file to go with --prompt")
    ver.add_argument(
        "--hf-processor-path", default=None, help="processor for --prompt (default: --hf-path); local, or hf://NAME"
    )
    ver.add_argument("--lora-base", default=None, help=LORA_BASE_HELP)
    return parser


def check_args(args) -> None:
    """Sizes and tolerances that cannot work, and a file given where a folder is meant: ``ValueError``
    naming the flag, before any file is read."""
    for flag, value in (("--tp", getattr(args, "tp", 1)), ("--ep", getattr(args, "ep", 1))):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.command == "export" and not 0 < args.max_shard_size_gb < math.inf:
        raise ValueError(f"--max-shard-size-gb {args.max_shard_size_gb}: must be a positive finite number")
    if args.command == "verify" and not 0 <= args.atol < math.inf:
        raise ValueError(f"--atol {args.atol}: must be a finite number at least 0")
    if args.command in ("import", "verify") and os.path.isfile(args.hf_path):
        raise ValueError(f"--hf-path {args.hf_path}: a file; give the Hugging Face model's folder")


def peft_summary(info: dict, out: str) -> str:
    """export-peft's line: what went where, and what PEFT could not carry as the run had it."""
    parameters = f" and {info['expert_parameters']} expert parameters" if info["expert_parameters"] else ""
    line = (
        f"export-peft: {info['adapters']} LoRA adapters as {info['linears']} transformers linears{parameters}, "
        f"r={info['rank']} lora_alpha={info['alpha']:g}; target_modules {','.join(info['target_modules'])}"
    )
    if info["target_parameters"]:
        line += f"; target_parameters {','.join(info['target_parameters'])}"
    if info["dropout"] != info["run_dropout"]:
        line += (
            f"; lora_dropout {info['dropout']:g}, not the run's {info['run_dropout']:g}: PEFT's expert "
            "adapters take no dropout (inference is the same)"
        )
    if info.get("base"):  # the Megatron checkpoint the run trained the adapters on: load them on its export
        line += f"; trained on {info['base']}"
    return f"{line} -> {out}"


def _run(args) -> int:
    from examples.multimodal_dev.checkpoint.hf_export import export_hf
    from examples.multimodal_dev.checkpoint.hf_import import import_hf
    from examples.multimodal_dev.checkpoint.peft_adapter import export_peft
    from examples.multimodal_dev.checkpoint.verify import verify

    if args.command == "verify":
        return 0 if verify(args) else 1
    if args.command == "import":
        info = import_hf(
            args.hf_path,
            args.megatron_path,
            args.tp,
            args.ep,
            args.overwrite,
            args.allow_mixed_dtypes,
            args.ckpt_format,
        )
        print(
            f"import: {info['tensors']} Megatron tensors, {info['parameters'] / 1e6:.1f} M parameters "
            f"{info['dtypes']} -> {args.megatron_path} (iteration 0, {args.ckpt_format})"
        )
    elif args.command == "export":
        info = export_hf(
            args.megatron_path,
            args.hf_path,
            args.hf_processor_path,
            args.hf_config_path,
            args.dtype,
            int(args.max_shard_size_gb * 1024**3),
            args.overwrite,
            args.moe_layout,
            args.lora_base,
        )
        merged = f", merged {info['merged_adapters']} LoRA adapters" if info["merged_adapters"] else ""
        print(
            f"export: {info['bytes'] / 1e6:.1f} MB in {info['shards']} shard(s), "
            f"{info['processor_files']} processor file(s){merged} -> {args.hf_path}"
        )
    else:
        info = export_peft(
            args.megatron_path,
            args.peft_path,
            args.base_model_name_or_path,
            args.hf_config_path,
            args.overwrite,
            args.lora_base,
        )
        print(peft_summary(info, args.peft_path))
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)  # before torch or megatron-core is imported: --help is instant
    try:
        check_args(args)
    except ValueError as err:
        print(f"convert_checkpoint {args.command}: error: {err}", file=sys.stderr)
        return 2
    from safetensors import SafetensorError

    from megatron.cpu.host_tuning import return_freed_host_memory

    return_freed_host_memory()  # the tools read tensors once each: freed memory goes back at once
    try:
        return _run(args)
    except (OSError, SafetensorError, ValueError, KeyError) as err:  # OSError: not found, exists, cannot write
        print(f"convert_checkpoint {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

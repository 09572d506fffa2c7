"""``convert_checkpoint import``: a Hugging Face directory -> a Megatron checkpoint (iteration 0), one
tensor at a time.

Everything that can be checked from the names, shapes and dtypes in the safetensors headers is
checked before a byte is written: every HF tensor the mapping expects is there, every HF tensor is
consumed, every Megatron tensor is filled, each has the model's shape (the mapping's transforms run on
meta tensors to find out), and no tensor has a dtype of its own (``allow_mixed_dtypes`` lets them
through). Then the checkpoint is written by megatron-core's torch_dist layout (or Megatron-FSDP's
``fsdp_dtensor``) with each Megatron tensor converted from its HF tensors when the writer reaches it
(``streamed_save.py``): the process holds one expert, one fused weight at a time, whatever the
model's size. A tensor holding NaN or inf is only seen when it is read; the import then finishes
reading (to name every such tensor) and stops before the checkpoint replaces anything.

Tensors keep their dtype (a bf16 checkpoint's fp32 ``A_log`` stays fp32). The checkpoint is written
unsharded; torch_dist reshards it to the TP/EP of the run that loads it, and ``tp``/``ep`` check up
front that the model splits that way. A write that fails (a full disk, an interrupt) removes every
file and folder the import created, keeps what was there before, and says why in one line.

A checkpoint without an MTP head (``mtp.*``) whose config.json still counts one, as transformers'
``save_pretrained`` writes every Qwen3.5 fine-tuned on the Hugging Face side, is imported without it,
said in one line; its ``hf_config.json`` then says ``mtp_num_hidden_layers: 0``, so training from it
runs without MTP (``MTP=1`` trains a head started afresh). Any other missing tensor is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter

import torch

from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.models.megatron_args import one_process_checkpoint_args

from ..progress import Progress
from .choices import CKPT_FORMATS
from .files import TRACKER, iteration_dir, save_model_checkpoint
from .hf_conversion import DTYPES, HF_CONFIG, config_shape
from .hf_safetensors import HFTensorSource
from .weightless_model import put_parameter, weightless_model
from .writer_errors import WriterLog, causes

MTP_PREFIX = "mtp."


class ImportWriteError(OSError):
    """An import that could not be written; the message is one line with the path and the cause."""


class _NonFinite(ValueError):
    """HF tensors holding NaN or inf, found once every tensor was read; nothing is kept."""


def _checkpoint_dtype(config: dict, source: HFTensorSource) -> tuple[torch.dtype, str]:
    """(the checkpoint's dtype, where it was read): config.json's, else most of its tensors'."""
    text = config.get("text_config", {})
    name = next((c[k] for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    where = "config.json"
    if name is None:
        counts = Counter(source.dtypes.values())
        name, where = (counts.most_common(1)[0][0] if counts else "float32"), "most of its tensors"
    if name not in DTYPES:
        raise ValueError(f"--hf-path {source.hf_dir}: dtype {name!r} ({where}) is not one of {', '.join(DTYPES)}")
    return DTYPES[name], where


def _check_dtypes(source: HFTensorSource, dtype: torch.dtype, where: str, shape) -> None:
    """A tensor stored in a dtype of its own (one fp16 tensor in a bf16 checkpoint) is a conversion
    accident upstream; imported as is it would train in that dtype unnoticed."""
    expected = str(dtype).removeprefix("torch.")
    odd = {
        n: d
        for n, d in sorted(source.dtypes.items())
        if d != expected and not (d == "float32" and n.endswith(model_of(shape).hf_fp32_suffixes))
    }
    if odd:
        listed = ", ".join(f"{n} is {d}" for n, d in list(odd.items())[:5])
        more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
        raise ValueError(
            f"--hf-path {source.hf_dir}: {len(odd)} tensor(s) not in the checkpoint's dtype {expected} "
            f"({where}): {listed}{more}; pass --allow-mixed-dtypes to import them as stored"
        )


def without_absent_mtp(config: dict, source: HFTensorSource, hf_path: str) -> tuple[dict, str | None]:
    """(config.json as the import describes it, a line saying what was left out or None): a config
    counting an MTP head whose files hold no ``mtp.*`` tensor at all describes a model without one."""
    layers = config.get("text_config", {}).get("mtp_num_hidden_layers", 0)
    if not layers or any(n.startswith(MTP_PREFIX) for n in source.names):
        return config, None
    text = {**config["text_config"], "mtp_num_hidden_layers": 0}
    note = (
        f"import: {hf_path} holds no MTP head (no {MTP_PREFIX}* tensor) though its config.json says "
        f"mtp_num_hidden_layers {layers}, as transformers' save_pretrained writes Qwen3.5; imported without "
        f"it ({HF_CONFIG} says 0): training runs without MTP, MTP=1 trains a new head"
    )
    return {**config, "text_config": text}, note


def _plan(model, rules, source: HFTensorSource, shape) -> tuple[dict, list[str]]:
    """({Megatron name: (its rule, its place among the rule's outputs)}, the problems found), from the
    names, shapes and dtypes alone; the weightless model's parameters take the dtype each is stored in."""
    params = dict(model.named_parameters())
    planned, missing_hf, bad_shape, read = {}, [], [], []
    for rule in rules:
        absent = [n for n in rule.hf if n not in source]
        if absent:
            missing_hf += absent
            continue
        read += rule.hf
        for i, (name, meta) in enumerate(zip(rule.megatron, rule.to_megatron([source.meta(n) for n in rule.hf]))):
            if name not in params:
                bad_shape.append(f"{name}: not a parameter of the model")
            elif meta.shape != params[name].shape:
                bad_shape.append(f"{name}: HF gives {tuple(meta.shape)}, the model has {tuple(params[name].shape)}")
            else:
                put_parameter(model, name, torch.empty(meta.shape, dtype=meta.dtype, device="meta"))
                planned[name] = (rule, i)
    if shape.text.tie_word_embeddings and "lm_head.weight" in source:
        read.append("lm_head.weight")  # the tied head is the embedding itself; no need to read it
    problems = []
    for title, names in (
        ("HF tensors expected by the mapping but absent", missing_hf),
        ("HF tensors not consumed", source.unconsumed(read)),
        ("Megatron tensors not filled", sorted(set(params) - set(planned))),
        ("shape mismatches", bad_shape),
    ):
        if names:
            problems.append(f"{title} ({len(names)}):\n    " + "\n    ".join(names))
    return planned, problems


def import_hf(
    hf_path: str,
    megatron_path: str,
    tp: int = 1,
    ep: int = 1,
    overwrite: bool = False,
    allow_mixed_dtypes: bool = False,
    ckpt_format: str = "torch_dist",
) -> dict:
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"--ckpt-format {ckpt_format!r}: not one of {', '.join(CKPT_FORMATS)}")
    source = HFTensorSource(hf_path)
    config, mtp_note = without_absent_mtp(source.config(), source, hf_path)
    shape = config_shape(config, os.path.join(hf_path, "config.json"))
    model_of(shape).validate_parallel(shape, tp=tp, ep=ep)
    if os.path.exists(os.path.join(megatron_path, TRACKER)) and not overwrite:
        raise FileExistsError(
            f"--megatron-path {megatron_path} already holds a checkpoint; pass --overwrite to replace it"
        )
    dtype, where = _checkpoint_dtype(config, source)
    if not allow_mixed_dtypes:
        _check_dtypes(source, dtype, where, shape)
    model = weightless_model(shape)
    planned, problems = _plan(model, model_of(shape).hf_mapping_rules(shape, per_expert=True), source, shape)
    if problems:
        raise ValueError(f"import {hf_path}: nothing written.\n  " + "\n  ".join(problems))
    if mtp_note:
        print(mtp_note, flush=True)
    params = dict(model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    with Progress("import", len(planned), total) as progress:
        fill = _filler(planned, source, progress, hf_path)
        _write_import(megatron_path, config, shape, model, ckpt_format, fill)
    dtypes: dict[str, int] = {}
    for p in params.values():
        dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + p.numel()
    return {"tensors": len(planned), "parameters": sum(dtypes.values()), "dtypes": dtypes, "mtp_note": mtp_note}


def _filler(planned: dict, source: HFTensorSource, progress: Progress, hf_path: str):
    """``fill(name)``: Megatron tensor ``name`` from its HF tensors. Once every tensor is filled, HF
    tensors seen holding NaN or inf stop the import (``_NonFinite``) before the checkpoint is kept."""
    filled: set[str] = set()
    warned: list[str] = []

    def fill(name: str) -> torch.Tensor:
        rule, i = planned[name]
        tensor = rule.to_megatron([source.get(n) for n in rule.hf])[i].contiguous()
        filled.add(name)
        progress.advance(tensor.numel() * tensor.element_size())
        if source.nonfinite and not warned:
            warned.append(name)
            first = next(iter(source.nonfinite))
            print(f"import: {first} holds NaN or inf; the import stops once every tensor is read", flush=True)
        if len(filled) == len(planned) and source.nonfinite:
            listed = [f"{n}: {nan} NaN, {inf} inf" for n, (nan, inf) in sorted(source.nonfinite.items())]
            raise _NonFinite(
                f"import {hf_path}: nothing written.\n  HF tensors holding NaN or inf ({len(listed)}):\n    "
                + "\n    ".join(listed)
            )
        return tensor

    return fill


def _save_import(megatron_path: str, config: dict, shape, model, ckpt_format: str, fill) -> None:
    """``hf_config.json`` and iteration 0. The config goes to a file of its own first and replaces
    an earlier one only at the end, so a failed import leaves the earlier one as it was. In
    ``fsdp_dtensor`` the args say what a Megatron-FSDP run of the checkpoint's dtype would."""
    os.makedirs(megatron_path, exist_ok=True)
    final_config = os.path.join(megatron_path, HF_CONFIG)
    with open(final_config + ".partial", "w") as f:
        json.dump(config, f, indent=2)
    # as the run script's default FSDP=1 run of this model: bf16 as the weights, grouped experts for MoE
    weights = {p.dtype for p in model.parameters()}
    fsdp = {"use_megatron_fsdp": True, "bf16": torch.bfloat16 in weights, "moe_grouped_gemm": shape.text.is_moe}
    args = one_process_checkpoint_args(
        shape,
        megatron_path,
        os.path.abspath(final_config),
        ckpt_format=ckpt_format,
        **(fsdp if ckpt_format == "fsdp_dtensor" else {}),
    )
    save_model_checkpoint(args, 0, model, fill)
    os.replace(final_config + ".partial", final_config)


def _os_error_cause(err: BaseException, logged: list[str]) -> str | None:
    """The file system's reason for ``err`` ("No space left on device (PATH)"), or None when the
    failure is not the file system's. DCP wraps writer errors in its CheckpointException (a
    BaseException whose ``failures`` hold them), so the chain is searched, then the writer's log."""
    for e in causes(err):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror + (f" ({e.filename})" if e.filename else "")
    for text in [*logged, str(err)]:
        found = re.search(r"\[Errno \d+\] ([^:'\"\n]+)(?:: '([^']*)')?", text)
        if found:
            return found.group(1).strip() + (f" ({found.group(2)})" if found.group(2) else "")
    return None


def _write_import(megatron_path: str, config: dict, shape, model, ckpt_format: str, fill) -> None:
    """Writes the import; a failure at any point (a full disk, an interrupt, a NaN) removes every file
    and directory this import created and keeps everything that was there before."""
    candidates = [
        megatron_path,
        os.path.join(megatron_path, HF_CONFIG + ".partial"),
        iteration_dir(megatron_path, 0),
        iteration_dir(megatron_path, 0) + ".partial",
        os.path.join(megatron_path, TRACKER),
        os.path.join(megatron_path, TRACKER + ".tmp"),
    ]
    existed = {p for p in candidates if os.path.lexists(p)}
    writer_log = WriterLog()
    try:
        with writer_log:
            _save_import(megatron_path, config, shape, model, ckpt_format, fill)
    except BaseException as err:
        for path in reversed(candidates):  # the directory last: it is removed only if it is new
            if path in existed or not os.path.lexists(path):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        nonfinite = next((e for e in causes(err) if isinstance(e, _NonFinite)), None)
        if nonfinite is not None:
            raise ValueError(str(nonfinite)) from None
        cause = _os_error_cause(err, writer_log.lines)
        if cause is None:
            raise
        raise ImportWriteError(
            f"--megatron-path {megatron_path}: cannot write the checkpoint: {cause}; nothing left behind"
        ) from None

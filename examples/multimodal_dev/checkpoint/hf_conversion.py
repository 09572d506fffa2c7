"""Hugging Face <-> Megatron checkpoints for Qwen3.5-VL: the library behind
``tools/convert_checkpoint.py`` (its docstring has the commands).

import   reads config.json and the safetensors (one file or shards with an index; per-expert or
         packed MoE experts), maps every tensor through ``hf_mapping`` and writes iteration 0 in
         the training checkpoint layout (torch_dist, ``latest_checkpointed_iteration.txt``), plus
         ``hf_config.json`` so training and export know the shape. Tensors keep their dtype (a
         bf16 checkpoint's fp32 ``A_log`` stays fp32); a tensor in another dtype than config.json's
         (or, without one, most tensors') is refused by name unless ``allow_mixed_dtypes``, and so
         is a tensor holding NaN or inf. Streaming: the model is allocated once in
         the checkpoint's dtype and each HF tensor replaces its random initial value as it is read.
         The checkpoint is written unsharded; torch_dist reshards it to the TP/EP of the run that
         loads it, and ``tp``/``ep`` check up front that the model splits that way. A write that
         fails (a full disk, an interrupt) removes every file and folder the import created, keeps
         what was there before, and says why in one line.
export   loads a checkpoint saved at any TP/EP (an import or a training run), writes config.json,
         sharded safetensors with an index, each tensor in the dtype the checkpoint stored it in
         (or ``dtype``), and copies tokenizer/processor files. MoE experts are written one tensor
         per expert as the hub's checkpoints store them (``...experts.{e}.gate_proj.weight``), or
         packed as transformers holds them in memory (``moe_layout="packed"``). Written to
         ``OUT.partial`` and renamed at the end; a write that fails (a file in the way, a read-only
         place, a full disk) removes ``OUT.partial`` and says why in one line. An output equal to,
         above or inside the checkpoint is refused before anything is written. The checkpoint must
         be torch_dist or Megatron-FSDP's fsdp_dtensor with an intact tracker; legacy per-rank
         pickles and planted code are refused.

Conversion runs on the CPU: it needs host memory for one copy of the model, not a GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections import Counter

import torch
from safetensors import SafetensorError

from examples.multimodal_dev.models import DEFAULT_ARCH, get_model_entry, model_of
from examples.multimodal_dev.models.megatron_args import one_process_checkpoint_args

from ..megatron_changes import apply
from . import fsdp_weights
from .adapters_only import ADAPTERS_ONLY, base_to_read, is_model_key
from .files import (
    TRACKER,
    checkpoint_directory,
    is_fsdp_dtensor,
    iteration_dir,
    load_model_weights,
    save_model_checkpoint,
    stored_args,
)
from .hf_models import hf_classes
from .hf_safetensors import INDEX, HFTensorSource, ShardedWriter, per_expert, read_config
from .lora_checkpoint import MergedState, adapted_linears, attach_adapters, stored_lora
from .run_shape import resolve_shape
from .safety import check_tracker, refusal
from .writer_errors import WriterLog, causes

HF_CONFIG = "hf_config.json"  # the source config.json, kept next to the converted checkpoint
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weights and what describes them; everything else in a processor directory is copied on export.
_NOT_PROCESSOR_FILES = (".safetensors", ".bin", ".pt", ".pth", INDEX, "config.json", "generation_config.json")
# How export writes MoE experts: one tensor per expert, as the hub's checkpoints and serving stacks
# store them, or packed [E, ...] as transformers holds them in memory.
MOE_LAYOUTS = ("per-expert", "packed")
# What an import writes: megatron's sharded format (DDP and the distributed optimizer), or Megatron-FSDP's,
# the only one an FSDP=1 run reads (megatron-core 0.19.2 reads neither into the other's runs)
CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")


class ExportWriteError(OSError):
    """An export that could not be written; the message is one line with the path and the cause."""


class ImportWriteError(OSError):
    """An import that could not be written; the message is one line with the path and the cause."""


class CheckpointReadError(ValueError):
    """A Megatron checkpoint that cannot be read as one; the message is one line naming the file."""


def config_shape(config: dict, path: str):
    """The model shape of a config.json read from ``path``; a config missing a key (or with a key of
    the wrong type) is named with its file, not a bare KeyError."""
    try:
        return get_model_entry(DEFAULT_ARCH).shape_from_hf(config)  # the converter reads Qwen3.5 configs
    except (KeyError, TypeError, AttributeError) as err:
        what = f"no {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
        raise ValueError(f"{path}: not a valid Qwen3.5 config.json: {what}") from None


def _progress(iterable, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="tensor", disable=None, file=sys.stderr)


def conversion_model(shape, params_dtype=torch.float32):
    """The model on the host at TP = 1, with megatron-core initialised for one process."""
    import megatron.cpu
    from megatron.cpu.single_process import init_single_process

    init_single_process()
    megatron.cpu.register_torch_gdn_kernels()  # GPUs are hidden; FLA's Triton kernels cannot run
    return model_of(shape).build_fn(shape, params_dtype=params_dtype, use_cpu_initialization=True)


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


# ---------------------------------------------------------------------------------------- import


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
    config = source.config()
    shape = config_shape(config, os.path.join(hf_path, "config.json"))
    model_of(shape).validate_parallel(shape, tp=tp, ep=ep)
    if os.path.exists(os.path.join(megatron_path, TRACKER)) and not overwrite:
        raise FileExistsError(
            f"--megatron-path {megatron_path} already holds a checkpoint; pass --overwrite to replace it"
        )
    dtype, where = _checkpoint_dtype(config, source)
    if not allow_mixed_dtypes:
        _check_dtypes(source, dtype, where, shape)
    model = conversion_model(shape, dtype)
    params = dict(model.named_parameters())
    rules = model_of(shape).hf_mapping_rules(shape)
    filled, missing_hf, bad_shape = set(), [], []
    for rule in _progress(rules, len(rules), "import"):
        absent = [n for n in rule.hf if n not in source]
        if absent:
            missing_hf += absent
            continue
        converted = rule.to_megatron([source.get(n) for n in rule.hf])
        for name, tensor in zip(rule.megatron, converted):
            if name not in params:
                bad_shape.append(f"{name}: not a parameter of the model")
            elif tensor.shape != params[name].shape:
                bad_shape.append(f"{name}: HF gives {tuple(tensor.shape)}, the model has {tuple(params[name].shape)}")
            else:
                params[name].data = tensor.contiguous()  # the HF dtype, not the model's default
                filled.add(name)
    if shape.text.tie_word_embeddings and "lm_head.weight" in source:
        source.consumed.add("lm_head.weight")  # the tied head is the embedding itself; no need to read it
    problems = []
    for title, names in (
        ("HF tensors expected by the mapping but absent", missing_hf),
        ("HF tensors not consumed", source.unconsumed()),
        ("Megatron tensors not filled", sorted(set(params) - filled)),
        ("shape mismatches", bad_shape),
        ("HF tensors holding NaN or inf", [f"{n}: {v}" for n, v in sorted(source.nonfinite.items())]),
    ):
        if names:
            problems.append(f"{title} ({len(names)}):\n    " + "\n    ".join(names))
    if problems:
        raise ValueError(f"import {hf_path}: nothing written.\n  " + "\n  ".join(problems))

    _write_import(megatron_path, config, shape, model, ckpt_format)
    dtypes = {}
    for p in params.values():
        dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + p.numel()
    return {"tensors": len(filled), "parameters": sum(dtypes.values()), "dtypes": dtypes}


def _save_import(megatron_path: str, config: dict, shape, model, ckpt_format: str) -> None:
    """``hf_config.json`` and iteration 0. The config goes to a file of its own first and replaces
    an earlier one only at the end, so a failed import leaves the earlier one as it was. In
    ``fsdp_dtensor`` the args say what a Megatron-FSDP run of the checkpoint's dtype would."""
    os.makedirs(megatron_path, exist_ok=True)
    final_config = os.path.join(megatron_path, HF_CONFIG)
    with open(final_config + ".partial", "w") as f:
        json.dump(config, f, indent=2)
    # as the run script's default FSDP=1 run of this model: bf16 as the weights, grouped experts for MoE
    fsdp = {
        "use_megatron_fsdp": True,
        "bf16": model.config.params_dtype == torch.bfloat16,
        "moe_grouped_gemm": shape.text.is_moe,
    }
    args = one_process_checkpoint_args(
        shape,
        megatron_path,
        os.path.abspath(final_config),
        ckpt_format=ckpt_format,
        **(fsdp if ckpt_format == "fsdp_dtensor" else {}),
    )
    save_model_checkpoint(args, 0, model)
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


def _write_import(megatron_path: str, config: dict, shape, model, ckpt_format: str) -> None:
    """Writes the import; a failure at any point (a full disk, an interrupt) removes every file
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
            _save_import(megatron_path, config, shape, model, ckpt_format)
    except BaseException as err:
        for path in reversed(candidates):  # the directory last: it is removed only if it is new
            if path in existed or not os.path.lexists(path):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        cause = _os_error_cause(err, writer_log.lines)
        if cause is None:
            raise
        raise ImportWriteError(
            f"--megatron-path {megatron_path}: cannot write the checkpoint: {cause}; nothing left behind"
        ) from None


# ---------------------------------------------------------------------------------------- export


def checkpoint_shape(megatron_path: str, hf_config_path: str | None = None):
    """(shape, original HF config or None) of a checkpoint: from ``hf_config_path``, else the
    ``hf_config.json`` an import left, else the arguments the training run saved."""
    for path in (hf_config_path, os.path.join(megatron_path, HF_CONFIG)):
        if path and os.path.exists(path):
            config = read_config(path)
            return config_shape(config, path), config
    saved = _read_checkpoint(megatron_path, stored_args, checkpoint_directory(megatron_path))
    if saved is None or not hasattr(saved, "model_variant"):
        raise ValueError(
            f"{megatron_path}: no {HF_CONFIG} and no playground arguments in the checkpoint; pass --hf-config-path"
        )
    if saved.hf_config_path and not os.path.exists(saved.hf_config_path):
        raise FileNotFoundError(
            f"{megatron_path} was trained with --hf-config-path {saved.hf_config_path}, "
            "which no longer exists; pass --hf-config-path"
        )
    shape = resolve_shape(saved)
    config = read_config(saved.hf_config_path) if saved.hf_config_path else None
    return shape, config


def check_checkpoint_dir(megatron_path: str) -> None:
    """The checkpoint under ``megatron_path`` is one this tool reads: an intact tracker (checked as
    training checks it), the iteration it names, in the torch_dist format. Megatron's legacy
    per-rank files (``mp_rank_00/model_optim_rng.pt``, a ``common.pt`` alone) are whole pickles,
    which this tool never loads; torch_dist's loader would fail on them with a traceback."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    flag = f"--megatron-path {megatron_path}"
    if not os.path.isdir(megatron_path):
        raise FileNotFoundError(f"{flag}: no such directory")
    check_tracker(megatron_path, "--megatron-path")
    directory = checkpoint_directory(megatron_path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{flag}: {TRACKER} names {os.path.basename(directory)}, which does not exist")
    if not check_is_distributed_checkpoint(directory) and not is_fsdp_dtensor(directory):
        legacy = sorted(n for n in os.listdir(directory) if n == "common.pt" or n.startswith("mp_rank_"))
        what = f"legacy Megatron files ({', '.join(legacy)})" if legacy else "no torch_dist metadata.json"
        raise CheckpointReadError(
            f"{flag}: {directory} is not a torch_dist or fsdp_dtensor checkpoint: it holds {what}; save it "
            "with --ckpt-format torch_dist (this tool does not unpickle legacy checkpoints)"
        )
    # The index is read (restricted) before DCP's loader does: DCP logs a refused index as a
    # traceback before it re-raises.
    _read_checkpoint(megatron_path, _read_metadata, directory)


def _read_metadata(directory: str):
    from torch.distributed.checkpoint import FileSystemReader

    apply("checkpoints-are-data")
    return FileSystemReader(directory).read_metadata()


def _read_checkpoint(megatron_path: str, read, *args):
    """``read(*args)``, with a refused checkpoint (code planted in a pickle) as one line: DCP wraps
    the refusal in its CheckpointException, a BaseException whose text is a traceback."""
    try:
        return read(*args)
    except BaseException as err:
        line = refusal(err)
        if line is None:
            raise
        raise CheckpointReadError(f"--megatron-path {megatron_path}: {line}") from None


def _adapters_base(megatron_path: str, saved_args, moved: str | None) -> str | None:
    """The base iteration directory of a checkpoint of LoRA adapters alone (None: it holds its base),
    checked against the fingerprint recorded at save; a missing or changed base is one line."""
    if not getattr(saved_args, ADAPTERS_ONLY, False):
        return None
    return base_to_read(saved_args, moved, f"--megatron-path {megatron_path}")


def load_megatron(megatron_path: str, hf_config_path: str | None = None, lora_base: str | None = None):
    """(model at TP = 1 in fp32 with the checkpoint's weights, shape, HF config, stored dtypes).
    A LoRA run's checkpoint loads with its adapters on the model (``lora_checkpoint.py``), its base
    read from where the checkpoint names it or from ``lora_base``."""
    return load_megatron_with_lora(megatron_path, hf_config_path, lora_base)[:4]


def load_megatron_with_lora(
    megatron_path: str, hf_config_path: str | None = None, lora_base: str | None = None, build=None
):
    """``load_megatron``'s answer and the run's LoRA settings (None without adapters). A checkpoint of
    the adapters alone reads the rest from its base (``lora_base``: where it moved since the save).
    ``build(shape)``: the model to load into, at its own layout and dtype (else fp32 at TP = 1)."""
    check_checkpoint_dir(megatron_path)
    shape, config = checkpoint_shape(megatron_path, hf_config_path)
    directory = checkpoint_directory(megatron_path)
    model = (build or conversion_model)(shape).eval()
    stored = _read_checkpoint(megatron_path, _read_metadata, directory).state_dict_metadata
    saved_args = _read_checkpoint(megatron_path, stored_args, directory)
    described_by = f"--hf-config-path {hf_config_path}" if hf_config_path else f"the shape recorded in {megatron_path}"
    if is_fsdp_dtensor(directory):  # Megatron-FSDP's format: no LoRA run (refused at launch), weights whole
        fsdp_weights.check_model_matches(model, stored, described_by)
        _read_checkpoint(megatron_path, fsdp_weights.load_weights, model, directory, stored)
        dtypes = fsdp_weights.weight_dtypes(model, saved_args, model_of(shape).hf_fp32_suffixes)
        return model, shape, config, dtypes, None
    lora = stored_lora(megatron_path, saved_args, stored)
    base = _adapters_base(megatron_path, saved_args, lora_base) if lora is not None else None
    if base is not None:
        stored = {**_read_checkpoint(base, _read_metadata, base).state_dict_metadata, **stored}
    if lora is not None:
        attach_adapters(model, lora, stored, megatron_path)
    check_model_matches(model, stored, described_by)
    _read_checkpoint(megatron_path, load_model_weights, model, directory, base)
    by_key = _weight_dtypes(stored)
    common = max(set(by_key.values()), key=list(by_key.values()).count)
    dtypes = {name: by_key.get(getattr(sh, "key", None), common) for name, sh in model.sharded_state_dict().items()}
    if base is not None:  # an adapted weight merges in the dtype the run trained it in, as its save would hold
        linears = adapted_linears(model)
        trained = {dtypes[f"{n}.lora_A"] for n in linears}
        if len(trained) == 1:
            dtypes.update(dict.fromkeys((f"{n}.weight" for n in linears), trained.pop()))
    return model, shape, config, dtypes, lora


def stored_weight_dtype(megatron_path: str) -> torch.dtype:
    """The dtype most of a checkpoint's model weights are stored in (bf16 for a bf16 run, whose fp32
    copies belong to the optimizer)."""
    directory = checkpoint_directory(megatron_path)
    if is_fsdp_dtensor(directory):  # FSDP keeps fp32 main weights: the run's args say what it trained in
        return fsdp_weights.trained_dtype(_read_checkpoint(megatron_path, stored_args, directory))
    stored = _read_checkpoint(megatron_path, _read_metadata, directory)
    dtypes = list(_weight_dtypes(stored.state_dict_metadata).values())
    return max(set(dtypes), key=dtypes.count) if dtypes else torch.float32


def check_model_matches(model, stored: dict, described_by: str) -> None:
    """``ValueError`` naming the first tensor of ``model`` that the checkpoint lacks or holds at
    another shape (a config of another model), before DCP's load fails with a list of every key."""
    for name, sharded in model.sharded_state_dict().items():
        key = getattr(sharded, "key", None)
        if key is None or "_extra_state" in key:
            continue
        if key not in stored and not any(k.startswith(key + ".") for k in stored):
            raise ValueError(f"{described_by} does not describe the checkpoint's model: it has no tensor {key}")
        size, want = getattr(stored.get(key), "size", None), getattr(sharded, "global_shape", None)
        if size is not None and want is not None and tuple(size) != tuple(want):
            raise ValueError(
                f"{described_by} does not describe the checkpoint's model: {key} is "
                f"{tuple(size)} there, {tuple(want)} here"
            )


def _weight_dtypes(stored: dict) -> dict:
    """Checkpoint key -> dtype of the model weights (not the optimizer's: a training checkpoint holds
    three fp32 optimizer tensors per bf16 weight). megatron-core stores GDN's fused ``in_proj`` /
    ``conv1d`` as pieces (``KEY.query``, ``KEY.z`` ...); the whole tensor's key is added with the
    pieces' dtype."""
    weights = {k: m.properties.dtype for k, m in stored.items() if hasattr(m, "properties") and is_model_key(k)}
    wholes: dict[str, set] = {}
    for key, dtype in weights.items():
        wholes.setdefault(key.rsplit(".", 1)[0], set()).add(dtype)
    return {**{k: d.pop() for k, d in wholes.items() if len(d) == 1 and k not in weights}, **weights}


def _processor_files(processor_dir: str) -> list[str]:
    if not os.path.isdir(processor_dir):
        raise FileNotFoundError(f"--hf-processor-path {processor_dir}: no such directory")
    files = sorted(
        n
        for n in os.listdir(processor_dir)
        if os.path.isfile(os.path.join(processor_dir, n)) and not n.endswith(_NOT_PROCESSOR_FILES)
    )
    if not any(n.startswith("tokenizer") for n in files):
        raise FileNotFoundError(f"--hf-processor-path {processor_dir}: no tokenizer files")
    return files


def write_failure(hf_path: str, err: BaseException, flag: str = "--hf-path") -> ExportWriteError:
    if isinstance(err, OSError) and err.strerror:
        cause = err.strerror + (f" ({err.filename})" if err.filename else "")
    else:  # safetensors' writer wraps the OS error: '... IoError(Os { code: 28, ..., message: "No space ..." })'
        found = re.search(r'message: "([^"]*)"', str(err))
        cause = found.group(1) if found else " ".join(str(err).split())
    return ExportWriteError(f"{flag} {hf_path}: cannot write the export: {cause}; nothing left behind")


def check_apart(megatron_path: str, hf_path: str, flag: str = "--hf-path") -> None:
    """The export and the checkpoint it reads are separate trees: ``--overwrite`` empties the output
    (and writes ``OUT.partial`` next to it), so an output equal to, above or inside the checkpoint
    would delete or change the checkpoint. Compared as real paths (symlinks and ``..`` resolved)."""
    mg, out = os.path.realpath(megatron_path), os.path.realpath(hf_path)
    if out == mg:
        where = "is the Megatron checkpoint"
    elif mg.startswith(out.rstrip(os.sep) + os.sep):
        where = f"contains the Megatron checkpoint {megatron_path}"
    elif out.startswith(mg.rstrip(os.sep) + os.sep):
        where = f"is inside the Megatron checkpoint {megatron_path}"
    else:
        return
    raise ValueError(f"{flag} {hf_path} {where}; choose an output outside it (nothing written)")


def start_output(hf_path: str, overwrite: bool, flag: str = "--hf-path") -> str:
    """Checks OUT and creates ``OUT.partial``, before the (long) checkpoint load: a place that cannot
    be written fails now."""
    if os.path.exists(hf_path) and not os.path.isdir(hf_path):
        raise ExportWriteError(f"{flag} {hf_path}: an existing file, not a directory; nothing written")
    if os.path.exists(hf_path) and os.listdir(hf_path) and not overwrite:
        raise FileExistsError(f"{flag} {hf_path} exists and is not empty; pass --overwrite to replace it")
    partial = hf_path.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        os.makedirs(partial)
    except OSError as err:
        raise write_failure(hf_path, err, flag) from None
    return partial


def _write_hf_dir(
    out: str, state: dict, shape, config, stored: dict, dtype: str | None, moe_layout: str, max_shard_bytes: int
) -> dict:
    """Shards, index and config.json of the export into ``out``; ``state``: the model's tensors by
    Megatron name, as the rules read them."""
    writer = ShardedWriter(out, max_shard_bytes)
    rules = model_of(shape).hf_mapping_rules(shape)
    for rule in _progress(rules, len(rules), "export"):
        out_dtype = DTYPES[dtype] if dtype else stored[rule.megatron[0]]
        for name, tensor in zip(rule.hf, rule.to_hf([state[n] for n in rule.megatron])):
            for piece_name, piece in per_expert(name, tensor) if moe_layout == "per-expert" else [(name, tensor)]:
                writer.add(piece_name, piece.to(out_dtype))
    shards = writer.close()
    if config is None:
        config = model_of(shape).shape_to_hf(shape)
    # A run without the MTP head has none to export; say so in the config too.
    text_config = {**config["text_config"], "mtp_num_hidden_layers": shape.text.mtp_num_layers}
    config = {**config, "text_config": text_config, "architectures": [hf_classes(config["model_type"])[1].__name__]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return {"shards": len(shards), "bytes": writer.total_bytes}


def export_hf(
    megatron_path: str,
    hf_path: str,
    hf_processor_path: str | None = None,
    hf_config_path: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
    moe_layout: str = "per-expert",
    lora_base: str | None = None,
) -> dict:
    if moe_layout not in MOE_LAYOUTS:
        raise ValueError(f"--moe-layout {moe_layout!r}: not one of {', '.join(MOE_LAYOUTS)}")
    check_apart(megatron_path, hf_path)
    processor_files = _processor_files(hf_processor_path) if hf_processor_path else []  # checked before any write
    partial = start_output(hf_path, overwrite)
    try:
        model, shape, config, stored = load_megatron(megatron_path, hf_config_path, lora_base)
        # a LoRA run's adapters are folded into its base weights as the rules read them
        state = MergedState(
            model_of(shape).hf_model_state(model), model, lambda name: DTYPES[dtype] if dtype else stored[name]
        )
        try:
            info = _write_hf_dir(partial, state, shape, config, stored, dtype, moe_layout, max_shard_bytes)
            for name in processor_files:
                shutil.copy2(os.path.join(hf_processor_path, name), os.path.join(partial, name))
            if os.path.exists(hf_path):
                shutil.rmtree(hf_path)
            os.replace(partial, hf_path)
        except (OSError, SafetensorError) as err:
            raise write_failure(hf_path, err) from err
    except BaseException:  # interrupted too: never leave OUT.partial behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {**info, "processor_files": len(processor_files), "merged_adapters": len(state.linears)}

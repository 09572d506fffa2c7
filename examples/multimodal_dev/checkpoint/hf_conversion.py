"""Hugging Face <-> Megatron checkpoints for Qwen3.5-VL: what the commands of
``tools/convert_checkpoint.py`` share (its docstring has the commands; ``hf_import.py``,
``hf_export.py``, ``peft_adapter.py`` and ``verify.py`` do the work).

Here: the shape a checkpoint describes (its ``hf_config.json``, else the training run's arguments),
the checks that a directory holds a checkpoint this tool reads (torch_dist or Megatron-FSDP's
fsdp_dtensor with an intact tracker; legacy per-rank pickles and planted code refused), and the
checkpoint opened: ``open_megatron`` gives the weightless model of its shape (with a LoRA run's
adapters) and a reader of its tensors (``streamed_load.py``), for the tools that hold a bounded part
of it; ``load_megatron_with_lora`` loads it whole into a built model, for generating and serving.

The tools run on the CPU and never hold the whole model (the 397B is ~800 GB in bf16): a tensor, a
rule's tensors or one decoder layer at a time.
"""

from __future__ import annotations

import os
from argparse import Namespace
from dataclasses import dataclass

import torch

from examples.multimodal_dev.models import DEFAULT_ARCH, ModelShape, get_model_entry, model_of

from ..megatron_changes import apply
from . import fsdp_weights
from .adapters_only import ADAPTERS_ONLY, HF_CONFIG_RECORDED, base_path, base_to_read, is_model_key
from .choices import DTYPE_NAMES
from .files import TRACKER, checkpoint_directory, is_fsdp_dtensor, load_model_weights, stored_args
from .hf_safetensors import read_config
from .lora_checkpoint import StoredLora, adapted_linears, attach_adapters, stored_lora
from .run_shape import resolve_shape
from .safety import check_tracker, refusal

HF_CONFIG = "hf_config.json"  # the source config.json, kept next to the converted checkpoint
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


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


def conversion_model(shape, params_dtype=torch.float32):
    """The model on the host at TP = 1, with megatron-core initialised for one process."""
    import megatron.cpu
    from megatron.cpu.single_process import init_single_process

    init_single_process()
    megatron.cpu.register_torch_gdn_kernels()  # GPUs are hidden; FLA's Triton kernels cannot run
    return model_of(shape).build_fn(shape, params_dtype=params_dtype, use_cpu_initialization=True)


def checkpoint_shape(megatron_path: str, hf_config_path: str | None = None, lora_base: str | None = None):
    """(shape, original HF config or None) of a checkpoint: from ``hf_config_path``, else the
    ``hf_config.json`` an import left, else the arguments the training run saved (an adapters-only
    checkpoint whose recorded config file moved away with its base: ``_lora_config``)."""
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
        found = _lora_config(saved, lora_base)
        if found is None:
            moved = " (or --lora-base: where its base is now)" if getattr(saved, ADAPTERS_ONLY, False) else ""
            raise FileNotFoundError(
                f"{megatron_path} was trained with --hf-config-path {saved.hf_config_path}, "
                f"which no longer exists; pass --hf-config-path{moved}"
            )
        return resolve_shape(Namespace(**{**vars(saved), "hf_config_path": found})), found
    shape = resolve_shape(saved)
    config = read_config(saved.hf_config_path) if saved.hf_config_path else None
    return shape, config


def _lora_config(saved_args, lora_base: str | None) -> dict | None:
    """The HF config of an adapters-only checkpoint: the one its run recorded with the adapters, else
    the ``hf_config.json`` of its base's folder (an import's; ``lora_base``: where it is now)."""
    if not getattr(saved_args, ADAPTERS_ONLY, False):
        return None
    if isinstance(recorded := getattr(saved_args, HF_CONFIG_RECORDED, None), dict):
        return recorded
    base = base_path(saved_args, lora_base)
    path = os.path.join(os.path.dirname(base), HF_CONFIG) if base else None
    return read_config(path) if path and os.path.isfile(path) else None


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


@dataclass
class OpenedCheckpoint:
    """A Megatron checkpoint described and checked, its weights not read."""

    model: torch.nn.Module  # its shape's model (weightless, or the ``build`` given), with the run's adapters
    shape: ModelShape
    config: dict | None  # the Hugging Face config.json it was made from, if known
    stored: dict  # DCP's index: checkpoint key -> metadata (a LoRA base's keys merged in)
    stored_dtypes: dict  # model name -> the dtype the checkpoint stores the tensor in
    dtypes: dict  # model name -> the dtype an export writes it in (an adapted weight: its adapters')
    lora: StoredLora | None
    directory: str  # the iteration directory
    base: str | None  # the base's iteration directory, for a checkpoint of LoRA adapters alone

    def tensors(self):
        """A reader of the checkpoint's tensors by model name (``streamed_load.CheckpointTensors``)."""
        from .streamed_load import CheckpointTensors

        return CheckpointTensors(self.model, self.directory, self.base, self.stored, self.stored_dtypes)


def open_megatron(megatron_path: str, hf_config_path: str | None = None, lora_base: str | None = None, build=None):
    """The checkpoint under ``megatron_path`` checked and described (``OpenedCheckpoint``). A LoRA run's
    checkpoint gets its adapters on the model (``lora_checkpoint.py``); a checkpoint of the adapters
    alone reads the rest from its base (``lora_base``: where it moved since the save). ``build(shape)``:
    the model, at its own layout and dtype (else the weightless model at TP = 1)."""
    from .weightless_model import weightless_model

    check_checkpoint_dir(megatron_path)
    shape, config = checkpoint_shape(megatron_path, hf_config_path, lora_base)
    directory = checkpoint_directory(megatron_path)
    model = (build or weightless_model)(shape).eval()
    stored = _read_checkpoint(megatron_path, _read_metadata, directory).state_dict_metadata
    saved_args = _read_checkpoint(megatron_path, stored_args, directory)
    described_by = f"--hf-config-path {hf_config_path}" if hf_config_path else f"the shape recorded in {megatron_path}"
    if is_fsdp_dtensor(directory):  # Megatron-FSDP's format: no LoRA run (refused at launch), weights whole
        fsdp_weights.check_model_matches(model, stored, described_by)
        dtypes = fsdp_weights.weight_dtypes(model, saved_args, model_of(shape).hf_fp32_suffixes)
        on_disk = dict.fromkeys(dtypes, torch.float32)  # FSDP's fp32 main copies
        return OpenedCheckpoint(model, shape, config, stored, on_disk, dtypes, None, directory, None)
    lora = stored_lora(megatron_path, saved_args, stored)
    base = _adapters_base(megatron_path, saved_args, lora_base) if lora is not None else None
    if base is not None:
        stored = {**_read_checkpoint(base, _read_metadata, base).state_dict_metadata, **stored}
    if lora is not None:
        attach_adapters(model, lora, stored, megatron_path)
    check_model_matches(model, stored, described_by)
    by_key = _weight_dtypes(stored)
    common = max(set(by_key.values()), key=list(by_key.values()).count)
    on_disk = {name: by_key.get(getattr(sh, "key", None), common) for name, sh in model.sharded_state_dict().items()}
    dtypes = dict(on_disk)
    if base is not None:  # an adapted weight merges in the dtype the run trained it in, as its save would hold
        linears = adapted_linears(model)
        trained = {dtypes[f"{n}.lora_A"] for n in linears}
        if len(trained) == 1:
            dtypes.update(dict.fromkeys((f"{n}.weight" for n in linears), trained.pop()))
    return OpenedCheckpoint(model, shape, config, stored, on_disk, dtypes, lora, directory, base)


def load_megatron_with_lora(
    megatron_path: str, hf_config_path: str | None = None, lora_base: str | None = None, build=None
):
    """(model with the checkpoint's weights, shape, HF config, the dtypes an export writes, the run's
    LoRA settings or None): ``open_megatron``, then every weight loaded into the model ``build(shape)``
    builds (a generating command's, at its layout and dtype; else fp32 at TP = 1)."""
    opened = open_megatron(megatron_path, hf_config_path, lora_base, build or conversion_model)
    if is_fsdp_dtensor(opened.directory):
        _read_checkpoint(megatron_path, fsdp_weights.load_weights, opened.model, opened.directory, opened.stored)
    else:
        _read_checkpoint(megatron_path, load_model_weights, opened.model, opened.directory, opened.base)
    return opened.model, opened.shape, opened.config, opened.dtypes, opened.lora


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

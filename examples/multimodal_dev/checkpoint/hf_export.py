"""``convert_checkpoint export``: a Megatron checkpoint saved at any layout -> a Hugging Face directory
(config.json, sharded safetensors with an index, tokenizer / processor files), written tensor by tensor.

Each tensor is written in the dtype the checkpoint stores it in (or ``dtype``). MoE experts are
written one tensor per expert, as the hub's checkpoints store them (``...experts.{e}.gate_proj.weight``),
or packed as transformers holds them in memory (``moe_layout="packed"``, written expert by expert
into the one tensor). A LoRA run's adapters are merged into their weights (``lora/adapter.merged``).

How memory stays bounded: the shards and every tensor's place in them are planned from the
mapping's transforms run on meta tensors (``safetensors_writer.py``); then each shard is written in
its file's order, the Megatron tensors its next tensors need read a batch of at most
``READ_BYTES`` at a time (``streamed_load.py``), converted by their rule, and dropped once written.
The rules that only move elements run in the stored dtype; the one that computes (Gated DeltaNet's
``out_norm``, stored as HF - 1) in fp32, as the whole-model export did, so the files are the same to
the byte.

Written to ``OUT.partial`` and renamed at the end; a write that fails (a file in the way, a read-only
place, a full disk, an interrupt) removes ``OUT.partial`` and says why in one line. An output equal to,
above or inside the checkpoint is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import SafetensorError

from examples.multimodal_dev.lora.adapter import merged
from examples.multimodal_dev.models import model_of

from ..progress import Progress
from .choices import MOE_LAYOUTS
from .hf_conversion import DTYPES, open_megatron
from .hf_models import hf_classes
from .hf_safetensors import INDEX
from .lora_checkpoint import adapted_linears
from .safetensors_writer import Planned, file_order, plan_shards, shard_name, write_index, write_shard

# Weights and what describes them; everything else in a processor directory is copied on export.
_NOT_PROCESSOR_FILES = (".safetensors", ".bin", ".pt", ".pth", INDEX, "config.json", "generation_config.json")
# At most this many bytes of Megatron tensors are read at once (a tensor larger than this alone).
READ_BYTES = 256 << 20
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class ExportWriteError(OSError):
    """An export that could not be written; the message is one line with the path and the cause."""


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
    """Checks OUT and creates ``OUT.partial``, before the (long) checkpoint read: a place that cannot
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


def finish_output(partial: str, out: str) -> None:
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(partial, out)


def _packed(planned: list[tuple[Planned, list]]) -> list[tuple[Planned, list]]:
    """Per-expert tensors joined into transformers' packed ones, where the first expert's stood:
    ``experts.gate_up_proj`` [E, 2I, H] is every expert's gate rows then up rows, ``experts.down_proj``
    [E, H, I] every expert's down weight, in expert order (as the rules give them)."""
    order: list = []  # a tensor with its parts, or the name of a packed tensor
    packs: dict[str, tuple[list, list]] = {}  # packed name -> (per-expert tensors, their parts)
    for tensor, parts in planned:
        found = _PER_EXPERT.match(tensor.name)
        if not found:
            order.append((tensor, parts))
            continue
        name = f"{found['prefix']}.{'down_proj' if found['proj'] == 'down' else 'gate_up_proj'}"
        if name not in packs:
            packs[name] = ([], [])
            order.append(name)
        packs[name][0].append(tensor)
        packs[name][1].extend(parts)
    result = []
    for item in order:
        if isinstance(item, str):
            pieces, parts = packs[item]
            per = 2 if item.endswith("gate_up_proj") else 1  # gate_up: two [I, H] pieces an expert
            rows, cols = pieces[0].shape
            item = (Planned(item, (len(pieces) // per, rows * per, cols), pieces[0].dtype), parts)
        result.append(item)
    return result


def plan_export(opened, rules, dtype: str | None, moe_layout: str) -> list[tuple[Planned, list]]:
    """Every HF tensor the export writes, in the order written, with the (rule, output) pairs it is
    made of: shapes from the rules run on meta tensors, dtypes the checkpoint's (or ``dtype``)."""
    planned = []
    for r, rule in enumerate(rules):
        out_dtype = DTYPES[dtype] if dtype else opened.dtypes[rule.megatron[0]]
        metas = [torch.empty(opened.model.get_parameter(n).shape, device="meta") for n in rule.megatron]
        for o, (name, meta) in enumerate(zip(rule.hf, rule.to_hf(metas))):
            planned.append((Planned(name, tuple(meta.shape), out_dtype), [(r, o)]))
    return _packed(planned) if moe_layout == "packed" else planned


class RuleOutputs:
    """The HF tensors of rules computed from the checkpoint a batch of rules at a time (at most
    ``READ_BYTES`` of Megatron tensors read at once), each handed out once."""

    def __init__(self, opened, rules, dtype: str | None, reader):
        self.rules, self.reader = rules, reader
        self.dtype_of = lambda name: DTYPES[dtype] if dtype else opened.dtypes[name]
        self.linears = {f"{n}.weight": m for n, m in adapted_linears(opened.model).items()}
        self._ready: dict[tuple[int, int], torch.Tensor] = {}

    def names_of(self, r: int) -> list[str]:
        """The Megatron tensors rule ``r`` reads (an adapted weight's adapters too)."""
        names = []
        for name in self.rules[r].megatron:
            names.append(name)
            if name in self.linears:
                prefix = name.removesuffix(".weight")
                names += [f"{prefix}.lora_A", f"{prefix}.lora_B"]
        return names

    def _compute(self, r: int, read: dict) -> list[torch.Tensor]:
        rule = self.rules[r]
        inputs = []
        for name in rule.megatron:
            tensor = read[name]
            if name in self.linears:
                prefix, linear = name.removesuffix(".weight"), self.linears[name]
                tensor = merged(
                    tensor, read[f"{prefix}.lora_A"], read[f"{prefix}.lora_B"], linear.lora_scale, self.dtype_of(name)
                )
            inputs.append(tensor if rule.moves_only else tensor.float())
        out_dtype = self.dtype_of(rule.megatron[0])
        return [t.to(out_dtype) for t in rule.to_hf(inputs)]

    def load(self, queue: list[tuple[int, int]], at: int) -> None:
        """Computes the rules of ``queue[at:]`` (in order) that fit in one read, the first always."""
        batch, size = [], 0
        for r, _ in queue[at:]:
            if r in batch:
                continue
            need = self.reader.nbytes(self.names_of(r))
            if batch and size + need > READ_BYTES:
                break
            batch.append(r)
            size += need
        read = self.reader.read([n for r in batch for n in self.names_of(r)])
        chosen = set(batch)
        keep = {part for part in queue[at:] if part[0] in chosen}
        for r in batch:
            for o, tensor in enumerate(self._compute(r, read)):
                if (r, o) in keep:
                    self._ready[(r, o)] = tensor

    def take(self, queue: list[tuple[int, int]], at: int) -> torch.Tensor:
        """Output ``queue[at]``, reading it (and the outputs after it that fit with it) when not ready."""
        if queue[at] not in self._ready:
            self.load(queue, at)
        return self._ready.pop(queue[at])


def _write_shards(out: str, planned: list[tuple[Planned, list]], outputs: RuleOutputs, max_shard_bytes: int) -> dict:
    parts_of = {t.name: parts for t, parts in planned}
    shards = plan_shards([t for t, _ in planned], max_shard_bytes)
    total = sum(t.nbytes for shard in shards for t in shard)
    with Progress("export", len(planned), total) as progress:
        for i, shard in enumerate(shards):
            queue = [p for t in file_order(shard) for p in parts_of[t.name]]
            at = [0]  # the next part to write

            def produce(tensor: Planned):
                for _ in parts_of[tensor.name]:
                    at[0] += 1
                    yield outputs.take(queue, at[0] - 1)
                progress.advance(tensor.nbytes)

            write_shard(os.path.join(out, shard_name(i, len(shards))), shard, produce)
    write_index(os.path.join(out, INDEX), shards)
    return {"shards": len(shards), "bytes": total}


def _write_config(out: str, shape, config) -> None:
    if config is None:
        config = model_of(shape).shape_to_hf(shape)
    # A run without the MTP head has none to export; say so in the config too.
    text_config = {**config["text_config"], "mtp_num_hidden_layers": shape.text.mtp_num_layers}
    config = {**config, "text_config": text_config, "architectures": [hf_classes(config["model_type"])[1].__name__]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


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
        opened = open_megatron(megatron_path, hf_config_path, lora_base)
        rules = model_of(opened.shape).hf_mapping_rules(opened.shape, per_expert=True)
        planned = plan_export(opened, rules, dtype, moe_layout)
        with opened.tensors() as reader:
            outputs = RuleOutputs(opened, rules, dtype, reader)
            try:
                info = _write_shards(partial, planned, outputs, max_shard_bytes)
                _write_config(partial, opened.shape, opened.config)
                for name in processor_files:
                    shutil.copy2(os.path.join(hf_processor_path, name), os.path.join(partial, name))
                finish_output(partial, hf_path)
            except (OSError, SafetensorError) as err:
                raise write_failure(hf_path, err) from err
    except BaseException:  # interrupted too: never leave OUT.partial behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {**info, "processor_files": len(processor_files), "merged_adapters": len(outputs.linears)}

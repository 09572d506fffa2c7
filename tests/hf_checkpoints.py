"""Tiny random Qwen3.5-VL checkpoints on disk, written by ``save_pretrained`` like real ones."""

from __future__ import annotations

import json
import os

import torch
from hf_reference import HFMtpHead, build_hf_model

# Released Qwen3.5 checkpoints are bf16 except these, which are stored in fp32.
FP32_SUFFIXES = ("A_log", "dt_bias")
_PACKED = ("experts.gate_up_proj", "experts.down_proj")


def _split_experts(tensors: dict) -> dict:
    """Packed MoE tensors ([E, 2F, H] gate_up, [E, H, F] down) as the hub stores them: one
    ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` weight per expert."""
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(_PACKED):
            out[name] = tensor
            continue
        prefix = name.rsplit(".", 1)[0]
        for e, expert in enumerate(tensor):
            if name.endswith("gate_up_proj"):
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = expert
    return out


def write_hf_checkpoint(path, shape, dtype=torch.bfloat16, experts_per_expert: bool = False) -> dict:
    """``save_pretrained`` of a random model in ``dtype`` (fp32 ``A_log``/``dt_bias``), sharded
    with an index, plus an ``mtp.safetensors`` shard with the MTP head, which ``transformers``
    itself does not save. MoE experts are as ``save_pretrained`` writes them and packed in the MTP
    shard, or, with ``experts_per_expert``, one tensor per expert everywhere (the hub layout).
    Returns every tensor written, by name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = build_hf_model(shape)
    mtp = HFMtpHead(hf).checkpoint_state() if shape.text.mtp_num_layers else {}
    hf.to(dtype)
    for name, p in hf.named_parameters():
        if name.endswith(FP32_SUFFIXES):
            p.data = p.data.float()
    hf.config.dtype = dtype
    hf.save_pretrained(path, max_shard_size="2MB")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index_path):  # one shard: make the index real checkpoints have
        os.replace(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00001.safetensors"))
        with safe_open(os.path.join(path, "model-00001-of-00001.safetensors"), "pt") as f:
            json.dump(
                {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in f.keys()}},
                open(index_path, "w"),
            )
    mtp = {k: v.to(dtype) for k, v in mtp.items()}
    if mtp:
        save_file({k: v.contiguous() for k, v in mtp.items()}, os.path.join(path, "mtp.safetensors"))
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
        with open(index_path, "w") as f:
            json.dump(index, f)
    with open(index_path) as f:
        index = json.load(f)
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, name), "pt") as f:
            shard = {k: f.get_tensor(k) for k in f.keys()}
        if experts_per_expert and any(k.endswith(_PACKED) for k in shard):
            # Whatever transformers' version writes, the file ends up in the hub layout.
            shard = {k: v.contiguous() for k, v in _split_experts(shard).items()}
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != name}
            index["weight_map"].update({k: name for k in shard})
        tensors.update(shard)
    with open(index_path, "w") as f:
        json.dump(index, f)
    return tensors

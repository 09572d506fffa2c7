"""Tiny random Qwen3.5-VL checkpoints on disk, written by ``save_pretrained`` like real ones."""

from __future__ import annotations

import json
import os

import torch
from hf_reference import HFMtpHead, build_hf_model

# Released Qwen3.5 checkpoints are bf16 except these, which are stored in fp32.
FP32_SUFFIXES = ("A_log", "dt_bias")


def write_hf_checkpoint(path, shape, dtype=torch.bfloat16, mtp_experts_per_expert: bool = False) -> dict:
    """``save_pretrained`` of a random model in ``dtype`` (fp32 ``A_log``/``dt_bias``), sharded
    with an index, plus an ``mtp.safetensors`` shard with the MTP head, which ``transformers``
    itself does not save. Returns every tensor written, by name."""
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
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model-00001-of-00001.safetensors"), "pt") as f:
            json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in f.keys()}},
                      open(index_path, "w"))
    mtp = {k: v.to(dtype) for k, v in mtp.items()}
    if mtp_experts_per_expert:
        for name in [k for k in mtp if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            packed, prefix = mtp.pop(name), name.rsplit(".", 1)[0]
            for e in range(packed.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = packed[e].chunk(2, dim=0)
                    mtp[f"{prefix}.{e}.gate_proj.weight"], mtp[f"{prefix}.{e}.up_proj.weight"] = gate, up
                else:
                    mtp[f"{prefix}.{e}.down_proj.weight"] = packed[e]
    if mtp:
        save_file({k: v.contiguous() for k, v in mtp.items()}, os.path.join(path, "mtp.safetensors"))
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update({k: "mtp.safetensors" for k in mtp})
        with open(index_path, "w") as f:
            json.dump(index, f)
    from safetensors import safe_open

    with open(index_path) as f:
        files = set(json.load(f)["weight_map"].values())
    tensors = {}
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors

"""The model weights of a Megatron-FSDP checkpoint (``--ckpt-format fsdp_dtensor``), for export, verify
and generation.

An fsdp_dtensor iteration is one torch.distributed.checkpoint (DCP) directory. Its model part is keyed
by the parameter names of the model megatron wrapped (``model.module.<name>``), each stored whole
(DCP's index has the global shape), so it reads into a one-process model of the run's shape without
resharding. The weights are FSDP's fp32 main copies whatever the run trained in: the dtype a weight
had in the run comes from the run's args (``weight_dtypes``), where a torch_dist checkpoint stores it.

Experts are named by the run's implementation: SequentialMLP's one weight per expert
(``...experts.local_experts.{e}.linear_fc1.weight``), or grouped experts' one 3-D weight of them all
(``...experts.linear_fc1.weight``, the default). The one-process model here holds SequentialMLP's, and
reads or writes either (``save_weights`` writes grouped ones where the args say ``moe_grouped_gemm``).
"""

from __future__ import annotations

import re

import torch

PREFIX = "model.module."  # megatron's "model" part, then the wrapper's ``module``
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def _grouped(key: str) -> tuple[str, int] | None:
    """(the grouped experts' key, the expert's index) of SequentialMLP's ``key``; None for other weights."""
    found = PER_EXPERT.match(key)
    return (found.group(1) + found.group(3), int(found.group(2))) if found else None


def weight_sources(model, stored: dict) -> dict[str, tuple[str, int | None]]:
    """Checkpoint key of each model weight -> (the key holding it, its expert's row there or None)."""
    out: dict[str, tuple[str, int | None]] = {}
    for key in _requested(model):
        grouped = _grouped(key)
        out[key] = grouped if key not in stored and grouped and grouped[0] in stored else (key, None)
    return out


def _requested(model) -> dict[str, torch.Tensor]:
    """Checkpoint key -> the model's own tensor (DCP reads into it in place)."""
    return {PREFIX + n: t for n, t in model.state_dict().items() if "_extra_state" not in n}


def check_model_matches(model, stored: dict, described_by: str) -> None:
    """``ValueError`` naming the first weight of ``model`` the checkpoint lacks or holds at another shape."""
    config = model.config
    split = {"TP": config.tensor_model_parallel_size, "EP": config.expert_model_parallel_size}
    if any(size > 1 for size in split.values()):
        sizes = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ValueError(f"a Megatron-FSDP (fsdp_dtensor) checkpoint loads into one process here, not at {sizes}")
    sources = weight_sources(model, stored)
    for key, tensor in _requested(model).items():
        (where, row), name = sources[key], key[len(PREFIX) :]
        meta = stored.get(where)
        if meta is None:
            raise ValueError(f"{described_by} does not describe the checkpoint's model: it has no tensor {name}")
        size = tuple(meta.size)[1:] if row is not None else tuple(meta.size)
        if size != tuple(tensor.shape) or (row is not None and row >= meta.size[0]):
            raise ValueError(
                f"{described_by} does not describe the checkpoint's model: {name} is "
                f"{tuple(meta.size)} there, {tuple(tensor.shape)} here"
            )


def load_weights(model, directory: str, stored: dict) -> None:
    """Every weight of ``model`` (one process, the run's shape) from the fsdp_dtensor ``directory``, whose
    DCP index is ``stored``; grouped experts' weights are read whole, then each expert's row copied."""
    from torch.distributed.checkpoint import load

    from ..megatron_changes import apply

    apply("checkpoints-are-data")
    requested, sources = _requested(model), weight_sources(model, stored)
    state = {key: t for key, t in requested.items() if sources[key][1] is None}
    for where, _ in {sources[k] for k in requested if sources[k][1] is not None}:
        state[where] = torch.empty(tuple(stored[where].size), dtype=stored[where].properties.dtype)
    load(state, checkpoint_id=directory, no_dist=True)
    for key, (where, row) in sources.items():
        if row is not None:
            requested[key].copy_(state[where][row])


def save_weights(model, args, iteration: int, directory: str, fill=None) -> None:
    """``model``'s weights (one process, whole) as Megatron-FSDP saves them, fp32, with ``args``: the
    checkpoint an FSDP=1 run starts from (``CKPT_LOAD``) as from its own, experts grouped where
    ``args.moe_grouped_gemm`` says the run groups them. ``fill(name)``: weight ``name``'s tensor, asked
    for when the writer reaches it (an import, whose model is weightless); else the model's own. One
    weight (or one grouped tensor of experts) is in memory at a time either way."""
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, save

    weights = dict(model.named_parameters())
    fill = fill or weights.__getitem__
    parts: dict[str, dict[int | None, str]] = {}  # checkpoint key -> {expert row or None: weight name}
    for key in _requested(model):
        grouped = _grouped(key) if getattr(args, "moe_grouped_gemm", False) else None
        where, row = grouped if grouped else (key, None)
        parts.setdefault(where, {})[row] = key[len(PREFIX) :]
    meta = {}
    for key, rows in parts.items():
        shape = weights[next(iter(rows.values()))].shape
        meta[key] = torch.empty((len(rows), *shape) if None not in rows else shape, dtype=torch.float32, device="meta")

    class FilledPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            rows = parts.get(write_item.index.fqn)
            if rows is None:  # the args and the other common items
                return super().resolve_data(write_item)
            if None in rows:
                return fill(rows[None]).detach().float().contiguous()
            return torch.stack([fill(rows[e]).detach().float() for e in sorted(e for e in rows if e is not None)])

    model_part = {k[len("model.") :]: t for k, t in meta.items()}
    state = {"model": model_part, "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    save(state, storage_writer=FileSystemWriter(directory, thread_count=1), planner=FilledPlanner(), no_dist=True)


def trained_dtype(saved_args) -> torch.dtype:
    """The dtype the run that saved ``saved_args`` trained its weights in."""
    if getattr(saved_args, "bf16", False):
        return torch.bfloat16
    return torch.float16 if getattr(saved_args, "fp16", False) else torch.float32


def weight_dtypes(model, saved_args, fp32_suffixes: tuple[str, ...]) -> dict[str, torch.dtype]:
    """Each weight's dtype in the run that saved ``saved_args``: its training dtype, except the weights the
    model keeps in fp32 whatever it trains in (``fp32_suffixes``, the model entry's)."""
    trained = trained_dtype(saved_args)
    return {name: torch.float32 if name.endswith(fp32_suffixes) else trained for name in model.sharded_state_dict()}

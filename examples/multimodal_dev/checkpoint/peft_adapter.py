"""A LoRA run's adapters as a Hugging Face PEFT adapter for transformers' Qwen3.5-VL (the class the
export writes, ``Qwen3_5(Moe)ForConditionalGeneration``), over the base the run started from:

    OUT/adapter_config.json          peft's LoraConfig: r, lora_alpha, target_modules (transformers'
                                     module names), target_parameters (routed experts), lora_dropout
    OUT/adapter_model.safetensors    base_model.model.<transformers module>.lora_A.weight / .lora_B.weight

Legend: r the rank, E routed experts, scale = alpha / r, dW = scale * B A of one Megatron linear.

Each adapter follows its weight through the weight's rule (``hf_mapping_rules``). Every rule's
``to_hf`` picks, splits or reorders rows, never columns, and a row operation R on B A is (R B) A:

  transformers Linear   lora_B = to_hf(B): attention's per-group query / gate / key / value rows into
                        q_proj / k_proj / v_proj, Gated DeltaNet's [q; k; v; z; b; a] into
                        in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, [gate; up] into gate_proj /
                        up_proj, the vision qkv's per-head order; lora_A = A, the same for every
                        projection cut from one fused weight
  routed experts        transformers holds them as 3D parameters, experts.gate_up_proj [E, 2F, H] and
                        experts.down_proj [E, H, F]; PEFT adapts such a parameter through
                        ``target_parameters`` (``lora.ParamWrapper`` in peft/tuners/lora/layer.py): one
                        lora_A [E*r, in] it reads as [E, r, in] (expert-major) and one lora_B
                        [out, r*E] it reads as [out, r, E] (rank-major); expert e's change is
                        scale * B[:, :, e] @ A[e], so every expert keeps its own adapter exactly

Key names and shapes are PEFT's own: PEFT puts the adapter on transformers' model built on the meta
device (no memory, no weights), each tensor is written under the name PEFT gives its wrapper there
(two adapted parameters of one experts module nest: one wrapper is ``experts``, the other
``experts.base_layer``), and the file must hold exactly the keys and shapes PEFT saves.
``target_modules`` are the shortest module-name suffixes that match the adapted linears and nothing
else in transformers' model.

Only the adapters are read: the base weights stay on the meta device (``weightless_model.py``), so
the export holds the adapters, whatever the model's size.

Self-check, before anything is written: every pair, read back as PEFT reads it, gives the Megatron
adapter's own change through the weight's rule, scale * B_hf A_hf = to_hf(dW), within fp32 rounding
(computed in float64); otherwise the export is refused naming the tensor.

What PEFT cannot carry: dropout on expert adapters (ParamWrapper refuses any ``lora_dropout``: it is
written as 0 then, which changes nothing at inference), and adapters on modules transformers' model
does not build (its Qwen3.5 has no MTP head; ``lora/targets.py`` never adapts it), which are refused.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings

import torch
from safetensors import SafetensorError

from examples.multimodal_dev.models import model_of

from ..progress import Progress
from .hf_conversion import open_megatron
from .hf_export import check_apart, finish_output, start_output, write_failure
from .hf_models import hf_classes
from .lora_checkpoint import adapted_linears
from .weightless_model import put_parameter

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # beside peft's own adapter_config.json
PEFT_PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's names in saved keys
FLAG = "--peft-path"
# The self-check compares one fused weight, or this many bytes of float64 expert weights, at a time:
# routed experts of a large model are tens of GB in float64.
CHECK_BYTES = 1 << 28


def hf_halves(rule, a_list: list, b_list: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) for each HF tensor of ``rule``, from the adapters of its Megatron weights in rule order:
    [r, in] / [out, r] for a linear; [E, r, in] / [E, out, r] for a 3D experts parameter."""
    b_hf = rule.to_hf(b_list)
    if len(a_list) == 1:  # one fused weight: every projection cut from it shares A
        return [(a_list[0], b) for b in b_hf]
    assert len(b_hf) == 1, f"{rule.hf}: only routed experts map several weights to one"
    return [(torch.stack(a_list), b_hf[0])]  # one adapter per expert, stacked as the weights are


def to_peft(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A, lora_B) as PEFT stores them: a linear's as they are; experts' flattened (see the top)."""
    if a.dim() == 3:
        experts, rank, _ = a.shape
        a, b = a.reshape(experts * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)
    # each its own storage: safetensors refuses tensors that share memory (A shared by projections)
    return a.to(dtype).contiguous().clone(), b.to(dtype).contiguous().clone()


def peft_delta(lora_a, lora_b, scale: float, experts: int | None, first: int = 0, last: int | None = None):
    """The weight change PEFT makes of a stored pair, in float64: ``B A`` for a linear; for a 3D experts
    parameter [E, out, in], A read as [E, r, in] and B as [out, r, E], experts ``first:last`` only."""
    a, b = lora_a.double(), lora_b.double()
    if experts is None:
        return (b @ a) * scale
    a3 = a.reshape(experts, -1, a.shape[-1])[first:last]
    b3 = b.reshape(b.shape[0], -1, experts)[:, :, first:last]
    return torch.einsum("ore,eri->eoi", b3, a3) * scale


@torch.no_grad()
def self_check(megatron_path: str, rule, linears: dict, written: dict, experts: dict) -> None:
    """Every pair of ``rule``'s HF tensors, read back as PEFT reads it (``written``: HF name ->
    (lora_A, lora_B)), gives to_hf of its Megatron adapters' own changes within fp32 rounding."""
    modules = [n.removesuffix(".weight") for n in rule.megatron]
    weight = linears[modules[0]].weight
    step = max(1, CHECK_BYTES // (8 * weight.numel())) if len(modules) > 1 else 1
    for first in range(0, len(modules), step):
        part = [linears[m] for m in modules[first : first + step]]
        # a rule over several weights (the routed experts) maps each on its own: a slice at a time
        wants = rule.to_hf([m.delta_weight() for m in part])
        for name, want in zip(rule.hf, wants):
            lora_a, lora_b = written[name]
            count = experts.get(name)
            got = peft_delta(lora_a, lora_b, part[0].lora_scale, count, first, first + len(part) if count else None)
            bound = torch.finfo(torch.float32).eps * want.abs().max().item()
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
            if not diff <= bound:
                raise ValueError(
                    f"--megatron-path {megatron_path}: the PEFT adapter of {name} (from {modules[0]}) is not "
                    f"the weight's own change: max |diff| {diff:.3g} above {bound:.3g}; nothing written"
                )


def adapted_rules(rules, linears: dict):
    """The rules whose Megatron weights carry adapters (all of them: the targets adapt every routed
    expert of a layer or none)."""
    for rule in rules:
        modules = [n.removesuffix(".weight") for n in rule.megatron]
        adapted = [m for m in modules if m in linears]
        if adapted:
            assert len(adapted) == len(modules), f"{rule.hf}: some of {modules} have no adapter"
            yield rule


def _suffixes(targets: set[str], universe) -> list[str]:
    """For each target the shortest dotted suffix that PEFT's name matching (the name itself, or a name
    ending in '.' + suffix) finds on targets only."""
    chosen: set[str] = set()
    for name in sorted(targets):
        if any(name == s or name.endswith("." + s) for s in chosen):
            continue
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if all(u in targets for u in universe if u == suffix or u.endswith("." + suffix)):
                chosen.add(suffix)
                break
    return sorted(chosen)


def peft_layout(megatron_path: str, shape, hf_names: list, lora, base_model: str | None):
    """(LoraConfig, {HF tensor: PEFT's saved prefix of its adapter}, {saved key: shape}, {3D experts
    parameter: E}) for adapters on the HF tensors ``hf_names``: PEFT's adapter put on transformers'
    model of ``shape`` built on the meta device."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer, ParamWrapper

    cfg = model_of(shape).shape_to_hf(shape)
    config_cls, model_cls = hf_classes(cfg.pop("model_type"))
    with torch.device("meta"):
        hf = model_cls(config_cls(**cfg))
    modules = {n for n, _ in hf.named_modules()}
    params = dict(hf.named_parameters())
    linears = {n.removesuffix(".weight") for n in hf_names if n.removesuffix(".weight") in modules}
    experts = {n: params[n].shape[0] for n in hf_names if n in params and params[n].dim() == 3}
    absent = sorted(set(hf_names) - {f"{n}.weight" for n in linears} - set(experts))
    if absent:
        raise ValueError(
            f"--megatron-path {megatron_path}: transformers' model has no module for the adapter of "
            f"{absent[0]}; PEFT cannot carry it"
        )
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=_suffixes(linears, modules),
        target_parameters=_suffixes(set(experts), params) or None,
        lora_dropout=0.0 if experts else lora.dropout,  # ParamWrapper refuses dropout
        bias="none",
        base_model_name_or_path=base_model,
        inference_mode=True,
    )
    with warnings.catch_warnings():  # transformers' deprecation notices as PEFT wraps the model
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(hf, copy.deepcopy(config))  # it rewrites its config (the base's name)
    prefixes = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            # a wrapper on a wrapper (two parameters of one experts module) sits at NAME.base_layer
            path = name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
            leaf = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
            prefixes[f"{path}.{leaf}"] = name
    if set(prefixes) != set(hf_names):
        odd = sorted(set(prefixes) ^ set(hf_names))[0]
        raise ValueError(f"--megatron-path {megatron_path}: PEFT's adapter and the checkpoint's differ at {odd}")
    keys = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    return config, prefixes, keys, experts


def export_peft(
    megatron_path: str,
    peft_path: str,
    base_model_name_or_path: str | None = None,
    hf_config_path: str | None = None,
    overwrite: bool = False,
    lora_base: str | None = None,
) -> dict:
    check_apart(megatron_path, peft_path, FLAG)
    partial = start_output(peft_path, overwrite, FLAG)
    try:
        opened = open_megatron(megatron_path, hf_config_path, lora_base)
        shape, dtypes, lora = opened.shape, opened.dtypes, opened.lora
        if lora is None:
            raise ValueError(f"--megatron-path {megatron_path}: holds no LoRA adapters; nothing to export with PEFT")
        linears = _adapters_read(opened)
        rules = list(adapted_rules(model_of(shape).hf_mapping_rules(shape), linears))
        hf_names = [name for rule in rules for name in rule.hf]
        config, prefixes, keys, experts = peft_layout(megatron_path, shape, hf_names, lora, base_model_name_or_path)
        tensors = _peft_tensors(megatron_path, rules, linears, dtypes, prefixes, experts)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        if shapes != keys:
            odd = sorted(set(shapes.items()) ^ set(keys.items()))[0]
            raise ValueError(f"--megatron-path {megatron_path}: the adapter's tensors are not PEFT's: {odd}")
        try:
            _write(partial, config, tensors)
            finish_output(partial, peft_path)
        except (OSError, SafetensorError) as err:
            raise write_failure(peft_path, err, FLAG) from err
    except BaseException:  # interrupted too: never leave OUT.partial behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {
        "adapters": len(linears),
        "linears": len(hf_names) - len(experts),
        "expert_parameters": len(experts),
        "target_modules": sorted(config.target_modules),
        "target_parameters": sorted(config.target_parameters or ()),
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": config.lora_dropout,
        "run_dropout": lora.dropout,
        "base": lora.base,
    }


def _peft_tensors(megatron_path: str, rules, linears: dict, dtypes: dict, prefixes: dict, experts: dict) -> dict:
    """PEFT's saved tensors of every adapted rule, each pair self-checked as it is made."""
    tensors = {}
    total = sum(4 * t.numel() for m in linears.values() for t in (m.lora_A, m.lora_B))
    with Progress("export-peft", sum(len(rule.hf) for rule in rules), total) as progress:
        for rule in rules:
            source = rule.megatron[0].removesuffix(".weight")
            dtype = dtypes.get(f"{source}.lora_A", linears[source].lora_A.dtype)
            a_list = [linears[n.removesuffix(".weight")].lora_A.detach() for n in rule.megatron]
            b_list = [linears[n.removesuffix(".weight")].lora_B.detach() for n in rule.megatron]
            written = {}
            for name, (a, b) in zip(rule.hf, hf_halves(rule, a_list, b_list)):
                written[name] = to_peft(a, b, dtype)
                tensors[f"{prefixes[name]}.lora_A.weight"], tensors[f"{prefixes[name]}.lora_B.weight"] = written[name]
            self_check(megatron_path, rule, linears, written, experts)
            progress.advance(sum(4 * (a.numel() + b.numel()) for a, b in zip(a_list, b_list)), len(rule.hf))
    return tensors


def _adapters_read(opened) -> dict:
    """The adapted linears of the weightless model with their adapters read from the checkpoint (in
    fp32, as the conversion model held them); the base weights are never read."""
    linears = adapted_linears(opened.model)
    names = [f"{n}.{half}" for n in linears for half in ("lora_A", "lora_B")]
    with opened.tensors() as reader:
        for name, tensor in reader.read(names, dtype=torch.float32).items():
            put_parameter(opened.model, name, tensor)
    return adapted_linears(opened.model)


def _write(out: str, config, tensors: dict) -> None:
    from safetensors.torch import save_file

    config.save_pretrained(out)
    save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})

"""The environment laid over a recipe: ``from_env`` reads ``variables.py``'s names only, turns each
value into its field's type (refusing a malformed one in one line naming the variable), and resolves
the settings the host and the model decide (the backend, the experts, sequence parallelism, MTP).

The model comes first: it picks the recipe (``HF_CONFIG``, the import's ``hf_config.json`` in
``CKPT_LOAD``, ``MODEL_VARIANT``, else the host's default)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..lora.targets import DEFAULT_TARGETS
from ..models import DEFAULT_ARCH, ModelShape, get_model_entry
from ..models.setting_names import ON_THE_BASE_MODES
from . import recipes, slurm
from .parsers import names, switch
from .run_config import LaunchError, Model, RunConfig, settings
from .variables import NAMES, misspelt


@dataclass(frozen=True)
class Host:
    gpu: bool  # a GPU the driver sees
    transformer_engine: Callable[[], bool] = lambda: False  # Transformer Engine imports (asked when needed)


@dataclass
class Environment:
    """The variables set (an empty value reads as unset, as ``${NAME:-default}`` does), over the
    defaults of the SLURM step the launch runs in (``slurm.py``)."""

    environ: Mapping[str, str]
    step: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> str | None:
        assert name in NAMES, f"{name} is not in variables.py's table"
        return self.environ.get(name) or self.step.get(name)


# Read before the recipe exists: they choose it
CHOOSE_THE_MODEL = ("MODEL_VARIANT", "HF_CONFIG", "MOE")


def choose_model(env: Environment, host: Host, said: list[str]) -> tuple[RunConfig, ModelShape]:
    """The recipe and the model's shape, from HF_CONFIG, the import in CKPT_LOAD, MOE or MODEL_VARIANT."""
    hf_config, ckpt_load = env.get("HF_CONFIG"), env.get("CKPT_LOAD")
    if not hf_config and ckpt_load and os.path.isfile(os.path.join(ckpt_load, "hf_config.json")):
        hf_config = os.path.join(ckpt_load, "hf_config.json")
        said.append(f"model shape from {hf_config} (written by convert_checkpoint.py import)")
    variant = env.get("MODEL_VARIANT")
    if hf_config:
        if not os.path.isfile(hf_config):
            raise LaunchError(f"HF_CONFIG={hf_config}: no such file")
        variant = "hf_config"
    elif not variant:
        variant = "proxy" if host.gpu else "tiny"
        said.append(f"MODEL_VARIANT not set; using '{variant}' ({'GPU found' if host.gpu else 'no GPU'})")
    moe = switch()("MOE", env.get("MOE") or "0")
    config = recipes.for_host(variant, host.gpu)
    what = f"HF_CONFIG={hf_config}" if hf_config else "MOE=1" if moe else f"MODEL_VARIANT={variant}"
    if hf_config:
        config = recipes.with_shape_from(config, hf_config)
    elif moe:  # tiny with 4 experts (top-2), for expert-parallel runs on CPU
        if variant != "tiny":
            raise LaunchError(f"MOE=1 applies to MODEL_VARIANT=tiny only ({variant} is fixed)")
        config = replace(config, model=replace(config.model, moe=True))
    try:
        return config, shape_of(config.model)
    except (KeyError, ValueError, OSError) as err:
        reason = err.args[0] if isinstance(err, (KeyError, ValueError)) and err.args else err
        raise LaunchError(f"{what}: {reason}") from None


def shape_of(model: Model) -> ModelShape:
    """The shape a run's model section names (a Hugging Face config, tiny's MoE form, or a variant)."""
    entry = get_model_entry(DEFAULT_ARCH)  # the script trains the registry's default architecture
    if model.hf_config:
        return entry.shape_from_hf(model.hf_config)
    return entry.shape_fn(model.variant, moe=True) if model.moe else entry.shape_fn(model.variant)


def overlay(config: RunConfig, env: Environment) -> RunConfig:
    """``config`` with every variable set in the environment, each parsed into its field's type."""
    changes: dict[str, dict[str, Any]] = {}
    for section, attribute, setting in settings():  # in the order declared: the first malformed one is named
        text = env.get(setting.name)
        if text is not None and setting.name not in CHOOSE_THE_MODEL:
            changes.setdefault(section, {})[attribute] = setting.parse(setting.name, text)
    if env.get("PACKING") == "tokens" and env.get("MBS") is None:
        changes.setdefault("batch", {})["mbs"] = 1  # a micro-batch is one row
    return replace(config, **{s: replace(getattr(config, s), **c) for s, c in changes.items()})


def _lora_targets(config: RunConfig) -> set[str]:
    """The linears LoRA adapts, by target name (none without ``LORA_RANK``)."""
    if not config.lora.rank:
        return set()
    return {t.strip() for t in (config.lora.targets or ",".join(DEFAULT_TARGETS)).split(",")}


def lora_on_experts(config: RunConfig) -> bool:
    """LoRA adapts the routed experts' linears (on the local backend's grouped experts, or SequentialMLP's)."""
    return bool({"linear_fc1", "linear_fc2"} & _lora_targets(config))


def lora_in_vision(config: RunConfig) -> bool:
    """LoRA adapts linears of the vision tower (``vision.*`` targets)."""
    return any(t.startswith("vision.") for t in _lora_targets(config))


def resolve(config: RunConfig, shape: ModelShape, host: Host, said: list[str]) -> RunConfig:
    """The settings the model and the host decide, where the environment left them unset."""
    layout, backend, model = config.layout, config.backend, config.model
    if layout.sp is None:
        layout = replace(layout, sp=layout.tp > 1 and shape.text.is_moe)
    if model.mtp is None:  # a Hugging Face config's MTP head trains (not under DPO, GRPO); a variant's if asked
        trains_head = config.post_training.mode not in ON_THE_BASE_MODES  # the head has no loss of theirs
        model = replace(model, mtp=bool(model.hf_config) and shape.text.mtp_num_layers > 0 and trains_head)
    if shape.text.is_moe and backend.dispatcher is None:
        backend = replace(backend, dispatcher="alltoall" if host.gpu and layout.ep > 1 else "allgather")
    if backend.transformer_impl is None and config.lora.rank:  # the adapters' checked backend (docs/lora.md)
        backend = replace(backend, transformer_impl="local")
        said.append("backend local (LoRA's default; TRANSFORMER_IMPL=transformer_engine puts adapters on TE)")
    elif backend.transformer_impl is None:
        impl = "transformer_engine" if host.gpu and host.transformer_engine() else "local"
        backend = replace(backend, transformer_impl=impl)
        said.append(f"backend {impl} ({'GPU' if host.gpu else 'CPU'} host; TRANSFORMER_IMPL overrides)")
    if shape.text.is_moe and backend.grouped_experts is None:
        # the local backend's grouped experts take adapters (lora/grouped.py); TE's TEGroupedMLP does not
        te_adapted = lora_on_experts(config) and backend.transformer_impl == "transformer_engine"
        backend = replace(backend, grouped_experts=not te_adapted)
    return replace(config, layout=layout, backend=backend, model=model)


def from_env(environ: Mapping[str, str], host: Host, said: list[str]) -> tuple[RunConfig, ModelShape, list[str]]:
    """(the run, the model's shape, what to say once the checks pass); ``said`` gets what to say
    before them. LaunchError names the first variable that is malformed."""
    env, after = Environment(environ), []
    if line := misspelt(environ, names("UNCHECKED_VARIABLES", env.get("UNCHECKED_VARIABLES") or "")):
        raise LaunchError(line)
    try:
        env.step = slurm.step_nodes(environ)
    except ValueError as err:
        raise LaunchError(err.args[0]) from None
    taken = {k: v for k, v in env.step.items() if not environ.get(k)}
    if taken:
        said.append(f"SLURM step: {' '.join(f'{k}={v}' for k, v in taken.items())} (the variables override)")
    config, shape = choose_model(env, host, said)
    return resolve(overlay(config, env), shape, host, after), shape, after

"""A forward pass of a weightless model whose weights are put in one module at a time: how verify runs
both models of a checkpoint of any size, holding a decoder layer of each at a time, never the model.

The model is built on the meta device (``weightless_model.py``; transformers' model the same way,
its rotary buffers made by its own initialisation, as its ``from_pretrained`` makes them). It is cut
into units, each a module whose forward uses only its own weights: the vision tower (whole: its blocks
read the position table outside their own forward), the embedding, a decoder layer, the final norm,
the output head; a forward pre-hook puts a unit's weights in (``load(names)``) and a forward hook
takes them out again. A unit the model reads outside its own forward stays in for the whole pass
(``resident``): a tied embedding, which the output head reads. Every parameter belongs to exactly one
unit, checked up front, so a module added to a model later cannot run on meta.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .weightless_model import empty_parameter, put_parameter


class StreamedWeights:
    """``with StreamedWeights(model, units, resident, load):`` runs ``model``'s forwards with each unit's
    weights in only while the unit runs. ``units`` / ``resident``: module names; ``load(names)``:
    {parameter name: tensor} for the names asked."""

    def __init__(
        self,
        model: torch.nn.Module,
        units: list[str],
        resident: list[str],
        load: Callable[[list[str]], dict[str, torch.Tensor]],
    ):
        self.model, self.load = model, load
        names = [n for n, _ in model.named_parameters()]
        self.of_unit = {u: [n for n in names if n.startswith(u + ".")] for u in [*resident, *units]}
        owners = [n for members in self.of_unit.values() for n in members]
        unowned = sorted(set(names) - set(owners))
        twice = sorted({n for n in owners if owners.count(n) > 1})
        if unowned or twice:
            raise AssertionError(
                f"units must hold every parameter once: none holds {unowned[:3]}, two hold {twice[:3]}"
            )
        # a tied weight is one parameter under two names (transformers' lm_head and embed_tokens): the
        # names after the first are its aliases, given the same tensor
        by_id: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(param), []).append(name)
        self.aliases = {names[0]: names[1:] for names in by_id.values()}
        self.resident, self.units, self._hooks = resident, units, []

    def unit_bytes(self, unit: str) -> int:
        """The bytes of ``unit``'s weights (as the model's parameters say, in or out)."""
        return sum(
            self.model.get_parameter(n).numel() * self.model.get_parameter(n).element_size() for n in self.of_unit[unit]
        )

    def _put(self, unit: str) -> None:
        tensors = self.load(self.of_unit[unit])
        for name, tensor in tensors.items():
            put_parameter(self.model, name, tensor)
            self._alias(name)

    def _take(self, unit: str) -> None:
        for name in self.of_unit[unit]:
            empty_parameter(self.model, name)
            self._alias(name)

    def _alias(self, name: str) -> None:
        param = self.model.get_parameter(name)
        for alias in self.aliases.get(name, ()):
            path, _, leaf = alias.rpartition(".")
            self.model.get_submodule(path)._parameters[leaf] = param

    def __enter__(self) -> StreamedWeights:
        for unit in self.resident:
            self._put(unit)
        for unit in self.units:
            module = self.model.get_submodule(unit)
            self._hooks.append(module.register_forward_pre_hook(lambda m, a, u=unit: self._put(u)))
            self._hooks.append(module.register_forward_hook(lambda m, a, o, u=unit: self._take(u)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        for unit in [*self.resident, *self.units]:
            if any(not self.model.get_parameter(n).is_meta for n in self.of_unit[unit]):
                self._take(unit)


def megatron_units(model) -> tuple[list[str], list[str]]:
    """(streamed, resident) units of the Qwen3.5-VL Megatron model: the vision tower, the embedding,
    each decoder layer, the final norm, the output head and the MTP head one at a time; a tied
    embedding throughout (the output head reads it outside the embedding's forward)."""
    lm = "language_model"
    layers = [f"{lm}.decoder.layers.{i}" for i in range(len(model.language_model.decoder.layers))]
    # the word embeddings, not megatron's embedding module: the model embeds a row itself (models/base.py)
    embedding = f"{lm}.embedding.word_embeddings"
    units = ["vision_model", embedding, *layers, f"{lm}.decoder.final_layernorm", f"{lm}.output_layer", f"{lm}.mtp"]
    present = {n for n, _ in model.named_modules()}
    resident = [embedding] if model.language_model.share_embeddings_and_output_weights else []
    return [u for u in units if u in present and u not in resident], resident


def hf_units(model) -> tuple[list[str], list[str]]:
    """The same for transformers' ``Qwen3_5(Moe)ForConditionalGeneration``."""
    lm = "model.language_model"
    layers = [f"{lm}.layers.{i}" for i in range(len(model.model.language_model.layers))]
    units = ["model.visual", f"{lm}.embed_tokens", *layers, f"{lm}.norm", "lm_head"]
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    resident = [f"{lm}.embed_tokens"] if tied else []
    return [u for u in units if u not in resident], resident


def hf_weightless(config):
    """transformers' model of ``config`` on the meta device, in fp32, with its non-persistent buffers
    (rotary frequencies) on the host, made by the model's own ``_init_weights`` as ``from_pretrained``
    makes them after building on meta."""
    from .hf_models import hf_classes

    _, model_cls = hf_classes(config.model_type)
    with torch.device("meta"):
        model = model_cls(config).float()
    for module in model.modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            model._init_weights(module)
    return model.eval()

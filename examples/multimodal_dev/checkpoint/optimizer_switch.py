"""Resume a checkpoint's optimizer state with the other kind of optimizer: distributed <-> plain.

megatron 0.19.2 stores the two optimizers' state under different structures and loads neither from
the other. The tensors are the same, though: the distributed optimizer's ``fully_reshardable``
format (this playground's default, ``optimizer_format.py``) writes every parameter's Adam moments
in the model's own layout under the keys the plain optimizer uses, ``optimizer.state.exp_avg.<param>``
and ``optimizer.state.exp_avg_sq.<param>``. What differs:

- the fp32 main weights: the distributed optimizer stores them as ``optimizer.state.param.<param>``;
  the plain fp16 / bf16 optimizer as ``optimizer.state.fp32_param.<param>``; the plain fp32
  optimizer not at all (its main weights are the model's, which the checkpoint holds anyway);
- the step and the parameter groups: the distributed optimizer keeps the step in every group, the
  plain one as ``common_step`` beside the per-parameter state.

``expect(saved_distributed, saved_half)`` is called before the load when the checkpoint was saved by
the other kind; the load request of this run's optimizer is then renamed to the saved keys, and the
loaded state translated into the structure its ``load_state_dict`` reads. Every other load is left
alone. A ``dp_reshardable`` checkpoint holds bucket slices, not parameters: it is refused before
this point (``optimizer_format.check_layout_change``).
"""

from __future__ import annotations

import functools
from dataclasses import replace

_saved: dict | None = None  # {"distributed": bool, "half": bool} while a foreign load is pending

MAIN_DIST, MAIN_HALF = "optimizer.state.param.", "optimizer.state.fp32_param."


def expect(saved_distributed: bool, saved_half: bool) -> None:
    """The next optimizer load reads a checkpoint saved by the other kind of optimizer."""
    global _saved
    _saved = {"distributed": saved_distributed, "half": saved_half}


def _pending(distributed: bool) -> bool:
    """Whether this optimizer (distributed or not) is loading the other kind's checkpoint."""
    return _saved is not None and _saved["distributed"] != distributed


def _renamed(sharded, old_prefix: str, new_prefix: str):
    assert sharded.key.startswith(old_prefix), sharded.key
    return replace(sharded, key=new_prefix + sharded.key[len(old_prefix) :])


# --- a distributed optimizer reading a plain optimizer's checkpoint ------------------------------


def _plain_request_for_distributed(state: dict) -> dict:
    """The fully reshardable request with the main weights where the plain optimizer put them, or,
    after an fp32 run (whose main weights are its model weights), without them: they are taken
    from the model when the state is loaded (``_params_in_state_order``)."""
    for tensors in state["param_state"].values():
        if _saved["half"]:
            tensors["param"] = _renamed(tensors["param"], MAIN_DIST, MAIN_HALF)
        else:
            del tensors["param"]
    return state


def _params_in_state_order(optimizer) -> list:
    """The model's parameters in the order of the fully reshardable state's entries (megatron's
    ``sharded_param_state_fully_reshardable`` walks the buffers the same way). These are the live
    parameters, loaded by the time the optimizer is: the checkpoint load works on copies of what
    the request holds, so a parameter put into the request would come back as it was before."""
    return [
        param
        for gbuf_idx, ranges in enumerate(optimizer.gbuf_ranges)
        for _ in ranges
        for param in optimizer.buffers[gbuf_idx].param_index_map
    ]


def _plain_groups_and_step(loaded: dict) -> tuple[list, object]:
    """(param groups, step) of a loaded plain optimizer checkpoint: fp32 saves them at the top,
    fp16 / bf16 under ``optimizer``."""
    inner = loaded["optimizer"] if "optimizer" in loaded and "state" in loaded["optimizer"] else loaded
    return inner["param_groups"], inner["state"].get("common_step")


def _distributed_from_plain(loaded: dict, params: list) -> dict:
    groups, step = _plain_groups_and_step(loaded)
    param_state = loaded["param_state"]
    if not _saved["half"]:
        if len(params) != len(param_state):
            raise ValueError(f"the optimizer state holds {len(param_state)} parameters, the model {len(params)}")
        param_state = {i: {**tensors, "param": params[i]} for i, tensors in param_state.items()}
    step = float(step) if step is not None else 0.0
    out = {
        "optimizer": {
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "step": step} for g in groups]
        },
        "param_state": param_state,
        "param_state_sharding_type": "fully_reshardable",
    }
    if "grad_scaler" in loaded:
        out["grad_scaler"] = loaded["grad_scaler"]
    return out


# --- a plain optimizer reading a distributed optimizer's checkpoint ------------------------------


def _distributed_request_for_plain(state: dict) -> dict:
    if "fp32_from_fp16_params" in state:  # fp16 / bf16: the main weights under the distributed name
        state["fp32_from_fp16_params"] = [
            [_renamed(t, MAIN_HALF, MAIN_DIST) for t in group] for group in state["fp32_from_fp16_params"]
        ]
    return state


def _plain_from_distributed(loaded: dict, current_groups: list, half: bool) -> dict:
    """The plain optimizer's state dict: the saved groups' settings with this optimizer's parameter
    ids in its own group order (megatron pairs groups by their settings and ids by position)."""
    import torch

    saved_groups = loaded["optimizer"]["param_groups"]
    steps = {g["step"] for g in saved_groups if "step" in g}
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's parameter groups disagree on the step: {sorted(steps)}")
    state = {k: v for k, v in (loaded.get("optimizer", {}).get("state") or loaded.get("state") or {}).items()}
    if steps:
        state["common_step"] = torch.tensor(steps.pop(), dtype=torch.float32)
    groups = [{**g, "params": cur["params"]} for g, cur in zip(_matched(saved_groups, current_groups), current_groups)]
    inner = {"state": state, "param_groups": groups}
    if not half:
        return inner
    out = {"optimizer": inner, "fp32_from_fp16_params": loaded["fp32_from_fp16_params"]}
    if "grad_scaler" in loaded:
        out["grad_scaler"] = loaded["grad_scaler"]
    return out


def _matched(saved_groups: list, current_groups: list) -> list:
    """The saved group of each current group, by megatron's identifying settings."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def ident(group):
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)

    by_ident = {ident(g): g for g in saved_groups}
    missing = [ident(g) for g in current_groups if ident(g) not in by_ident]
    if missing:
        raise ValueError(
            f"the checkpoint's optimizer has no parameter group for {missing[0]} "
            f"(settings {param_group_identifier_keys})"
        )
    return [by_ident[ident(g)] for g in current_groups]


def _saved_by_other(state_dict: dict, distributed: bool) -> bool:
    """A plain optimizer's state has per-parameter ``state`` (at the top, or under ``optimizer``
    for fp16 / bf16); a distributed optimizer's names its ``param_state_sharding_type``."""
    if distributed:
        return "state" in state_dict or "state" in (state_dict.get("optimizer") or {})
    return "param_state_sharding_type" in state_dict


# --- the replacements (rows of megatron_changes, group optimizer-switch) -------------------------------


def switching_request(original_request, run=None, *, distributed: bool, half: bool):
    """An optimizer's ``sharded_state_dict``: loading a checkpoint of the other kind, it asks for what
    that checkpoint holds (megatron_changes row)."""

    @functools.wraps(original_request)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None, **kwargs):
        if not (is_loading and _pending(distributed)):
            return original_request(self, model_sharded_state_dict, is_loading, metadata=metadata, **kwargs)
        if distributed:  # the plain checkpoint holds parameters: read them as the fully reshardable format does
            metadata = {**(metadata or {}), "distrib_optim_sharding_type": "fully_reshardable"}
            state = original_request(self, model_sharded_state_dict, is_loading, metadata=metadata, **kwargs)
            return _plain_request_for_distributed(state)
        return _distributed_request_for_plain(
            original_request(self, model_sharded_state_dict, is_loading, metadata=metadata, **kwargs)
        )

    return sharded_state_dict


def switching_load(original_load, run=None, *, distributed: bool, half: bool):
    """An optimizer's ``load_state_dict``: a checkpoint of the other kind is translated first
    (megatron_changes row)."""

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        global _saved
        # the distributed optimizer also loads its own state dict while building its request
        if not (_pending(distributed) and isinstance(state_dict, dict) and _saved_by_other(state_dict, distributed)):
            return original_load(self, state_dict)
        if distributed:
            translated = _distributed_from_plain(state_dict, _params_in_state_order(self))
        else:
            translated = _plain_from_distributed(state_dict, self.optimizer.state_dict()["param_groups"], half)
        _saved = None
        return original_load(self, translated)

    return load_state_dict

"""megatron-core's DistributedOptimizer with torch's own Adam, i.e. without Apex or Transformer
Engine (every CPU host, and GPU hosts that train on the local backend). Two paths of
``distrib_optimizer.py`` assume a fused Adam there:

- ``state_dict()`` reads Adam's per-parameter ``step`` and asserts one value; loading a
  checkpoint into a fresh optimizer (no state yet) asks for it before the state exists. The
  state is created first, with the placeholder values megatron itself loads into; an optimizer
  with no parameter on the rank has no step, and its groups are written without one, as the
  fused path does.
- ``_set_main_param_and_optimizer_states`` copies loaded values in place into the fp32 main
  parameter, a leaf that requires grad; torch refuses that outside ``no_grad``. It also expects
  every tensor of torch Adam's state in the checkpoint, and the fully reshardable format stores
  no per-parameter ``step``: absent entries are left as they are.
- ``load_state_dict`` puts the checkpoint's step into Adam's per-parameter state, and then the
  parameter-state load overwrites it with the placeholder's step (1): the next update after a
  resume used the wrong bias correction, silently (grad norm 3.9773 vs 3.9858 two steps after a
  resume of the tiny model). The step is put back after the whole load.

Each fix is a factory ``fix(original) -> replacement`` that checks the method still has the
signature it was written against. The project's table of changes to megatron
(``examples/multimodal_dev/megatron_changes``) applies them on every host without Apex or TE (where
those provide the fused optimizer, nothing is replaced).
"""

from __future__ import annotations

import functools
import inspect


def _expect(fn, params: tuple[str, ...]) -> None:
    have = tuple(inspect.signature(fn).parameters)
    if have[: len(params)] != params:
        raise RuntimeError(
            f"megatron-core's {fn.__qualname__}{have} changed (expected {params}); "
            "megatron.cpu.distrib_optimizer_fixes needs updating"
        )


class _AbsentIsNone(dict):
    """Loaded tensors; a state the checkpoint does not carry reads as None (megatron skips those)."""

    def __missing__(self, key):
        return None


def _stepless_state_dict(optimizer) -> dict:
    """The state dict of a distributed optimizer with no parameter on this rank, as megatron writes
    it under a fused Adam (whose path allows no step): its param groups' settings. megatron builds
    such an optimizer where a rank holds none of a kind of parameter, so that the rank still joins
    the grad-norm reductions: the expert optimizer of a rank that holds only the vision tower, when
    the language model's experts are split over EP ranks (vision_ranks/groups.py)."""
    inner = optimizer.optimizer.state_dict()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
    state = {
        "optimizer": {**{k: v for k, v in inner.items() if k not in ("state", "param_groups")}, "param_groups": groups}
    }
    if optimizer.grad_scaler:
        state["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return state


def state_dict_with_state(state_dict, run=None):
    """``state_dict`` that creates the state first, and writes the groups alone with no parameter here."""
    _expect(state_dict, ("self",))

    @functools.wraps(state_dict)
    def state_dict_with_state(self):
        if not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        if not self.optimizer.state:  # no parameter of this optimizer on this rank: no step to read
            return _stepless_state_dict(self)
        return state_dict(self)

    return state_dict_with_state


def set_states_without_grad(set_states, run=None):
    """``_set_main_param_and_optimizer_states`` under ``no_grad``, absent entries left as they are."""
    _expect(set_states, ("self", "model_param", "tensors"))

    @functools.wraps(set_states)
    def set_states_without_grad(self, model_param, tensors):
        import torch

        with torch.no_grad():
            return set_states(self, model_param, _AbsentIsNone(tensors))

    return set_states_without_grad


def load_state_dict_keeping_step(load_state_dict, run=None):
    """``load_state_dict`` that puts the checkpoint's Adam step back after the whole load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _expect(load_state_dict, ("self", "state_dict"))
    _expect(DistributedOptimizer._init_optimizer_states_with_dummy_values, ("self",))

    @functools.wraps(load_state_dict)
    def load_state_dict_keeping_step(self, checkpoint):
        groups = (checkpoint.get("optimizer") or {}).get("param_groups", [])
        steps = {g["step"] for g in groups if "step" in g}
        if not any(group["params"] for group in self.optimizer.param_groups):
            return checkpoint  # no parameter on this rank: no state to load (_stepless_state_dict)
        result = load_state_dict(self, checkpoint)
        if len(steps) == 1:
            import torch

            step = float(steps.pop())
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(step, dtype=torch.float32)
        return result

    return load_state_dict_keeping_step

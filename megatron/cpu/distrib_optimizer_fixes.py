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

``install`` is a no-op where Apex or TE provide the fused optimizer, and checks the patched
methods still have the signatures these fixes were written against.
"""

from __future__ import annotations

import functools
import inspect

_installed = False


def _expect(fn, params: tuple[str, ...]) -> None:
    have = tuple(inspect.signature(fn).parameters)
    if have[:len(params)] != params:
        raise RuntimeError(f"megatron-core's {fn.__qualname__}{have} changed (expected {params}); "
                           "megatron.cpu.distrib_optimizer_fixes needs updating")


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
    state = {"optimizer": {**{k: v for k, v in inner.items() if k not in ("state", "param_groups")},
                           "param_groups": groups}}
    if optimizer.grad_scaler:
        state["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return state


def install() -> bool:
    """Returns True when the fixes are in place (torch Adam under the distributed optimizer)."""
    global _installed
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return False
    if _installed:
        return True
    cls = do.DistributedOptimizer
    _expect(cls.state_dict, ("self",))
    _expect(cls._set_main_param_and_optimizer_states, ("self", "model_param", "tensors"))
    _expect(cls._init_optimizer_states_with_dummy_values, ("self",))
    _expect(cls.load_state_dict, ("self", "state_dict"))
    state_dict, set_states = cls.state_dict, cls._set_main_param_and_optimizer_states
    load_state_dict = cls.load_state_dict

    @functools.wraps(state_dict)
    def state_dict_with_state(self):
        if not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        if not self.optimizer.state:  # no parameter of this optimizer on this rank: no step to read
            return _stepless_state_dict(self)
        return state_dict(self)

    @functools.wraps(set_states)
    def set_states_without_grad(self, model_param, tensors):
        import torch

        with torch.no_grad():
            return set_states(self, model_param, _AbsentIsNone(tensors))

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

    cls.state_dict = state_dict_with_state
    cls.load_state_dict = load_state_dict_keeping_step
    cls._set_main_param_and_optimizer_states = set_states_without_grad
    _installed = True
    return True

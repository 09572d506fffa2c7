"""Which parallel layouts a Qwen3.5-VL shape can be split by; refused up front, naming the setting
and the value (megatron-core would assert deep inside a layer, or split heads unevenly). The run
script's launcher asks the same checks in its variables' names (``names=VARIABLES``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..setting_names import FLAGS, named

if TYPE_CHECKING:  # the registry's view of a shape: configuration.py imports this module
    from ..entry import ModelShape


def parallel_problems(
    shape: ModelShape,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    vtp: int | None = None,
    colocated: bool = True,
    names: dict[str, str] = FLAGS,
    vision: bool = True,
) -> list[str]:
    """What ``shape`` (a ``Qwen35VLShape``) cannot be split by, one line each (``vtp``: the vision
    tower's own tensor-parallel size, when it has one; ``colocated``: on the language model's ranks,
    not on ranks of its own; ``vision``: False leaves the tower to ``vision_ranks/layout.py``'s plan)."""
    t, v = shape.text, shape.vision
    k, val = t.linear_num_key_heads, t.linear_num_value_heads
    tp_is, cp_is, ep_is = named(names, "tp", tp), named(names, "cp", cp), named(names, "ep", ep)
    vision_tp, vision_tp_is = (vtp, named(names, "vtp", vtp)) if vtp else (tp, tp_is)
    checks = [
        (t.num_attention_heads % tp == 0, f"{tp_is} does not divide the {t.num_attention_heads} attention heads"),
        (
            t.num_kv_heads % tp == 0 or tp % t.num_kv_heads == 0,
            f"{tp_is} and the {t.num_kv_heads} key-value heads must divide one another",
        ),
        (k % tp == 0, f"{tp_is} does not divide the {k} Gated DeltaNet key heads"),
        (val % tp == 0, f"{tp_is} does not divide the {val} Gated DeltaNet value heads"),
        (
            not vision or v.num_heads % vision_tp == 0,
            f"{vision_tp_is} does not divide the {v.num_heads} vision attention heads",
        ),
        (
            not vision or vtp is None or (vtp >= 1 and (tp % vtp == 0 or not colocated)),
            f"{vision_tp_is} must divide {tp_is} (the vision tower's TP groups sit inside the language model's)",
        ),
        (
            (k // tp) % cp == 0 and (val // tp) % cp == 0,
            f"{cp_is} does not divide the per-TP-rank Gated DeltaNet heads (key {k // max(tp, 1)}, "
            f"value {val // max(tp, 1)})",
        ),
        (ep == 1 or t.is_moe, f"{ep_is} needs an MoE variant; this one is dense"),
        (not t.is_moe or t.num_experts % ep == 0, f"{ep_is} does not divide the {t.num_experts} experts"),
    ]
    return [message for ok, message in checks if not ok]


def validate_parallel(
    shape: ModelShape, tp: int = 1, cp: int = 1, ep: int = 1, vtp: int | None = None, colocated: bool = True
) -> None:
    """Refuse settings ``shape`` cannot be split by, every problem named (megatron's flags)."""
    problems = parallel_problems(shape, tp, cp, ep, vtp, colocated)
    if problems:
        raise ValueError("invalid parallel settings:\n  " + "\n  ".join(problems))

"""Which parallel layouts a Qwen3.5-VL shape can be split by; refused up front, naming the flag
and the value (megatron-core would assert deep inside a layer, or split heads unevenly)."""

from __future__ import annotations


def validate_parallel(
    shape, tp: int = 1, cp: int = 1, ep: int = 1, vtp: int | None = None, colocated: bool = True
) -> None:
    """Refuse settings ``shape`` (a ``Qwen35VLShape``) cannot be split by, naming the flag and the value
    (``vtp``: the vision tower's own tensor-parallel size, when it has one; ``colocated``: on the
    language model's ranks, not on ranks of its own)."""
    t, v = shape.text, shape.vision
    vision_tp = (f"--vision-tensor-parallel-size {vtp}" if vtp else f"--tensor-model-parallel-size {tp}", vtp or tp)
    checks = [
        (
            t.num_attention_heads % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide num_attention_heads {t.num_attention_heads}",
        ),
        (
            t.num_kv_heads % tp == 0 or tp % t.num_kv_heads == 0,
            f"--tensor-model-parallel-size {tp} and num_key_value_heads {t.num_kv_heads} must divide one another",
        ),
        (
            t.linear_num_key_heads % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide the Gated DeltaNet key heads {t.linear_num_key_heads}",
        ),
        (
            t.linear_num_value_heads % tp == 0,
            f"--tensor-model-parallel-size {tp} must divide the Gated DeltaNet value heads {t.linear_num_value_heads}",
        ),
        (v.num_heads % vision_tp[1] == 0, f"{vision_tp[0]} must divide the vision heads {v.num_heads}"),
        (
            vtp is None or (vtp >= 1 and (tp % vtp == 0 or not colocated)),
            f"{vision_tp[0]} must divide --tensor-model-parallel-size {tp} (the vision tower's TP groups sit inside "
            "the language model's)",
        ),
        (
            (t.linear_num_key_heads // tp) % cp == 0 and (t.linear_num_value_heads // tp) % cp == 0,
            f"--context-parallel-size {cp} must divide the per-TP-rank Gated DeltaNet heads "
            f"(key {t.linear_num_key_heads // max(tp, 1)}, value {t.linear_num_value_heads // max(tp, 1)})",
        ),
        (ep == 1 or t.is_moe, f"--expert-model-parallel-size {ep} needs an MoE variant; this one is dense"),
        (
            not t.is_moe or t.num_experts % ep == 0,
            f"--expert-model-parallel-size {ep} must divide num_experts {t.num_experts}",
        ),
    ]
    errors = [msg for ok, msg in checks if not ok]
    if errors:
        raise ValueError("invalid parallel settings:\n  " + "\n  ".join(errors))

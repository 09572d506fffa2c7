"""Which linears get a LoRA adapter (``apply.py`` puts them on a built model).

A target is a linear's name, as megatron-core names it:

    linear_qkv, linear_proj     gated attention (query/gate/key/value in; output out)
    in_proj, out_proj           Gated DeltaNet (the fused q, k, v, z, beta, alpha in; output out)
    linear_fc1, linear_fc2      the MLP: dense, every routed expert and the shared expert
    vision.NAME                 the same names in the vision tower's blocks
    vision.merger.linear_fc1    the patch merger (and .linear_fc2)

``DEFAULT_TARGETS`` covers every linear of the language model's decoder: three layers in four of
Qwen3.5 are Gated DeltaNet, so adapters named only after attention and the MLP would leave most of
the model without one. The vision tower, the output layer, the router and the MTP head keep their
weights frozen unless named.
"""

from __future__ import annotations

from dataclasses import dataclass

LANGUAGE_TARGETS = ("linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2")
VISION_TARGETS = tuple(f"vision.{n}" for n in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")) + (
    "vision.merger.linear_fc1",
    "vision.merger.linear_fc2",
)
TARGETS = LANGUAGE_TARGETS + VISION_TARGETS
DEFAULT_TARGETS = LANGUAGE_TARGETS

_LANGUAGE_PREFIX = "language_model.decoder.layers."
_VISION_BLOCKS = "vision_model.decoder.layers."
_VISION_MERGER = "vision_model.merger."


@dataclass(frozen=True)
class LoraSettings:
    """A run's adapters: their rank and targets (the planner's and the meta builds' input)."""

    rank: int
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def trains_vision(self) -> bool:
        """Adapters in the vision tower: without, nothing flows back into it (forward only, nothing kept)."""
        return any(t.startswith("vision.") for t in self.targets)

    def describe(self) -> str:
        named = "" if self.targets == DEFAULT_TARGETS else f" on {','.join(self.targets)}"
        return f"LoRA rank {self.rank}{named}"


def parse_targets(spec: str) -> tuple[str, ...]:
    """``--lora-targets``: names separated by commas, each one of ``TARGETS``; refused by name."""
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in TARGETS]
    if not names or unknown:
        raise ValueError(
            f"--lora-targets {spec!r}: {'no target named' if not names else 'no linear is named ' + ', '.join(unknown)}"
            f"; the targets are {', '.join(TARGETS)}"
        )
    return names


def target_of(name: str, targets: tuple[str, ...]) -> str | None:
    """The target that module ``name`` (a dotted path in the model) answers to, if any."""
    last = name.rpartition(".")[2]
    if name.startswith(_LANGUAGE_PREFIX) or f".{_LANGUAGE_PREFIX}" in name:
        return last if last in targets else None
    if _VISION_MERGER in name:
        target = f"vision.merger.{last}"
    elif _VISION_BLOCKS in name:
        target = f"vision.{last}"
    else:
        return None
    return target if target in targets else None


def check(args) -> None:
    """The LoRA flags of a run, refused by name before any process group (and ``--lora-alpha``
    defaulted to the rank); also a run whose freezes leave nothing to train."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank {args.lora_rank}: must be 0 (off) or a positive rank")
    frozen = [f"--freeze-{part}" for part in ("language", "vision") if getattr(args, f"freeze_{part}", False)]
    if len(frozen) == 2:
        raise ValueError("--freeze-language with --freeze-vision: nothing would train")
    if not args.lora_rank:
        # without a rank there are no adapters: these would be dropped and every weight would train
        given = [
            f"{flag} {value}"
            for flag, value, unset in (
                ("--lora-alpha", args.lora_alpha, None),
                ("--lora-dropout", args.lora_dropout, 0.0),
                ("--lora-targets", args.lora_targets, ",".join(DEFAULT_TARGETS)),
            )
            if value != unset
        ]
        if given:
            raise ValueError(f"{given[0]} without --lora-rank: there are no adapters (set a rank, or drop it)")
        return
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if not (0 < args.lora_alpha < float("inf")):
        raise ValueError(f"--lora-alpha {args.lora_alpha}: must be a positive number")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout {args.lora_dropout}: must be in [0, 1)")
    targets = parse_targets(args.lora_targets)
    # a freeze covers the adapters of its part too (model_provider.py): none left would train nothing
    part = {True: "--freeze-vision", False: "--freeze-language"}
    if frozen and all(part[t.startswith("vision.")] in frozen for t in targets):
        raise ValueError(
            f"--lora-targets {','.join(targets)} with {frozen[0]}: every adapter is in the frozen part, "
            "nothing would train (name targets outside it, or drop the freeze)"
        )
    routed = {"linear_fc1", "linear_fc2"} & set(targets)
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if routed and te and getattr(args, "num_experts", None) and getattr(args, "moe_grouped_gemm", False):
        raise ValueError(
            f"--lora-targets {','.join(sorted(routed))} with --moe-grouped-gemm on --transformer-impl "
            "transformer_engine: TE's grouped experts take no adapters (the local backend's do; or "
            "GROUPED_EXPERTS=0 in the run script, or name no linear_fc1/linear_fc2)"
        )


def narrow_sides(shape) -> dict[str, int]:
    """Each target's min(d_in, d_out) in the model ``shape`` (Qwen3.5's linears): the highest rank
    an update ``B @ A`` of that linear can have."""
    t, v = shape.text, shape.vision
    experts = (t.moe_ffn_hidden_size, t.shared_expert_ffn_hidden_size)  # routed and shared: the narrower
    ffn = min(w for w in experts if w) if t.is_moe else t.ffn_hidden_size
    merged = v.hidden_size * v.spatial_merge_size**2  # the merger's input: a 2x2 patch group
    return {
        "linear_qkv": t.hidden_size,
        "linear_proj": min(t.hidden_size, t.num_attention_heads * t.head_dim),
        "in_proj": t.hidden_size,
        "out_proj": min(t.hidden_size, t.linear_num_value_heads * t.linear_value_head_dim),
        "linear_fc1": min(t.hidden_size, 2 * ffn),  # gated: the gate and up halves
        "linear_fc2": min(t.hidden_size, ffn),
        "vision.linear_qkv": v.hidden_size,
        "vision.linear_proj": v.hidden_size,
        "vision.linear_fc1": min(v.hidden_size, v.intermediate_size),
        "vision.linear_fc2": min(v.hidden_size, v.intermediate_size),
        "vision.merger.linear_fc1": merged,
        "vision.merger.linear_fc2": min(merged, v.out_hidden_size),
    }


def rank_warning(args, shape) -> str | None:
    """A line for a rank past the narrower side of a target's linear: a user may mean it, but past it
    an adapter learns nothing a lower rank could not, with rank * (d_in + d_out) values a linear."""
    if not args.lora_rank:
        return None
    sides = narrow_sides(shape)
    past = [f"{t} ({sides[t]})" for t in parse_targets(args.lora_targets) if args.lora_rank > sides[t]]
    if not past:
        return None
    return (
        f"warning: --lora-rank {args.lora_rank} is past the narrower side of {', '.join(past)}: there an adapter "
        "holds more values than it can use (B @ A has rank at most min(d_in, d_out))"
    )

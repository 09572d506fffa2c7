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
    defaulted to the rank)."""
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank {args.lora_rank}: must be 0 (off) or a positive rank")
    if not args.lora_rank:
        return
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if not (0 < args.lora_alpha < float("inf")):
        raise ValueError(f"--lora-alpha {args.lora_alpha}: must be a positive number")
    if not 0 <= args.lora_dropout < 1:
        raise ValueError(f"--lora-dropout {args.lora_dropout}: must be in [0, 1)")
    targets = parse_targets(args.lora_targets)
    routed = {"linear_fc1", "linear_fc2"} & set(targets)
    if routed and getattr(args, "num_experts", None) and getattr(args, "moe_grouped_gemm", False):
        raise ValueError(
            f"--lora-targets {','.join(sorted(routed))} with --moe-grouped-gemm: adapters on the routed experts sit on "
            "SequentialMLP's per-expert linears (GROUPED_EXPERTS=0 in the run script), or name no linear_fc1/linear_fc2"
        )

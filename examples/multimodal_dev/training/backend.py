"""Which module backend a run trains with, and what megatron.training needs on every host.

    --transformer-impl transformer_engine   Transformer Engine linears, norms and attention (GPU)
    --transformer-impl local                megatron-core's torch linears, the project's norms and
                                            SDPA attention (any host; GPUs without TE)

Without the flag a run takes Transformer Engine where CUDA is present and TE imports, else local.
On the local backend, megatron's ``--attention-backend`` picks the kernel of packed attention
(``models/common/varlen_attention.py``): auto [default] or flash for torch's varlen flash kernel,
fused / unfused for SDPA per packed sample.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not match this torch / CUDA
        return False
    return True


def default_transformer_impl() -> str:
    return "transformer_engine" if torch.cuda.is_available() and te_importable() else "local"


def engine_defaults() -> dict:
    """``args_defaults`` of megatron's argument parsing: values used when the flag is not given.
    The playground hands megatron.training ready-made iterators of collated micro-batches."""
    return {"dataloader_type": "external", "transformer_impl": default_transformer_impl()}


def backend_of(args) -> str:
    """The spec backend ("te" or "local") of ``--transformer-impl``."""
    return "te" if args.transformer_impl == "transformer_engine" else "local"


def check_attention_backend(args) -> None:
    """Before megatron's argument checks, which assert (with a traceback) on this one."""
    from megatron.core.transformer.enums import AttnBackend

    if args.attention_backend == AttnBackend.local:
        raise ValueError(
            "--attention-backend local is megatron's own --spec local; this model takes auto, flash "
            "(torch varlen attention) or fused / unfused (SDPA per packed sample)"
        )


def prebuilt_helpers(compile_helpers, run=None):
    """megatron.training's start-up compiles megatron-core's dataset index helpers with ``make``
    in the installed package, which the wheel ships without a Makefile (``sys.exit(1)``) but with
    ``helpers_cpp`` already built: nothing to compile (megatron_changes row, applied when the
    built helpers import)."""

    def compile_nothing():
        return None

    return compile_nothing

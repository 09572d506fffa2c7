"""LoRA fine-tuning: adapters on megatron-core's tensor-parallel linears (``adapter.py``), which
linears get one (``targets.py``), and putting them on a built model (``apply.py``).

This module imports nothing heavy: the flags read ``DEFAULT_TARGETS`` before torch is imported.
"""

from .targets import DEFAULT_TARGETS, TARGETS, parse_targets

__all__ = ["DEFAULT_TARGETS", "TARGETS", "parse_targets"]

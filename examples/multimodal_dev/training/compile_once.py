"""megatron-core's compiled helpers, compiled once a run whatever length each packed row has.

megatron-core wraps its small fused element-wise functions in ``torch.compile`` (``jit_fuser``:
Gated DeltaNet's gated norm, input preparation and decay, the attention output gate, SwiGLU,
bias-dropout-add). Dynamo compiles each for the shapes of its first call and, when a later call's
shapes differ, compiles it again for dynamic shapes; a packed row changes length with every
micro-batch, so every helper compiled twice, the second time in the second iteration. On an H200
(2b78d8b) the first two iterations took 40 s and 21 s. Counted on a CPU host with the tiny MoE
model: 8 graphs in the first step, 8 more in the second; compiled for dynamic shapes from the first
call, 9 in the first step and none after (tests/unit/test_compile_once.py).

Inductor keeps what it compiled in ``TORCHINDUCTOR_CACHE_DIR`` (``/tmp/torchinductor_<user>`` by
default): pointed at storage that outlives the node, later runs load instead of compiling.

A row of ``megatron_changes`` (group ``compile-for-any-length``), applied by this call: a setting read
before megatron is imported, earlier than the table's applier runs.
"""

from __future__ import annotations

import torch


def compile_for_any_length() -> None:
    """Dynamo treats sizes as dynamic from the first call (process-wide: only megatron-core's
    helpers are compiled in a training run)."""
    torch._dynamo.config.assume_static_by_default = False


class CompileWatch:
    """torch.compile's graphs and compile seconds in this process so far, told when they grow: the
    warm-up's share of the first iterations, and any recompile later in a run (a new shape, an
    evaluation), show in the log."""

    def __init__(self):
        self.graphs = 0

    def news(self) -> str | None:
        from torch._dynamo.utils import compilation_time_metrics, counters

        graphs = counters["stats"]["unique_graphs"]
        if graphs == self.graphs:
            return None
        new, self.graphs = graphs - self.graphs, graphs
        line = f" torch.compile: {graphs} graphs compiled ({new} since the last line)"
        seconds = compilation_time_metrics.get("_compile.compile_inner")  # Dynamo's own timer of each compile
        return line + (f" in {sum(seconds):.1f} s" if seconds else "") + " |"

"""FLA's GatedDeltaNet kernels in a process of their own, started by the tests of this folder with
``TRITON_INTERPRET=1``, ``MEGATRON_CPU_FLA=1`` and ``.fla/lib`` first on ``PYTHONPATH``:

    python fla_worker.py kernels|layer INPUTS.pt RESULTS.pt

- ``kernels``: ``gdn_calls.run_kernels`` on the functions megatron-core bound at import (FLA's).
- ``layer``: megatron-core initialised for one process (``activate()`` keeps FLA's kernels under
  ``MEGATRON_CPU_FLA=1``), the tiny GatedDeltaNet given the test's parameters, ``gdn_calls.run_layer``.

Exit status ``SKIP`` with one line on stdout: what this host lacks (the test skips with that line).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
import triton_interpreter
from gdn_calls import run_kernels, run_layer

SKIP = 77


def _skip(line: str) -> None:
    print(line, flush=True)
    sys.exit(SKIP)


def _megatron_kernels() -> SimpleNamespace:
    """The three functions megatron-core's GatedDeltaNet calls, as it bound them."""
    try:
        from megatron.core.ssm.gated_delta_net import common, gdn
    except Exception as err:  # noqa: BLE001 - FLA failing at import under this Triton is a reason to skip
        _skip(f"megatron-core's gated_delta_net does not import with FLA: {type(err).__name__}: {err}")
    if not common.HAVE_FLA:
        _skip("megatron-core did not import FLA (fla.modules / fla.ops) from .fla/lib")
    return SimpleNamespace(
        causal_conv1d=gdn.causal_conv1d, l2norm=common.l2norm, chunk_gated_delta_rule=gdn.chunk_gated_delta_rule
    )


def main(mode: str, inputs_path: str, results_path: str) -> None:
    reason = triton_interpreter.unsupported_reason()
    if reason:
        _skip(reason)
    triton_interpreter.install()
    # megatron-core wraps GatedDeltaNet's input preparation (which calls l2norm) in torch.compile:
    # dynamo would trace into FLA's interpreted Triton calls; eager gives the same numbers sooner.
    torch._dynamo.config.disable = True
    kernels = _megatron_kernels()
    inputs = torch.load(inputs_path)
    if mode == "kernels":
        results = run_kernels(kernels, inputs)
    elif mode == "layer":
        from gdn_layer import tiny_gdn_layer

        from megatron.cpu.single_process import init_single_process

        init_single_process()
        from megatron.core.ssm.gated_delta_net import gdn

        kernel = gdn.chunk_gated_delta_rule
        if not kernel.__module__.startswith("fla."):
            raise SystemExit(
                f"activate() bound {kernel.__module__}.{kernel.__name__} under MEGATRON_CPU_FLA=1, "
                "not FLA's chunk_gated_delta_rule"
            )
        results = run_layer(tiny_gdn_layer(), inputs)
    else:
        raise SystemExit(f"unknown mode {mode!r} (kernels, layer)")
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])

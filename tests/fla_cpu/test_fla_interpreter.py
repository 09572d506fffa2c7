"""flash-linear-attention's (FLA) GatedDeltaNet kernels on a CPU host, run by Triton's interpreter in a
worker process (``fla_worker.py``), against the project's torch kernels (``megatron/cpu/gdn_kernels.py``),
forward and backward, called as megatron-core 0.19.2 calls them (``gdn_calls.py``).

- Kernels: one packed row of 1, 63, 65 and 130 tokens (int32 ``cu_seqlens``), GQA (2 key heads
  repeated to 4 value heads of 16: the q/k gradients flow back through the repeat), the decay
  g = -exp(A_log) softplus(alpha + dt_bias) with ``A_log`` = log U(1, 16) and ``dt_bias`` = 1 as megatron
  initialises them, alpha ~ N(0, 1): g from -0.95 to -41 a token.
- Layer: megatron-core's ``GatedDeltaNet`` of the tiny variant (4 key / 8 value heads of 16) on one packed
  row of the same lengths, parameters as megatron initialises them (g from about -1.3 to -27 a token,
  alpha coming out of ``in_proj`` with std ~0.23); the worker's ``activate()`` keeps
  FLA's kernels (``MEGATRON_CPU_FLA=1``). Output and the gradients of the input and of every parameter.

Error: max |x - ref| / max |ref| per tensor, against the torch kernels (fp32) and against a float64
run of them (float64 throughout, but for the out norm and megatron's output gate, fp32 by design:
they move the reference by 1.5e-7 at most, measured). Tolerances:

- ``REL`` 1e-5 (the project's fp32 parity bar) for outputs and gradients; measured <= 2.8e-6.
- The gate's gradients, which FLA forms as a reverse cumulative sum within each 64-token chunk of its
  gradient with respect to the cumulative log-decay, in fp32 (``chunk_local_cumsum(reverse=True)``):
  under this decay the terms are large and of both signs. ``dalpha`` (per token): ``GATE_TOKEN_REL``
  2e-4; from float64, FLA 3.8e-5, torch kernels 8.9e-6. ``dA_log`` / ``ddt_bias`` (sums over every
  token, small beside their terms): ``GATE_PARAM_REL`` 2e-3; from float64, FLA 4.1e-4 / 2.5e-4 (kernels)
  and 3.1e-4 / 3.3e-4 (layer), torch kernels 1.3e-4 / 8.4e-5 and 5.4e-5 / 5.5e-5. FLA's figure is its
  own rounding, not a fault of these calls: running the layer's element-wise parts eagerly instead of
  compiled (1e-7 apart) moves FLA's ``dA_log`` by 2.8e-4.

Time on 2 cores: the kernels' worker ~18 s (FLA's chunk_gated_delta_rule forward + backward 6 s, the
conv 3 s), the layer's ~30 s (19 s forward + backward; the torch kernels 1.4 s).
"""

from types import SimpleNamespace

import gdn_calls
import pytest
import torch

from megatron.cpu import gdn_kernels

pytestmark = pytest.mark.fla

REL, GATE_TOKEN_REL, GATE_PARAM_REL = 1e-5, 2e-4, 2e-3
TOLERANCE = {"dalpha_1TH": GATE_TOKEN_REL, "dA_log": GATE_PARAM_REL, "ddt_bias": GATE_PARAM_REL}
TORCH_KERNELS = SimpleNamespace(
    causal_conv1d=gdn_kernels.causal_conv1d,
    l2norm=gdn_kernels.l2norm,
    chunk_gated_delta_rule=gdn_kernels.chunk_gated_delta_rule,
)


def _float64(inputs: dict) -> dict:
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _check(case: str, fla: dict, ours: dict, ref: dict) -> None:
    """Every tensor of ``fla``: FLA vs the torch kernels within its tolerance, both vs float64 too."""
    failures = []
    for name, value in fla.items():
        tol = TOLERANCE.get(name, REL)
        errors = {
            "vs torch": _rel(value, ours[name]),
            "fla vs f64": _rel(value, ref[name]),
            "torch vs f64": _rel(ours[name], ref[name]),
        }
        print(f"{case} {name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()) + f" (tol {tol:g})")
        failures += [f"{name} {k} {v:.2e} > {tol:g}" for k, v in errors.items() if not v <= tol]
    assert not failures, f"{case}: " + "; ".join(failures)


@pytest.fixture(scope="module")
def kernel_results(fla_worker):
    inputs = gdn_calls.kernel_inputs()
    fla = fla_worker("kernels", inputs)
    ours, ref = gdn_calls.run_kernels(TORCH_KERNELS, inputs), gdn_calls.run_kernels(TORCH_KERNELS, _float64(inputs))
    print("FLA under the interpreter, s (fwd+bwd):", {k: round(v, 2) for k, v in fla["seconds"].items()})
    return fla, ours, ref


@pytest.mark.parametrize("kernel", ["causal_conv1d", "l2norm", "chunk_gated_delta_rule"])
def test_kernel_matches_torch_kernel(kernel_results, kernel):
    fla, ours, ref = kernel_results
    _check(kernel, fla[kernel], ours[kernel], ref[kernel])


def test_gated_delta_net_layer_matches_torch_kernels(fla_worker, mcore):
    from gdn_layer import tiny_gdn_layer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # the same parameters whatever ran before
    torch.manual_seed(1234)
    layer = tiny_gdn_layer()
    inputs = gdn_calls.layer_inputs(layer)
    fla = fla_worker("layer", inputs)
    ours = gdn_calls.run_layer(layer, inputs)
    ref = gdn_calls.run_layer(tiny_gdn_layer(params_dtype=torch.float64), inputs)
    print(
        f"GatedDeltaNet forward + backward: FLA under the interpreter {fla['seconds']:.1f} s, "
        f"torch kernels {ours['seconds']:.2f} s"
    )
    _check("GatedDeltaNet", *({k: v for k, v in r.items() if k != "seconds"} for r in (fla, ours, ref)))

"""Training through ``run_qwen35_vl.sh`` (tiny, mock data, one sample a step, 3 iterations, fp32) on
FLA's GatedDeltaNet kernels under Triton's interpreter against the same run on the torch kernels: the
loss and grad norm of every iteration, from the runs' metrics files.

Tolerances: iteration 1, 1e-5 relative (the project's first-step bar: the same weights, so only the
kernels' rounding differs); later iterations 1e-4 (AdamW's first update is ~lr * sign(g), so a
gradient's rounding can flip a few of its steps). Measured: loss 0, 0, 5.3e-7; grad norm 0, 2.0e-6,
6.5e-6. Time on 2 cores: FLA's run ~85 s (158, 118 and 58 tokens; 12-34 s an iteration), the torch
kernels' ~13 s.
"""

import pytest
from launch import NO_EVAL, run_script

pytestmark = pytest.mark.fla

RUN = dict(TRAIN_ITERS=3, MBS=1, GBS=1, SEQ_LEN=256)
FIRST_REL, LATER_REL = 1e-5, 1e-4


def test_training_on_fla_matches_torch_kernels(fla_env):
    fla = run_script(NO_EVAL, timeout=900, **RUN, **fla_env).check()
    ours = run_script(NO_EVAL, **RUN).check()
    assert "Gated DeltaNet runs on flash-linear-attention's kernels under Triton's interpreter" in fla.output
    assert "Gated DeltaNet runs on the torch kernels of megatron.cpu" in ours.output
    assert sorted(fla.losses) == sorted(ours.losses) == [1, 2, 3] and fla.tokens == ours.tokens
    failures = []
    for i in sorted(ours.losses):
        tol = FIRST_REL if i == 1 else LATER_REL
        pairs = (("loss", fla.losses[i], ours.losses[i]), ("grad norm", fla.grad_norms[i], ours.grad_norms[i]))
        for name, a, b in pairs:
            rel = abs(a - b) / abs(b)
            print(f"iteration {i} {name}: FLA {a:.9g}, torch kernels {b:.9g}, rel {rel:.1e} (tol {tol:g})")
            if not rel <= tol:
                failures.append(f"iteration {i} {name} rel {rel:.1e} > {tol:g}")
    assert not failures, "; ".join(failures)

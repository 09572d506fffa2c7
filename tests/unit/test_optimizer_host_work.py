"""The optimizer step's foreach and fused replacements (training/optimizer_host_work.py) compute what megatron's
per-parameter fallbacks compute: the grad norm, the scaled / copied tensor lists, and torch AdamW's
updates; and the fused path stays chosen after a checkpoint's parameter groups are loaded."""

import pytest
import torch
from megatron.core import utils as mcore_utils

from examples.multimodal_dev.training import optimizer_host_work as host_work


def _tensors(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in ((7, 3), (5,), (2, 4, 6), (1,))]


def test_grad_norm_equals_megatrons_fallback(mcore):
    tensors = _tensors()
    theirs, _ = mcore_utils.local_multi_tensor_l2_norm(0, None, [tensors], False)
    ours, none = host_work.foreach_l2_norm(None)(0, None, [tensors], False)
    assert none is None and ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, rtol=1e-6), (ours, theirs)
    empty, _ = host_work.foreach_l2_norm(None)(0, None, [[]], False)
    assert float(empty) == 0.0


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_equals_megatrons_fallback(scale, in_place):
    """destination = source * scale: in place (clipping), or into bf16 copies (main-to-model params)."""
    sources = _tensors(1)

    def scaled(impl):
        destinations = [s.clone() for s in sources] if in_place else _tensors(2, torch.bfloat16)
        impl(0, None, [destinations if in_place else sources, destinations], scale)
        return destinations

    theirs, ours = scaled(mcore_utils.local_multi_tensor_scale), scaled(host_work.foreach_scale(None))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _adam(fused_hook: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(t) for t in _tensors(3)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if fused_hook:
        host_work.fused_adam(lambda: opt)()
    return params, opt


def test_adam_runs_fused_with_the_same_updates():
    (p_loop, loop), (p_fused, fused) = _adam(False), _adam(True)
    assert fused.param_groups[0]["fused"] is None  # set before each step, not at build
    for step in range(3):
        for ps in (p_loop, p_fused):
            for i, p in enumerate(ps):
                p.grad = torch.full_like(p, 0.1 * (i + 1) * (step + 1))
        loop.step()
        fused.step()
        assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is False
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(p_loop, p_fused))
    # a checkpoint's groups (saved by a loop run) put fused back to None; the next step asks again
    fused.load_state_dict(loop.state_dict())
    assert fused.param_groups[0]["fused"] is None
    fused.step()
    assert fused.param_groups[0]["fused"] is True


def test_a_loaded_step_count_moves_to_its_parameters_device():
    """A checkpoint load leaves Adam's step counts on the host, where the fused kernel on a GPU needs
    them beside the parameters: the hook moves them (a meta-device parameter stands in for a GPU's)."""
    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    opt = torch.optim.AdamW([param])
    opt.state[param]["step"] = torch.tensor(7.0)
    host_work._fused_before_step(opt, (), {})
    step = opt.state[param]["step"]
    assert step.device == param.device and step.dtype == torch.float32

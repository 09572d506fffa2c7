"""Cached decoding through one Gated DeltaNet layer (``models/common/gdn_decoding.py``): a prompt of T
tokens, then k tokens one at a time, equals one forward over the T + k tokens; a left-padded row
equals the same row unpadded. fp32, 1e-5 abs."""

import pytest
import torch
from gdn_layer import tiny_gdn_layer

from examples.multimodal_dev.generation.context import DecodingContext
from examples.multimodal_dev.models.common.gated_delta_net_fp32_decay import GatedDeltaNetFp32Decay

TOL = 1e-5


@pytest.fixture(scope="module")
def layer(mcore):
    torch.manual_seed(0)
    layer = tiny_gdn_layer(GatedDeltaNetFp32Decay).eval()
    with torch.no_grad():  # a conv bias and decay values other than the initial ones
        layer.A_log.uniform_(-1.0, 1.5)
        layer.dt_bias.normal_()
    return layer


def _decode(layer, x_SBH, prompt: int, real=None):
    """Outputs [S, B, H] of the prompt's forward, then of each later token alone."""
    context = DecodingContext(
        torch.ones(x_SBH.shape[1], prompt, dtype=torch.bool) if real is None else real, x_SBH.shape[0] - prompt
    )
    outs = [layer(x_SBH[:prompt], None, inference_context=context)[0]]
    for t in range(prompt, x_SBH.shape[0]):
        context.sequence_len_offset = t
        outs.append(layer(x_SBH[t : t + 1], None, inference_context=context)[0])
    return torch.cat(outs), context


@pytest.mark.parametrize("prompt, new", [(1, 5), (13, 7), (70, 3)])  # 70: the prefill spans two chunks
def test_prefill_then_steps_equal_one_forward(layer, prompt, new):
    x = torch.randn(prompt + new, 2, layer.config.hidden_size)
    with torch.no_grad():
        full, _ = layer(x, None)
        stepped, context = _decode(layer, x, prompt)
    diff = (stepped - full).abs().max().item()
    print(f"prompt {prompt} + {new} steps: max abs diff {diff:.2e}")
    assert diff < TOL
    state = context.gdn_states[layer.layer_number]
    assert state.conv.shape[-1] == layer.conv1d.weight.shape[-1] - 1 and state.recurrent.dtype == torch.float32


def test_left_padding_leaves_the_state_as_the_unpadded_rows(layer):
    """Row 0 is 4 tokens shorter than row 1 and padded on the left with values that would change
    every later output if they reached the conv or the state."""
    prompt, new, pad = 9, 4, 4
    x = torch.randn(prompt + new, 2, layer.config.hidden_size)
    x[:pad, 0] = 100.0
    real = torch.ones(2, prompt, dtype=torch.bool)
    real[0, :pad] = False
    with torch.no_grad():
        batched, _ = _decode(layer, x, prompt, real)
        alone, _ = _decode(layer, x[pad:, :1], prompt - pad)
    diff = (batched[pad:, :1] - alone).abs().max().item()
    print(f"left-padded row vs alone: max abs diff {diff:.2e}")
    assert diff < TOL
    with torch.no_grad():  # the same padding, unmasked, reaches them: the comparison can fail
        unmasked, _ = _decode(layer, x, prompt)
    assert (unmasked[pad:, :1] - alone).abs().max() > 1e-2

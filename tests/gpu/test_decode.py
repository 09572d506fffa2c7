"""Check: generation on the GPU (``generation/decode.py``, as ``tools/generate.py`` and ``tools/serve.py``
run it there).

- Greedy tokens of the tiny MoE model in fp32 against transformers' ``generate`` on the same weights on
  the same GPU (a text prompt, and one with an image): equal tokens is the bar, as on the host.
- Speed: new tokens per second at batch 1 and 8 (64-token text prompts, 64 new tokens, no end token)
  for 35b_a3b's layer widths in 4 layers with 8 experts (``gpu_models.shapes()["wide-moe"]``) in bf16:
  the figures the server's speed rests on. Recorded, with no bar.
A rehearsal on a CPU (gpu_results.rehearsal) checks the tokens and times nothing.
"""

import time

import gpu_results
import pytest
import torch

if not torch.cuda.is_available() and not gpu_results.rehearsal():
    pytest.skip("no CUDA device: GPU checks run on a GPU host (bash tests/gpu/run.sh)", allow_module_level=True)

import gpu_models as gm
from hf_generate import greedy_of

pytestmark = pytest.mark.gpu
NEW = 16


def _image_prompt(shape):
    from hf_reference import image_tokens, pixel_values_for

    from examples.multimodal_dev.generation.decode import Prompt

    grid = [(1, 4, 6)]
    ids = [5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9]
    return Prompt(ids, pixel_values_for(shape, grid, torch.Generator().manual_seed(3)), torch.tensor(grid))


def test_greedy_tokens_equal_transformers_generate(megatron_gpu, record):
    from examples.multimodal_dev.generation.decode import Prompt, generate

    dtype, shape, hf = gm.case("tiny-moe", "fp32")
    ours = gm.megatron_model(shape, dtype, "local", hf.state_dict())
    for name, prompt in (("text", Prompt([3, 4, 5, 6, 7, 8])), ("image", _image_prompt(shape))):
        expected = greedy_of(hf, prompt.input_ids, NEW, prompt.pixel_values, prompt.image_grid_thw)
        got = generate(ours, [prompt], NEW).tokens[0]
        same = got == expected
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        metrics = {"new tokens": NEW, "equal": same, "first difference": first}
        record(f"tiny-moe fp32 {name}", "pass" if same else "fail", metrics, gm.gdn_kernel_source())
        assert same, (got, expected)


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_tokens_per_second_bf16(batch, megatron_gpu, record):
    from examples.multimodal_dev.generation.decode import Prompt, generate

    if gpu_results.deadline_left() < 40:
        pytest.skip("out of tests/gpu/run.sh's time budget")
    if gpu_results.rehearsal():
        pytest.skip("a rehearsal on a CPU times nothing")
    shape = gm.shapes()["wide-moe"]
    model = gm.megatron_model(shape, torch.bfloat16, "local", gm.hf_reference(shape).to(torch.bfloat16).state_dict())
    ids = torch.randint(0, shape.text.vocab_size - 8, (batch, 64), generator=torch.Generator().manual_seed(1))
    prompts = [Prompt(row.tolist()) for row in ids]
    generate(model, prompts, 4)  # warm-up: kernels compiled and tuned for these shapes
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = generate(model, prompts, 64)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = sum(map(len, done.tokens))
    metrics = {"batch": batch, "new tokens": new, "seconds": seconds, "tokens/s": new / seconds}
    record(f"wide-moe bf16 batch {batch}", "info", metrics, f"prompt 64 tokens, 64 new; {gm.gdn_kernel_source()}")

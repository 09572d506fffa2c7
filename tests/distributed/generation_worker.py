"""torchrun worker: greedy generation (``generation/decode.py``) from the tiny MoE+MTP checkpoint at a
layout, every data-parallel replica answering prompts of its own.

    --module generation_worker CHECKPOINT_DIR TP EP SP END_ID   (as test_parallelism.py runs it)

Prompts: (0) text around two images, (1) text, (2) text and one image, (3) text. Replica r of R
answers prompts r, r + R, ... in one batch (left-padded), 10 new tokens at most; END_ID (-1: none)
ends a row. Rank 0 prints every replica's ``RESULT {"tokens": {prompt: tokens}}`` (tensor-parallel
ranks of a replica hold the same tokens).
"""

import json
import sys

import torch

NEW_TOKENS = 10


def prompts(shape):
    from hf_reference import image_tokens, pixel_values_for

    from examples.multimodal_dev.generation.decode import Prompt

    pixels = torch.Generator().manual_seed(3)
    two = [(1, 4, 6), (1, 2, 8)]
    return [
        Prompt(
            [5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9] + image_tokens(shape, 2, 8) + [10, 11],
            pixel_values_for(shape, two, pixels),
            torch.tensor(two),
        ),
        Prompt([3, 4, 5, 6]),
        Prompt(
            [9] + image_tokens(shape, 2, 4) + [10, 12],
            pixel_values_for(shape, [(1, 2, 4)], pixels),
            torch.tensor([(1, 2, 4)]),
        ),
        Prompt([40, 41, 42, 43, 44, 45, 46]),
    ]


def main():
    checkpoint, tp, ep, sp, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.cpu

    megatron.cpu.activate()
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    from examples.multimodal_dev.checkpoint.files import load_model_weights
    from examples.multimodal_dev.generation.decode import generate
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    shape = get_variant("tiny", moe=True, mtp=True)
    model = build_model(
        shape,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
        use_cpu_initialization=True,
    )
    load_model_weights(model, checkpoint)
    model.eval()
    replica, replicas = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    everything = prompts(shape)
    mine = list(range(replica, len(everything), replicas))
    done = generate(model, [everything[i] for i in mine], NEW_TOKENS, end_ids=[] if end < 0 else [end])
    everyone = [None] * torch.distributed.get_world_size()  # one line from rank 0: ranks' prints interleave
    torch.distributed.all_gather_object(everyone, dict(zip(mine, done.tokens)))
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps({"tokens": {k: v for part in everyone for k, v in part.items()}}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

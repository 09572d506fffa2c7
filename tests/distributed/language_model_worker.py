"""torchrun worker: the language model alone on a text-only packed batch, at any TP (+SP).

    torchrun --nproc-per-node N language_model_worker.py CHECKPOINT_DIR TP SP
    (or ``--module language_model_worker`` with this folder on PYTHONPATH, as test_parallelism.py runs it)

Loads the tiny MoE+MTP checkpoint into the model at this layout, then on three text-only mock
samples (THD) runs
  - ``model.language_model`` standalone (GPTModel embeds, and under SP must scatter, by itself);
  - the full VLM forward (no vision inputs) with backward, DDP grad reduction and the grad norm.
The last rank prints one ``RESULT {json}`` line.
"""

import json
import sys

import torch


def text_only_batch(shape, pad_multiple: int):  # a PackedBatch
    from examples.multimodal_dev.data.collate import pack_thd
    from examples.multimodal_dev.data.mock import MockConversations
    from examples.multimodal_dev.data.sample import VisionTokens

    tokens = VisionTokens.from_shape(shape)
    mock = MockConversations(tokens, shape.text.vocab_size, shape.vision.patch_dim, seed=7, max_images=0)
    return pack_thd([mock(i) for i in range(3)], tokens, pad_multiple)


def grad_norm(params) -> float:
    """megatron-core's grad norm (what megatron.training logs): the grads each rank owns, TP
    duplicates counted on one rank, reduced over the TP group (no DP here)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    return get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_tensor_model_parallel_group())


def main():
    checkpoint, tp, sp = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.cpu

    megatron.cpu.activate()
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    from examples.multimodal_dev.checkpoint.files import load_model_weights
    from examples.multimodal_dev.data.collate import pad_multiple_for
    from examples.multimodal_dev.forward_step import loss_func, packed_seq_params, run_model
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
    from examples.multimodal_dev.models.qwen35_vl.factory import build_model

    shape = get_variant("tiny", moe=True, mtp=True)
    module = build_model(
        shape,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
    )
    load_model_weights(module, checkpoint)
    model = DistributedDataParallel(
        config=module.config,
        module=module,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
    )
    batch = text_only_batch(shape, pad_multiple_for(1, tp, sp))

    with torch.no_grad():
        lm_losses = module.language_model(
            input_ids=batch.tokens,
            position_ids=batch.position_ids,
            attention_mask=None,
            labels=batch.labels,
            loss_mask=batch.loss_mask,
            packed_seq_params=packed_seq_params(batch),
        )
    mask = batch.loss_mask
    lm_loss = float((lm_losses * mask).sum() / mask.sum())

    model.zero_grad_buffer()
    output, loss_mask = run_model(model, batch)
    loss_sum, n_tokens, _ = loss_func(loss_mask, output)
    loss_sum.backward()
    finalize_model_grads([model], num_tokens=n_tokens.clone())
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = p.main_grad  # DDP accumulates into main_grad
    norm = grad_norm(params)
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        print(
            "RESULT "
            + json.dumps(
                {
                    "row_tokens": batch.tokens.shape[1],
                    "lm_loss_shape": list(lm_losses.shape),
                    "lm_loss": lm_loss,
                    "vlm_loss": float(loss_sum / n_tokens),
                    "grad_norm": norm,
                }
            ),
            flush=True,
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a vision-language model of MODEL_REGISTRY with Megatron-Core.

    PYTHONPATH=<repository root> torchrun --nproc-per-node N -m examples.multimodal_dev.pretrain_multimodal \
        <megatron flags> --model-arch qwen35_vl --model-variant tiny --dataset-provider mock ...

Every host runs ``megatron.training.pretrain``; on a host without CUDA, ``megatron.cpu`` first
makes megatron's CUDA assumptions hold there (gloo, CPU tensors, torch GatedDeltaNet kernels).
``run_qwen35_vl.sh`` at the repository root builds the full command line.

What ``pretrain`` is handed lives beside this file: the checked arguments (``checked_args.py``),
the model of a pipeline stage (``model_provider.py``), each rank's iterators
(``dataset_provider.py``) and the step (``forward_step.py``). Every change this project makes to
megatron's behaviour is installed here from one table (``megatron_changes/table.py``).
"""

from __future__ import annotations

import gc
from typing import Any

if __name__ == "__main__":  # a run: the imports make ~0.8M objects and little garbage; collecting as they go costs ~1 s
    gc.disable()  # main() turns collection back on, without those objects (gc.freeze)

from examples.multimodal_dev import megatron_changes
from examples.multimodal_dev.checked_args import checked_args, exit_in_one_line
from examples.multimodal_dev.checkpoint import save_guard, write_queue
from examples.multimodal_dev.console import fail, say
from examples.multimodal_dev.data.sample import DataError
from examples.multimodal_dev.dataset_provider import datasets_provider, metered, plain_for_megatron
from examples.multimodal_dev.forward_step import forward_step
from examples.multimodal_dev.lifetime import rank_dies_with_launcher
from examples.multimodal_dev.model_provider import model_provider
from examples.multimodal_dev.training.compile_once import compile_for_any_length
from examples.multimodal_dev.training.gdn_kernel_choice import choose_gdn_kernels
from examples.multimodal_dev.training.throughput import StepFlops
from examples.multimodal_dev.vision_ranks import groups as vision_ranks


def main() -> None:
    import megatron.cpu

    rank_dies_with_launcher()  # a torchrun killed outright takes this rank with it, not left in a collective
    try:
        on_cpu = megatron.cpu.activate()
    except RuntimeError as err:  # MEGATRON_CPU_FLA=1 where FLA's kernels cannot run
        fail(str(err))
    if on_cpu:
        megatron.cpu.tune_host()
        say(megatron.cpu.gdn_kernels_line())
    compile_for_any_length()  # megatron-core's compiled helpers: compiled once, not again in iteration 2
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    gc.freeze()  # what the imports made lives for the whole run: no collection need walk it again
    gc.enable()
    megatron_changes.apply("checkpoints-are-data")  # before the arguments: --load's stored args are read
    args = checked_args()
    if not on_cpu:
        choose_gdn_kernels(args)  # FLA's where right on this GPU (the model's head dims decide on Hopper)
    for line in save_guard.clear_incomplete_saves(args.save):
        say(line, every_rank=True)
    meter = StepFlops.of_run = StepFlops()
    try:
        lines = megatron_changes.install(args, meter)  # every change to megatron: megatron_changes/table.py
    except megatron_changes.MegatronChangeError as err:
        fail(str(err))
    for line in lines:
        say(line)
    if args.save:
        write_queue.install()  # the writer's queue from a fork now, not a spawned interpreter at the first save
    grids: dict[str, Any] = {}
    if args.vision_nproc:  # both modules' process grids, made before megatron starts (vision_ranks/groups.py)
        layout = vision_ranks.setup(args)
        grids = dict(
            pg_collection=layout.pg_collection, p2p_communicator=layout.communicator, skip_model_parallel_init=True
        )
    try:
        pretrain(
            pretrain_cfg_container_from_args(args),
            plain_for_megatron(metered(datasets_provider, meter)),
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
            **grids,
        )
    except DataError as err:  # the user's data, found unusable while the iterators are built or drawn
        fail(str(err))
    except BaseException as err:
        exit_in_one_line(err, args)


if __name__ == "__main__":
    try:
        main()
    finally:
        # Everything is written by now. The interpreter's last collection would walk every object torch,
        # megatron-core and sympy made (about 2 s a process, on every run); the OS frees them instead.
        gc.freeze()

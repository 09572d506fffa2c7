"""The model a generating command answers with (``tools/generate.py``, ``tools/serve.py``): a checkpoint of
any layout, loaded at the layout the command runs (TP x EP ranks, one process without them) and in the
dtype it decodes in, with the ranks' process groups started as training starts them.

- Ranks: one process, or ``torchrun`` ranks (``WORLD_SIZE``), tensor-parallel groups of
  ``--tensor-model-parallel-size`` inside expert-parallel groups of ``--expert-model-parallel-size``;
  the world is TP x EP ranks (every data-parallel replica holds experts of its own).
- Devices: a GPU a rank where CUDA is (NCCL), else the host (gloo, the device layer).
- Dtype: ``auto`` is fp32 on the host (as the checkpoint tools compute) and, on GPUs, the dtype the
  checkpoint stores its weights in (bf16 for a bf16 run); the model is built in it, as training builds
  it, and the weights are read into it resharded from the checkpoint's own layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    @property
    def ranks(self) -> int:
        return self.tp * self.ep

    def check(self) -> None:
        for flag, value in (("--tensor-model-parallel-size", self.tp), ("--expert-model-parallel-size", self.ep)):
            if value < 1:
                raise ValueError(f"{flag} {value}: must be at least 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size above 1")


def add_layout_flags(parser) -> None:
    group = parser.add_argument_group("layout (ranks are started through the launcher's torchrun)")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--expert-model-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true", help="as training: the weights are the same")
    group.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="auto", help="auto: fp32 on the host, the checkpoint's on GPUs"
    )


def layout_of(args) -> Layout:
    layout = Layout(args.tensor_model_parallel_size, args.expert_model_parallel_size, args.sequence_parallel)
    layout.check()
    return layout


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def on_ranks(prog: str, module: str, args, argv: list[str], check) -> int | None:
    """A generating command's start: ``check(args)`` (one line ``PROG: error: ...``, status 2, before
    any rank starts), then, where the layout has several ranks and this process is not one of them,
    this process becomes the launcher's torchrun running ``module`` on them (one line for a failed
    rank; on a host without CUDA the ranks fork from one import): the PID a user or a supervisor
    signals is the one that stops every rank (``launcher/torchrun.py``). None: this process runs it,
    and, as a rank, ends when its torchrun does."""
    import sys

    from ..lifetime import rank_dies_with_launcher

    try:
        check(args)
        layout = layout_of(args)
    except (OSError, ValueError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if under_torchrun():
        rank_dies_with_launcher()
        return None
    if layout.ranks == 1:
        return None
    torchrun = ["-m", "examples.multimodal_dev.launcher.torchrun", "--standalone"]
    sys.stdout.flush(), sys.stderr.flush()  # exec drops what is still buffered
    os.execv(sys.executable, [sys.executable, *torchrun, f"--nproc-per-node={layout.ranks}", "-m", module, *argv])


def start_ranks(layout: Layout) -> torch.device:
    """This process's device, with torch.distributed and megatron-core's parallel state started for
    ``layout`` (one process: a world of one)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.cpu

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != layout.ranks:
        raise ValueError(
            f"--tensor-model-parallel-size {layout.tp} x --expert-model-parallel-size {layout.ep} is "
            f"{layout.ranks} ranks, but {world} were started"
        )
    if world == 1:
        from megatron.cpu.single_process import init_single_process

        init_single_process()
    else:
        megatron.cpu.activate()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, expert_model_parallel_size=layout.ep
        )
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_for_generation(megatron_path: str, hf_config_path, lora_base, layout: Layout, dtype: str = "auto"):
    """(model in eval mode on this rank's device, its shape, the dtype it runs in)."""
    from ..checkpoint.hf_conversion import load_megatron_with_lora, stored_weight_dtype
    from ..models import model_of

    device = start_ranks(layout)
    if dtype != "auto":
        chosen = DTYPES[dtype]
    else:
        chosen = stored_weight_dtype(megatron_path) if device.type == "cuda" else torch.float32

    def build(shape):
        settings = dict(
            tensor_model_parallel_size=layout.tp,
            expert_model_parallel_size=layout.ep,
            sequence_parallel=layout.sequence_parallel,
        )
        return model_of(shape).build_fn(shape, params_dtype=chosen, use_cpu_initialization=True, **settings)

    model, shape, *_ = load_megatron_with_lora(megatron_path, hf_config_path, lora_base, build)
    return model.to(device).eval(), shape, chosen


def check_layout_fits(layout: Layout, megatron_path: str, hf_config_path, lora_base=None) -> None:
    """One line where the checkpoint's model cannot be split at ``layout`` (heads, key-value heads,
    Gated DeltaNet heads against TP; experts against EP), read from its recorded shape before any rank
    starts: each rank would otherwise find it after loading, and say it once a rank."""
    from ..checkpoint.hf_conversion import check_checkpoint_dir, checkpoint_shape
    from ..models import model_of

    check_checkpoint_dir(megatron_path)
    shape, _ = checkpoint_shape(megatron_path, hf_config_path, lora_base)
    problems = model_of(shape).parallel_problems(shape, layout.tp, 1, layout.ep)
    if problems:
        raise ValueError(f"{problems[0]} of the checkpoint --megatron-path {megatron_path}")


def check_processor_fits(reader, megatron_path: str, hf_config_path, hf_processor_path: str, lora_base=None) -> None:
    """One line where the prompt reader's processor does not fit the checkpoint (read from its recorded
    shape, before any weight loads): its prompts would place vision features wrong."""
    from ..checkpoint.hf_conversion import check_checkpoint_dir, checkpoint_shape
    from ..data.processor import processor_differences

    check_checkpoint_dir(megatron_path)
    shape, _ = checkpoint_shape(megatron_path, hf_config_path, lora_base)
    differ = processor_differences(reader.processor, reader.info, shape)
    if differ:
        raise ValueError(
            f"--hf-processor-path {hf_processor_path} does not fit the checkpoint --megatron-path "
            f"{megatron_path}: {'; '.join(differ)} (use the processor the checkpoint was trained with)"
        )

"""The conversion model without its weights, and its tensors taken in and out one at a time.

The tools that touch a whole checkpoint (import, export, export-peft, verify) never hold the model: they
build it at TP = 1 on the meta device, which costs no memory at any size, and use it for what it knows
without weights: its parameter names and shapes, and the checkpoint keys megatron-core's
``sharded_state_dict`` gives each (with the splits of its factories, such as Gated DeltaNet's
``in_proj`` sections). A tensor is then read, converted and written, or put into its module for the
forward that needs it (``put_parameter``) and taken out again (``empty_parameter``).

megatron-core places a few small tensors on its device explicitly (Gated DeltaNet's ``conv1d``,
``A_log``, ``dt_bias``), which the meta-device context does not override; they are sent to meta
after the build, so no weight is in memory until it is put in. The model's buffers (rotary
frequencies) are made on the host, so a forward of the weightless model, its weights put in module
by module, needs nothing else.
"""

from __future__ import annotations

import torch

from examples.multimodal_dev.models import model_of


def weightless_model(shape, lora=None):
    """The TP = 1 model of ``shape`` with its parameters on the meta device; ``lora``
    (``lora_checkpoint.StoredLora``): with the adapters the run had, on meta as well."""
    import megatron.cpu
    from megatron.cpu.single_process import init_single_process

    init_single_process()
    megatron.cpu.register_torch_gdn_kernels()  # GPUs are hidden; FLA's Triton kernels cannot run
    with torch.device("meta"):
        model = model_of(shape).build_fn(
            shape, params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False
        )
    for name, param in list(model.named_parameters()):
        if not param.is_meta:  # placed on the host explicitly by megatron-core (Gated DeltaNet's)
            empty_parameter(model, name)
    if lora is not None:  # the adapters follow their weights' device: meta, drawn from nothing
        from examples.multimodal_dev.lora import apply as lora_apply

        lora_apply.apply(model, lora.rank, lora.alpha, 0.0, lora.targets, seed=0)
    return model.eval()


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def put_parameter(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` as the parameter ``name`` (frozen), keeping the attributes megatron-core set on the
    one it replaces (its tensor-parallel split, ``allreduce``)."""
    owner, leaf = _owner(model, name)
    old = owner._parameters[leaf]
    new = torch.nn.Parameter(tensor, requires_grad=False)
    new.__dict__.update(old.__dict__)
    owner._parameters[leaf] = new


def empty_parameter(model: torch.nn.Module, name: str, dtype: torch.dtype | None = None) -> None:
    """The parameter ``name`` back on the meta device (``dtype``: another dtype), its memory freed."""
    owner, leaf = _owner(model, name)
    old = owner._parameters[leaf]
    put_parameter(model, name, torch.empty(old.shape, dtype=dtype or old.dtype, device="meta"))

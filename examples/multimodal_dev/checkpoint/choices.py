"""What the checkpoint tools offer on their command lines, importable without torch or megatron-core,
so that ``--help`` and a mistyped flag answer at once; the modules that do the work take their
tables from here."""

# The dtypes an export may cast to (torch's names).
DTYPE_NAMES = ("bfloat16", "float16", "float32")
# How export writes MoE experts: one tensor per expert, as the hub's checkpoints and serving stacks
# store them, or packed [E, ...] as transformers holds them in memory.
MOE_LAYOUTS = ("per-expert", "packed")
# What an import writes: megatron's sharded format (DDP and the distributed optimizer), or Megatron-FSDP's,
# the only one an FSDP=1 run reads (megatron-core 0.19.2 reads neither into the other's runs)
CKPT_FORMATS = ("torch_dist", "fsdp_dtensor")

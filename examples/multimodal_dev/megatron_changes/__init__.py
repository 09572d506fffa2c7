"""Every change this project makes to megatron-core, megatron.training, megatron-energon,
torch.distributed.checkpoint and torch's Dynamo, in one table (``table.py``) applied by one function
(``applier.py``), but for the values set by their own call, whose rows say where.

    install(args, meter)   the training run: every row that applies to it, in the table's order (the
                           targets of the rows applied by their own call checked to exist)
    apply(group)           one group, from the module that needs it (a tool reading a checkpoint,
                           the energon reader, a model with an MTP head under context parallelism)

The table names each replacement by its dotted path and ``apply`` imports it when its group is
applied, so any layer may ask for its group: this package itself imports nothing of the project.
``python -m examples.multimodal_dev.megatron_changes`` prints the table (``docs/megatron_changes.md``
is that output, held equal by a test).
"""

from .applier import MegatronChangeError, applied, apply, install

__all__ = ["MegatronChangeError", "apply", "applied", "install"]

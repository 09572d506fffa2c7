"""megatron-core's GatedDeltaNet as the tiny variant's decoder builds it on the local backend (the
project's spec: column / row parallel linears, the head-shared out norm), and a packed row's
``PackedSeqParams``. Needs megatron-core initialised in the process (the ``mcore`` fixture, or
``megatron.cpu.single_process.init_single_process``)."""

import torch


def tiny_gdn_layer(layer_class=None, **config_settings):
    """A fresh layer of the tiny variant's shape (4 key / 8 value heads of 16), initialised as
    megatron-core initialises it (``A_log`` = log U(1, 16), ``dt_bias`` = 1): megatron-core's class,
    or ``layer_class`` (the model's, which also decodes)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from examples.multimodal_dev.models.common.norms import HeadSharedNorm
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant, language_transformer_config

    config = language_transformer_config(get_variant("tiny").text, **config_settings)
    submodules = GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=HeadSharedNorm, out_proj=RowParallelLinear
    )
    return (layer_class or GatedDeltaNet)(
        config, submodules, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )


def packed_params(lengths):
    """THD ``PackedSeqParams`` of one row holding sequences of ``lengths`` tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )

"""megatron-core's GatedDeltaNet layer with the torch kernels: a packed THD row equals the
same layer run on each sample alone (conv and recurrent state reset at boundaries). 1e-5 abs."""

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from examples.multimodal_dev.models.common.norms import TorchNorm
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant, language_transformer_config


def test_packed_gdn_layer_equals_per_sample(mcore):
    config = language_transformer_config(get_variant("tiny").text)
    layer = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=TorchNorm,
                                                          out_proj=RowParallelLinear), layer_number=1,
                          pg_collection=_pg_collection()).eval()
    lengths = [9, 4, 15]
    x = torch.randn(sum(lengths), 1, config.hidden_size)
    cu = torch.tensor([0, 9, 13, 28], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=15, max_seqlen_kv=15)
    with torch.no_grad():
        packed, _ = layer(x, attention_mask=None, packed_seq_params=params)
        alone = [layer(x[a:b], attention_mask=None)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        joined, _ = layer(x, attention_mask=None)  # no boundaries: state leaks across samples
    diff = (packed - torch.cat(alone)).abs().max().item()
    print(f"GDN layer packed vs per-sample: max abs diff {diff:.2e}")
    assert diff < 1e-5
    assert (joined - packed)[9:].abs().max() > 1e-4


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()

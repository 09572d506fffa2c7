"""megatron-core's GatedDeltaNet layer with the torch kernels: a packed THD row equals the
same layer run on each sample alone (conv and recurrent state reset at boundaries). 1e-5 abs."""

import torch
from gdn_layer import packed_params, tiny_gdn_layer


def test_packed_gdn_layer_equals_per_sample(mcore):
    layer = tiny_gdn_layer().eval()
    lengths = [9, 4, 15]
    x = torch.randn(sum(lengths), 1, layer.config.hidden_size)
    params = packed_params(lengths)
    cu = params.cu_seqlens_q
    with torch.no_grad():
        packed, _ = layer(x, attention_mask=None, packed_seq_params=params)
        alone = [layer(x[a:b], attention_mask=None)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        joined, _ = layer(x, attention_mask=None)  # no boundaries: state leaks across samples
    diff = (packed - torch.cat(alone)).abs().max().item()
    print(f"GDN layer packed vs per-sample: max abs diff {diff:.2e}")
    assert diff < 1e-5
    assert (joined - packed)[9:].abs().max() > 1e-4

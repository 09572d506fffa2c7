"""models/qwen35_vl/flops.py against counts worked out by hand for a small configuration.

Shape: hidden 8, layers [GDN, attention], 2 query heads / 1 KV head of 4, FFN 16, vocab 32;
GDN 1 key head / 2 value heads of 4, conv 4; vision depth 1, hidden 4, MLP 8, patch 3x2x2x2 = 24
values, merge 2. Batch: samples of 3 and 5 tokens, one 1x2x2 image.

  GDN per token   in_proj 2*8*(8+16+4)=448, conv 2*4*16=128, rule 2*(6*16 + 2*64*8)=2240,
                  out_proj 2*8*8=128 -> 2944; x 8 tokens = 23552
  attention       projections (2*8*(16+8) + 2*8*8) * 8 = 4096; core 2*2*4*(3*4 + 5*6) = 672 -> 4768
  MLP             2 layers * 6*8*16 * 8 tokens = 12288
  output          2*8*32*8 = 4096
  vision          patch embed 2*24*4*4 = 768; block (96+32+128)*4 = 1024 + core 4*4*16 = 256;
                  merger 2*16^2 + 2*16*8 = 768 -> 2816
  forward 47520; training 3x = 142560; an MTP layer adds 2048 + 4768 + 6144 + 4096 = 17056
"""

from examples.multimodal_dev.models.qwen35_vl.configuration import FULL, LINEAR, Qwen35VLShape, TextShape, VisionShape
from examples.multimodal_dev.models.qwen35_vl.flops import micro_batch_flops

SHAPE = Qwen35VLShape(
    text=TextShape(
        hidden_size=8,
        num_layers=2,
        layer_types=(LINEAR, FULL),
        num_attention_heads=2,
        num_kv_heads=1,
        head_dim=4,
        ffn_hidden_size=16,
        vocab_size=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=4,
        mrope_section=(1, 0, 0),
    ),
    vision=VisionShape(
        depth=1, hidden_size=4, intermediate_size=8, num_heads=1, patch_size=2, temporal_patch_size=2, out_hidden_size=8
    ),
)


def test_counts_equal_the_hand_computed_ones():
    f = micro_batch_flops(SHAPE, [3, 5], [(1, 2, 2)])
    assert (f.gdn, f.attention, f.mlp, f.output, f.vision, f.mtp) == (23552, 4768, 12288, 4096, 2816, 0)
    assert f.forward == 47520 and f.training == 142560


def test_mtp_layer_adds_its_work():
    from dataclasses import replace

    shape = replace(SHAPE, text=replace(SHAPE.text, mtp_num_layers=1))
    assert micro_batch_flops(shape, [3, 5], [(1, 2, 2)]).mtp == 17056


def test_attention_is_counted_on_real_sample_lengths():
    packed = micro_batch_flops(SHAPE, [3, 5])
    one_long = micro_batch_flops(SHAPE, [8])
    assert packed.gdn == one_long.gdn and packed.mlp == one_long.mlp  # linear in tokens
    assert one_long.attention - packed.attention == 2 * 2 * 4 * (8 * 9 - 3 * 4 - 5 * 6)


def test_moe_counts_active_experts_only():
    from dataclasses import replace

    moe = replace(
        SHAPE,
        text=replace(SHAPE.text, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=4, shared_expert_ffn_hidden_size=4),
    )
    # per token per layer: router 2*8*8 + 2 experts * 6*8*4 + shared 6*8*4 + gate 2*8 = 128+384+192+16
    assert micro_batch_flops(moe, [3, 5]).mlp == 2 * 720 * 8

"""transformers' greedy answer to given prompt tokens: what ``tools/generate.py``'s answers are held to."""

from __future__ import annotations

import torch


def hf_greedy(
    model_dir, prompt_ids, new_tokens: int, pixel_values=None, image_grid_thw=None, processor_dir=None
) -> list[int]:
    """The answer's token ids from the model in ``model_dir`` (and the processor there, or in
    ``processor_dir``). A random model's ids mostly lie past a tiny tokenizer's vocabulary and decode
    to nothing, so ids are what is compared."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(str(processor_dir or model_dir))
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = processor.tokenizer
    ends = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    return greedy_of(hf, prompt_ids, new_tokens, pixel_values, image_grid_thw, ends, tok.pad_token_id)


def greedy_of(hf, prompt_ids, new_tokens: int, pixel_values=None, image_grid_thw=None, end_ids=None, pad_id=0):
    """The answer's token ids from the transformers model ``hf`` on its own device; without ``end_ids``
    every one of ``new_tokens`` steps runs."""
    device = next(hf.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    media = {}
    if pixel_values is not None:
        media = {"pixel_values": pixel_values.to(device), "image_grid_thw": image_grid_thw.to(device)}
    ends = {"eos_token_id": end_ids} if end_ids else {"min_new_tokens": new_tokens}
    out = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == hf.config.image_token_id).long(),
        **media,
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=pad_id,
        **ends,
    )
    return out[0, ids.shape[1] :].tolist()

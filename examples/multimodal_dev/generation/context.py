"""The decoding state of one batch of prompts: megatron-core's static KV cache for the attention
layers, the Gated DeltaNet states (``models/common/gdn_decoding.py``), and which positions hold real
tokens.

Prompts are left-padded to one length, so every row's next token goes to the same position and one
forward a step serves the batch. Padding is kept out of attention by an explicit mask (every padded
query attends to itself alone: a row of nothing would be NaN, and NaN times a zero weight is NaN) and
out of the DeltaNet state by the layer itself.

megatron-core's static cache stores keys before rotation and rotates the whole prefix at every step,
so each forward is handed the rotary positions of the whole prefix, [3, B, end] (``positions``).
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext


class DecodingContext(StaticInferenceContext):
    def __init__(self, real_prompt_BS: torch.Tensor, max_new_tokens: int):
        """``real_prompt_BS``: True at the prompts' real tokens (False at their left padding)."""
        batch, prompt = real_prompt_BS.shape
        super().__init__(max_batch_size=batch, max_sequence_length=prompt + max_new_tokens)
        self.real = torch.ones(batch, prompt + max_new_tokens, dtype=torch.bool, device=real_prompt_BS.device)
        self.real[:, :prompt] = real_prompt_BS.bool()
        self.gdn_states: dict = {}

    def attention_mask(self, length: int) -> torch.Tensor | None:
        """megatron's mask (True: not attended) [B, 1, length, end] for ``length`` tokens from the
        current offset; None where no key is padding."""
        start = self.sequence_len_offset
        end = start + length
        keys = self.real[:, :end]
        if bool(keys.all()):
            return None
        query_pos = torch.arange(start, end, device=keys.device)[:, None]
        key_pos = torch.arange(end, device=keys.device)[None, :]
        keep = (keys[:, None, :] & (key_pos <= query_pos)) | (key_pos == query_pos)  # [B, length, end]
        return ~keep[:, None]

"""Checkpoint formats and their safety: directory helpers, restricted unpickling, the save guard,
the token-budget plan state, Hugging Face safetensors and the HF <-> Megatron conversion."""

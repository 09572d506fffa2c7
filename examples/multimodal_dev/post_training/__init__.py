"""Post-training on the training engine: DPO (``dpo.py``), on the step, the model and the layouts SFT
runs, with the base model (the LoRA adapters off) as the reference."""

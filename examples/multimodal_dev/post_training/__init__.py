"""Post-training on the training engine: DPO (``dpo.py``) and GRPO (``grpo.py``, its answers drawn by
``rollout.py``), on the step, the model and the layouts SFT runs, with the base model (the LoRA
adapters off) as the reference; ``reference_pass.py`` carries the reference's pass beside the
policy's through the pipeline."""

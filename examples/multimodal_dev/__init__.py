"""The multimodal training playground: Qwen3.5-VL on megatron.training (see README.md).

Imported as ``examples.multimodal_dev`` with the repository root on ``PYTHONPATH``
(``tools/bootstrap_env.sh`` and ``run_qwen35_vl.sh`` put it there); the entry points run as
``python -m examples.multimodal_dev.pretrain_multimodal`` / ``...tools.convert_checkpoint`` /
``...benchmarks.NAME``. The layers and what each may import: README.md, "Layout".
"""

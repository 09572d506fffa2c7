"""The launcher of ``run_qwen35_vl.sh``: a run as one typed ``RunConfig`` (``run_config.py``) from a
recipe (``recipes.py``) and the environment (``from_env.py``), checked once (``checks.py``), written as
the training script's flags (``megatron_argv.py``) and started (``launch.py``)."""

"""Recipes: the runs ``run_qwen35_vl.sh`` starts from, as functions returning a ``RunConfig``. The
script picks ``for_host(variant, gpu)`` and lays the environment's variables over it; Python callers
take the same recipe and change what they need with ``dataclasses.replace``:

    config = recipes.for_host("proxy", gpu=True)
    config = replace(config, layout=replace(config.layout, tp=2))
    argv = launch.argv_of(config, host)  # resolved and checked as the script's variables are

A CPU host gets a short run of small batches at a high LR (the tiny model learns in 30 steps); a
GPU host a longer sequence and the LR of a fine-tune."""

from __future__ import annotations

from dataclasses import replace

from .parsers import Written
from .run_config import Batch, Model, Optimizer, RunConfig

CPU_BATCH = Batch(train_iters=30, mbs=2, gbs=4, seq_len=1024)
GPU_BATCH = Batch(train_iters=20, mbs=1, gbs=8, seq_len=4096)
CPU_LR, GPU_LR = Written("2e-3"), Written("1e-4")  # printed as written


def on_cpu(variant: str) -> RunConfig:
    return RunConfig(model=Model(variant=variant), batch=CPU_BATCH, optimizer=Optimizer(lr=CPU_LR))


def on_gpu(variant: str) -> RunConfig:
    return RunConfig(model=Model(variant=variant), batch=GPU_BATCH, optimizer=Optimizer(lr=GPU_LR))


def for_host(variant: str, gpu: bool) -> RunConfig:
    """What the run script starts from for ``variant`` on this host: the host decides the batch and
    the LR, whatever the model."""
    return on_gpu(variant) if gpu else on_cpu(variant)


def with_shape_from(config: RunConfig, hf_config: str) -> RunConfig:
    """``config`` with the model's shape read from a Hugging Face ``config.json``."""
    return replace(config, model=replace(config.model, variant="hf_config", hf_config=hf_config))

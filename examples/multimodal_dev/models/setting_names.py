"""How a parallel setting is named in a message: as megatron's flag (``--tensor-model-parallel-size 2``,
where the training script or a tool checks it) or as the run script's variable (``TP=2``, where
``training/launch.py`` checks it before any rank starts). One check, two audiences: the checks
of ``qwen35_vl/parallel.py``, ``planner/pipeline_layout.py`` and ``vision_ranks/layout.py`` take
``names=FLAGS`` or ``names=VARIABLES``."""

from __future__ import annotations

FLAGS = {
    "world": "the world size",
    "tp": "--tensor-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vp": "--num-virtual-stages-per-pipeline-rank",
    "first": "--decoder-first-pipeline-num-layers",
    "last": "--decoder-last-pipeline-num-layers",
    "vtp": "--vision-tensor-parallel-size",
    "vnproc": "--vision-nproc",
}
VARIABLES = {
    "world": "NPROC=",
    "tp": "TP=",
    "cp": "CP=",
    "ep": "EP=",
    "pp": "PP=",
    "vp": "VP=",
    "first": "PP_FIRST=",
    "last": "PP_LAST=",
    "vtp": "VISION_TP=",
    "vnproc": "VISION_NPROC=",
}


def named(names: dict, key: str, value) -> str:
    """``--tensor-model-parallel-size 2`` (FLAGS) or ``TP=2`` (VARIABLES)."""
    sep = "" if names[key].endswith("=") else " "
    return f"{names[key]}{sep}{value}"

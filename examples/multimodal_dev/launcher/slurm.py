"""The nodes of a SLURM job step: under ``srun`` (one task a node), ``NNODES``, ``NODE_RANK`` and
``MASTER_ADDR`` default to the step's node count, this node's id and the step's first host, so the
same ``bash run_qwen35_vl.sh`` runs on every node of an sbatch script (``launcher/qwen35_vl.sbatch``).

Only a step sets ``SLURM_STEP_NUM_NODES``: the batch script itself, run once on the first node, is not
a node of the run, and its launcher would wait for nodes that never come."""

from __future__ import annotations

import re
from collections.abc import Mapping


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed host list: ``node[003-006,9]`` -> ``node003``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist)
    if not match or not (match.group(1) or match.group(2)):
        raise ValueError(f"SLURM_STEP_NODELIST={nodelist}: not a host list")
    prefix, ranges, suffix = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "") + suffix


def step_nodes(environ: Mapping[str, str]) -> dict[str, str]:
    """NNODES, NODE_RANK and MASTER_ADDR of the SLURM step this process runs in (empty outside one)."""
    if not environ.get("SLURM_STEP_NUM_NODES"):
        return {}
    return {
        "NNODES": environ["SLURM_STEP_NUM_NODES"],
        "NODE_RANK": environ.get("SLURM_NODEID", "0"),
        "MASTER_ADDR": first_host(environ.get("SLURM_STEP_NODELIST", "")),
    }

"""The nodes of a SLURM job step: under ``srun`` (one task a node), ``NNODES``, ``NODE_RANK`` and
``MASTER_ADDR`` default to the step's node count, this node's id and the step's first host, so the
same ``bash run_qwen35_vl.sh`` runs on every node of an sbatch script (``launcher/qwen35_vl.sbatch``).

Only a step sets ``SLURM_STEP_NUM_NODES``: the batch script itself, run once on the first node, is not
a node of the run, and its launcher would wait for nodes that never come."""

from __future__ import annotations

import re
from collections.abc import Mapping


def hosts(nodelist: str, variable: str = "SLURM_STEP_NODELIST") -> list[str]:
    """SLURM's compressed host list expanded as SLURM expands it: ``node[003-005,9],gpu7`` ->
    ``node003 node004 node005 node9 gpu7`` (each range keeps its own width); several brackets in one name multiply
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``). A list SLURM would not read is one line naming it."""
    names = []
    for item in _top_level(nodelist, variable):
        pieces = re.split(r"(\[[^\[\]]*\])", item)
        if any(c in piece for piece in pieces[::2] for c in "[]"):
            raise ValueError(f"{variable}={nodelist}: unbalanced brackets in {item!r}")
        expanded = [""]
        for i, piece in enumerate(pieces):
            choices = _ranges(piece[1:-1], nodelist, variable) if i % 2 else [piece]
            expanded = [head + choice for head in expanded for choice in choices]
        names += expanded
    return names


def _top_level(nodelist: str, variable: str) -> list[str]:
    """The comma-separated names outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(nodelist + ","):
        depth += (c == "[") - (c == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"{variable}={nodelist}: unbalanced brackets")
        if c == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{variable}={nodelist}: unbalanced brackets")
    if not all(items):
        raise ValueError(f"{variable}={nodelist}: not a host list (expected names such as node[01-04],gpu7)")
    return items


def _ranges(ranges: str, nodelist: str, variable: str) -> list[str]:
    """``003-005,9`` -> 003 004 005 9: each range keeps its first number's width."""
    numbers = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match or int(match.group(2) or match.group(1)) < int(match.group(1)):
            raise ValueError(f"{variable}={nodelist}: [{ranges}] holds {part!r}, not a number or a rising range")
        low, high = match.group(1), match.group(2) or match.group(1)
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def first_host(nodelist: str) -> str:
    """The first host of SLURM's compressed host list: ``node[003-006,9]`` -> ``node003``."""
    return hosts(nodelist)[0]


def step_nodes(environ: Mapping[str, str]) -> dict[str, str]:
    """NNODES, NODE_RANK and MASTER_ADDR of the SLURM step this process runs in (empty outside one)."""
    count = environ.get("SLURM_STEP_NUM_NODES")
    if not count:
        return {}
    listed = hosts(environ.get("SLURM_STEP_NODELIST", ""))
    if count.isdigit() and int(count) != len(listed):
        raise ValueError(
            f"SLURM_STEP_NODELIST={environ['SLURM_STEP_NODELIST']} names {len(listed)} host(s), "
            f"SLURM_STEP_NUM_NODES={count}"
        )
    return {"NNODES": count, "NODE_RANK": environ.get("SLURM_NODEID", "0"), "MASTER_ADDR": listed[0]}

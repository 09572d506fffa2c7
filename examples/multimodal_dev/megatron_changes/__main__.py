"""Print the table of this project's changes to megatron as Markdown (``docs/megatron_changes.md``).

python -m examples.multimodal_dev.megatron_changes > docs/megatron_changes.md
"""

from __future__ import annotations

import argparse

from .table import CHANGES, GROUPS, WRITTEN_FOR

INTRO = f"""# How this project changes megatron

Every attribute of megatron-core, megatron.training, megatron-energon,
torch.distributed.checkpoint and torch's Dynamo this project replaces or sets, in the order they are
applied. The table is `examples/multimodal_dev/megatron_changes/table.py`; this page is its output
(`python -m examples.multimodal_dev.megatron_changes`), and a test keeps the two equal and the
table equal to what a run installs. Written for megatron-core {WRITTEN_FOR}: another version gets a
warning naming the groups to re-verify, and a target that no longer exists stops the run naming it.

Replacements are factories `make(original, run)` in the module named; the device layer's rows
(`megatron.cpu: ...`) name the function `megatron/cpu` puts in place on a host without CUDA; the rows
applied `by its own call` name the function that sets the value, called where the row says (a run
checks that their targets exist).
"""


def markdown() -> str:
    lines = [INTRO]
    for group in GROUPS:
        rows = [c for c in CHANGES if c.group == group]
        lines += [
            f"## {group}",
            "",
            f"Applies: {rows[0].applies}.",
            "",
            "| target | replacement | why |",
            "|---|---|---|",
        ]
        lines += [
            f"| `{c.target}` | `{c.replacement.removeprefix('examples.multimodal_dev.')}` | {c.why} |" for c in rows
        ]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(markdown(), end="")


if __name__ == "__main__":
    main()

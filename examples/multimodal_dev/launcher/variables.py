"""The variables ``run_qwen35_vl.sh`` reads, as ``run_config.py`` declares them: their names, README.md's
table (``markdown()``, held equal by a test), their limits, and the near misses of them that the
environment holds (a misspelt variable would be dropped without a word)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .run_config import INT32, INT64, RANKS, Setting, settings

SETTINGS: tuple[Setting, ...] = tuple(setting for _, _, setting in settings())
NAMES = frozenset(setting.name for setting in SETTINGS)


def rows() -> list[tuple[tuple[str, ...], str, str]]:
    """README's rows: (names, default, meaning), a row where its first variable is declared."""
    members: dict[str, list[str]] = {}
    for setting in SETTINGS:
        members.setdefault(setting.row or setting.name, []).append(setting.name)
    by_name = {setting.name: setting for setting in SETTINGS}
    return [(tuple(names), by_name[first].default, by_name[first].meaning) for first, names in members.items()]


def markdown() -> str:
    """README.md's table of the variables."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for names, default, meaning in rows():
        cells = (" ".join(f"`{name}`" for name in names), default, meaning)
        lines.append(" ".join(["|", *(f"{cell} |" if cell else "|" for cell in cells)]))
    return "\n".join(lines) + "\n"


# The largest value of each numeric variable (declared with it) or product of variables, and what holds
# it: past these a run cannot be what was asked (positions that round, counters that wrap), or asks more
# than any input needs. Python's ints never overflow, so nothing before torch would notice.
PRODUCTS: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("MBS", "SEQ_LEN"), INT32, "a micro-batch's tokens are indexed by int32 cu_seqlens"),
    (("NNODES", "NPROC"), *RANKS),
    (("TRAIN_ITERS", "GBS", "SEQ_LEN"), INT64, "the tokens a run sees are counted in int64"),
)
# products after their factors: a value past its own limit is named alone
LIMITS = tuple(((s.name,), *s.limit) for s in SETTINGS if s.limit) + PRODUCTS


def limit_problem(values: dict[str, str]) -> str | None:
    """The first of ``LIMITS`` that the variables set in ``values`` exceed, as one line naming the
    variables, their values and the limit; None when every one holds. Values are already checked
    to be numbers."""
    for names, limit, why in LIMITS:
        if not all(name in values for name in names):
            continue
        given = [values[name] for name in names]
        product = 1
        for value in given:
            product *= float(value) if any(c in value for c in ".eE") else int(value)
        if product > limit:
            what = "*".join(names) + f"={product}" if len(names) > 1 else f"{names[0]}={given[0]}"
            parts = f" ({', '.join(f'{n}={v}' for n, v in zip(names, given))})" if len(names) > 1 else ""
            return f"{what}{parts} is over {limit}: {why}"
    return None


def _edits(a: str, b: str) -> int:
    """Edits from ``a`` to ``b``: insertions, deletions, substitutions and swaps of neighbours."""
    before, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            cost = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, row = row, current
    return row[-1]


# Namespaces of other programs (no variable of the script's begins so), and torchrun's own variables
FOREIGN_PREFIXES = (
    "SLURM_", "NCCL_", "CUDA_", "TORCH", "PYTHON", "LC_", "XDG_", "SSH_", "OMPI_", "PMI_", "PMIX_", "OMP_",
    "KMP_", "MKL_", "TRITON_", "NVIDIA_", "GITHUB_", "CONDA_", "PYENV_",
)  # fmt: skip
FOREIGN = frozenset(("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))


def near_miss(name: str, known: Iterable[str] = NAMES) -> str | None:
    """The variable of the script's that ``name`` looks like a misspelling of (another case, a plural or
    a singular, or one or two edits of a long name), or None. Names of three letters or fewer take
    another case only: ``CC`` and ``EPS`` are not misspelt ``CP`` and ``EP``."""
    if name in known or name in FOREIGN or name.startswith(FOREIGN_PREFIXES):
        return None
    upper, found = name.upper(), []
    for real in known:
        plural = len(real) > 3 and real in (upper + "S", upper[:-1]) and upper.endswith("S") != real.endswith("S")
        if upper == real or plural:
            return real
        allowed = 2 if len(real) >= 8 else 1 if len(real) >= 4 else 0
        if allowed and abs(len(upper) - len(real)) <= allowed and (edits := _edits(upper, real)) <= allowed:
            found.append((edits, real))
    return min(found)[1] if found else None


def misspelt(environ: Mapping[str, str], unchecked: Iterable[str]) -> str | None:
    """The first variable set in ``environ`` that is a near miss of one of the script's, as one line
    naming both; the names in ``unchecked`` (``UNCHECKED_VARIABLES``) pass."""
    passed = set(unchecked)
    for name in sorted(environ):
        real = near_miss(name)
        if real and name not in passed:
            return (
                f"{name} is not a variable of the script's: did you mean {real}? (a variable of your own that "
                f"looks like one: UNCHECKED_VARIABLES={name})"
            )
    return None

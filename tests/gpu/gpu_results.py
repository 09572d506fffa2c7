"""Rows of the GPU checks and the table made from them (JSON + Markdown). No GPU needed.

Every check appends its rows as it finishes one (a JSON line each, flushed), so whatever finished
before a timeout or a crash is kept; ``collect`` turns the rows into ``results.json`` and
``results.md`` and prints the table. A row:

    {"check": "fla kernels", "case": "chunk_gated_delta_rule bf16", "status": "pass"|"fail"|"skip"|"info",
     "metrics": {name: number or text}, "note": "why / what", "details": {title: [row dicts]}}

Rows are written only where ``GPU_RESULTS`` names the rows file (tests/gpu/run.sh sets it), so the
CPU suite, which collects tests/gpu and skips it, never writes anything.

    python tests/gpu/gpu_results.py add --check C --case X --status S [--note N] [--metric k=v ...]
    python tests/gpu/gpu_results.py env --out env.json       # versions and GPUs (+ an "env" row)
    python tests/gpu/gpu_results.py collect --rows rows.jsonl --outdir DIR [--env env.json]
    python tests/gpu/gpu_results.py docs [--folder tests/gpu/results/DATE-DEVICE]   # docs/gpu.md's GPU table
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import time

STATUSES = ("pass", "fail", "skip", "info")


def rows_path() -> str | None:
    return os.environ.get("GPU_RESULTS") or None


def rehearsal() -> bool:
    """GPU_CHECKS_REHEARSAL=1 on a host without CUDA: the checks that can run there do, on the tiny model
    and the torch kernels (training, bf16 resume, parity at the tiny shapes, greedy decoding, FSDP against
    DDP), so their own code (launching, parsing, verdicts, rows) is exercised before a GPU's minutes are
    spent on it. Their numbers are a CPU's and say so."""
    return os.environ.get("GPU_CHECKS_REHEARSAL") == "1"


def deadline_left() -> float:
    """Seconds left of tests/gpu/run.sh's budget (GPU_CHECKS_DEADLINE, epoch seconds); plenty if unset."""
    deadline = os.environ.get("GPU_CHECKS_DEADLINE")
    return float(deadline) - time.time() if deadline else 1e9


def progress(what: str) -> None:
    """One timestamped line in ``progress.log`` beside the rows, written and flushed at once: a check
    stopped by its time cap loses pytest's captured output, and this file then says which stage it
    was in and how long each earlier one took."""
    outdir = os.environ.get("GPU_CHECKS_OUTDIR")
    if not outdir:
        return
    with open(os.path.join(outdir, "progress.log"), "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {what}\n")


class Stages:
    """``with stages("building ours"):`` -> progress lines at the start and end, with the seconds."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, stage: str):
        import contextlib

        @contextlib.contextmanager
        def timed():
            start = time.time()
            progress(f"{self.prefix}: {stage} ...")
            yield
            progress(f"{self.prefix}: {stage} done in {time.time() - start:.1f} s")

        return timed()


def record(
    check: str,
    case: str,
    status: str,
    metrics: dict | None = None,
    note: str = "",
    details: dict | None = None,
    path: str | None = None,
) -> dict:
    """Append one row (and print it, so a pytest -s log shows the numbers too)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: expected one of {STATUSES}")
    row = {
        "check": check,
        "case": case,
        "status": status,
        "metrics": _clean(metrics or {}),
        "note": note,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if details:
        row["details"] = _clean(details)
    print(f"[gpu-result] {check} | {case} | {status} | {format_metrics(row['metrics'])} | {note}", flush=True)
    path = path or rows_path()
    if path:
        # one write() of the whole line: run.sh runs checks in parallel processes that append to one file
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)
    return row


def _clean(value):
    """JSON-safe: NaN/inf become text, tensors and numpy scalars become floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_rows(path: str) -> list[dict]:
    """Rows of a rows file; a line that does not parse (a write cut by a kill) becomes a fail row."""
    rows = []
    if not path or not os.path.exists(path):
        return rows
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(
                    {
                        "check": "results",
                        "case": f"{os.path.basename(path)} line {number}",
                        "status": "fail",
                        "metrics": {},
                        "note": f"unreadable row: {line.strip()[:120]}",
                    }
                )
    return rows


def _fmt(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e6:
        return f"{value:.2e}"
    return f"{value:.4g}"


def format_metrics(metrics: dict) -> str:
    return "; ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary(rows: list[dict]) -> dict:
    counts = dict.fromkeys(STATUSES, 0)
    for row in rows:
        counts[row.get("status", "fail") if row.get("status") in STATUSES else "fail"] += 1
    return counts


def markdown(rows: list[dict], meta: dict | None = None) -> str:
    meta = meta or {}
    lines = ["# GPU checks", ""]
    for key in ("device", "started", "elapsed_s", "budget_s", "steps"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    if meta.get("versions"):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    counts = summary(rows)
    lines += [
        f"- rows: {counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip, {counts['info']} info",
        "",
        "| check | case | status | numbers | note |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            "| "
            + " | ".join(
                _md_cell(x)
                for x in (
                    row.get("check", ""),
                    row.get("case", ""),
                    row.get("status", ""),
                    format_metrics(row.get("metrics", {})),
                    row.get("note", ""),
                )
            )
            + " |"
        )
    for row in rows:
        for title, table in (row.get("details") or {}).items():
            if not isinstance(table, list) or not table or not isinstance(table[0], dict):
                continue
            columns = list(table[0])
            lines += [
                "",
                f"## {row.get('check')}: {row.get('case')}: {title}",
                "",
                "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns),
            ]
            lines += ["| " + " | ".join(_md_cell(_fmt(item.get(c, ""))) for c in columns) + " |" for item in table]
    return "\n".join(lines) + "\n"


def collect(rows_file: str, outdir: str, env_file: str | None = None, extra_meta: dict | None = None) -> dict:
    rows = read_rows(rows_file)
    meta = {}
    if env_file and os.path.exists(env_file):
        with open(env_file) as f:
            meta.update(json.load(f))
    meta.update(extra_meta or {})
    os.makedirs(outdir, exist_ok=True)
    result = {"meta": meta, "summary": summary(rows), "rows": rows}
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(rows, meta)
    with open(os.path.join(outdir, "results.md"), "w") as f:
        f.write(text)
    print(text)
    return result


# docs/gpu.md's GPU table is made from the newest committed results folder (RESULTS_ROOT/DATE-DEVICE/,
# with meta.json naming its runs); tests/gpu/test_results_table.py keeps the two equal.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_ROOT = os.path.join(ROOT, "tests", "gpu", "results")
DOCS_PAGE = os.path.join(ROOT, "docs", "gpu.md")
TABLE_BEGIN = "<!-- gpu-results: begin (python tests/gpu/gpu_results.py docs writes this block) -->"
TABLE_END = "<!-- gpu-results: end -->"


def newest_results_folder(root: str = RESULTS_ROOT) -> str:
    dated = sorted(d for d in os.listdir(root) if d[:4].isdigit() and os.path.isdir(os.path.join(root, d)))
    if not dated:
        raise FileNotFoundError(f"{root}: no dated results folder (DATE-DEVICE/ with meta.json)")
    return os.path.join(root, dated[-1])


def docs_table(folder: str) -> str:
    """docs/gpu.md's block: where and what ran, then every row of every run (why, for fails and skips)."""
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    where = os.path.relpath(folder, ROOT)
    lines = [
        TABLE_BEGIN,
        f"Measured on {meta['device']}, {meta['date']}"
        + (f", commit {meta['commit']}" if meta.get("commit") else "")
        + f"; {meta['image']}. Every row comes from "
        f"`{where}/` (meta.json says which commit each run ran and how).",
        "",
        "| run | check | case | status | numbers | why |",
        "|---|---|---|---|---|---|",
    ]
    for run, how in meta["runs"].items():
        rows = _run_rows(os.path.join(folder, run), how)
        for row in rows:
            why = row.get("note", "") if row.get("status") in ("fail", "skip") else ""
            lines.append(
                "| "
                + " | ".join(
                    _md_cell(x)
                    for x in (
                        run,
                        row.get("check", ""),
                        row.get("case", ""),
                        row.get("status", ""),
                        format_metrics(row.get("metrics", {})),
                        why,
                    )
                )
                + " |"
            )
    return "\n".join([*lines, TABLE_END])


def _run_rows(run_dir: str, how: str) -> list[dict]:
    """A run's rows; a run that wrote no results.json (a bare pytest call under a timeout) is one row
    naming the files it left and what meta.json says of it."""
    path = os.path.join(run_dir, "results.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)["rows"]
    files = ", ".join(sorted(os.listdir(run_dir))) if os.path.isdir(run_dir) else "nothing"
    return [{"check": "no results.json", "case": files, "status": "fail", "note": how}]


def docs_block(text: str) -> str:
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    return text[start:end]


def write_docs(folder: str, page: str = DOCS_PAGE) -> None:
    with open(page) as f:
        text = f.read()
    with open(page, "w") as f:
        f.write(text.replace(docs_block(text), docs_table(folder)))


def environment() -> dict:
    """Versions and GPUs, each probe guarded: a missing package is a fact to report, not an error."""
    import importlib
    import importlib.metadata as md
    import platform

    versions = {"python": platform.python_version()}
    for dist in (
        "torch",
        "triton",
        "transformers",
        "megatron-core",
        "flash-linear-attention",
        "fla-core",
        "transformer-engine",
        "datasets",
        "qwen-vl-utils",
    ):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "absent"
    info = {"versions": versions}
    try:
        import torch

        versions["torch cuda"] = str(torch.version.cuda)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
        info["device"] = f"{count} x {info['gpus'][0]}" if count else "no CUDA device"
        if count:
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        info["device"] = f"torch failed: {e!r}"
    for name, module in (
        ("fla", "fla.ops.gated_delta_rule"),
        ("transformer_engine", "transformer_engine.pytorch"),
        ("megatron.core", "megatron.core"),
    ):
        try:
            importlib.import_module(module)
            info[f"{name} importable"] = "yes"
        except Exception as e:  # noqa: BLE001
            info[f"{name} importable"] = f"no: {type(e).__name__}: {str(e)[:160]}"
    try:
        import triton

        knobs = getattr(triton, "knobs", None)
        info["triton fp32 dot default knob"] = (
            "TRITON_F32_DEFAULT supported"
            if knobs is not None and hasattr(getattr(knobs, "language", None), "fp32_default")
            else "no knobs.language.fp32_default in this Triton"
        )
    except Exception as e:  # noqa: BLE001
        info["triton fp32 dot default knob"] = f"triton failed: {e!r}"
    return info


# Triton's line after autotuning a kernel for a new key (TRITON_PRINT_AUTOTUNING=1; none for a cached result):
# one line up to 3.5 or so, "function F,\nwith key as K,\nfinished after Ts," in later ones
AUTOTUNED = re.compile(r"Triton autotuning for function (\w+)(?:,\s*with key as [^\n]*,)?\s+finished after ([0-9.]+)s")


def autotuned(text: str) -> list[tuple[str, float]]:
    """(kernel, seconds) of every autotuning a log records, compiling each config included."""
    return [(name, float(seconds)) for name, seconds in AUTOTUNED.findall(text)]


def autotune_row(check: str, log_path: str) -> dict | None:
    """An info row of what Triton autotuned in one group's log: how many kernels and how long, the
    slowest five by name (a fresh machine's groups spend their time there)."""
    with open(log_path, errors="replace") as f:
        tuned = autotuned(f.read())
    if not tuned:
        return None
    slowest = sorted(tuned, key=lambda t: -t[1])[:5]
    metrics = {"autotuned kernels": len(tuned), "autotune s": sum(s for _, s in tuned)}
    note = "slowest: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest)
    return record(check, "Triton autotuning", "info", metrics, note)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add")
    add.add_argument("--check", required=True)
    add.add_argument("--case", default="")
    add.add_argument("--status", required=True, choices=STATUSES)
    add.add_argument("--note", default="")
    add.add_argument("--metric", action="append", default=[], help="name=value (a number where it parses)")
    env = sub.add_parser("env")
    env.add_argument("--out", required=True)
    col = sub.add_parser("collect")
    col.add_argument("--rows", required=True)
    col.add_argument("--outdir", required=True)
    col.add_argument("--env", default=None)
    col.add_argument("--meta", action="append", default=[], help="name=value added to the table's header")
    docs = sub.add_parser(
        "docs", aliases=["readme"], help="rewrite docs/gpu.md's GPU table from a committed results folder"
    )
    docs.add_argument("--folder", default=None, help="[the newest dated folder under tests/gpu/results/]")
    tune = sub.add_parser("autotune", help="an info row of the kernels Triton autotuned in a group's log")
    tune.add_argument("--check", required=True)
    tune.add_argument("--log", required=True)
    args = parser.parse_args(argv)

    if args.cmd == "add":
        metrics = {}
        for item in args.metric:
            key, _, value = item.partition("=")
            try:
                metrics[key] = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError:
                metrics[key] = value
        record(args.check, args.case, args.status, metrics, args.note)
    elif args.cmd == "env":
        info = environment()
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
        flat = {k: v for k, v in info.items() if k not in ("versions", "gpus")}
        shown = {k: info["versions"].get(k) for k in ("torch", "torch cuda", "triton", "flash-linear-attention")}
        record("env", "host", "info", {**shown, **flat}, "all versions: the table's header")
    elif args.cmd == "autotune":
        autotune_row(args.check, args.log)
    elif args.cmd in ("docs", "readme"):
        write_docs(args.folder or newest_results_folder())
    else:
        meta = dict(item.partition("=")[::2] for item in args.meta)
        result = collect(args.rows, args.outdir, args.env, meta)
        return 1 if result["summary"]["fail"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

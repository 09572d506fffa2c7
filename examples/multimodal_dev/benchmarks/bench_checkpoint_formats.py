"""The distributed optimizer's two checkpoint formats, through the engine at DP=2: save time, load
time and size of ``dp_reshardable`` (megatron's default) against ``fully_reshardable`` (this
playground's default, which resumes at another TP / PP / VP / EP).

    python -m examples.multimodal_dev.benchmarks.bench_checkpoint_formats [--variants tiny tiny-moe]

For each variant and format: one run trains an iteration and saves (megatron's ``save-checkpoint``
timer, slowest rank), a second resumes from it; the load time is the resumed run's
``model-and-optimizer-setup`` timer less the first run's (the same set-up without a checkpoint).
Size is the iteration directory on disk. Prints the ratio fully / dp for each figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FORMATS = {"dp_reshardable": ["--dist-ckpt-optim-dp-reshardable"], "fully_reshardable": []}
VARIANTS = {"tiny": {}, "tiny-moe": {"MOE": "1"}}


def _timer(output: str, name: str) -> float:
    """The slowest rank's milliseconds of one of megatron's timers, as its log prints them."""
    found = re.findall(rf"{name} \.+: \(([0-9.]+), ([0-9.]+)\)", output)
    if not found:
        raise SystemExit(f"bench_checkpoint_formats.py: no '{name}' timer in the run's log")
    return float(found[-1][1])


def _run(env: dict, flags: list[str]) -> str:
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), "--use-distributed-optimizer", "--eval-iters", "0", *flags],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode:
        raise SystemExit(f"bench_checkpoint_formats.py: a run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def measure(variant: str, fmt: str, workdir: str) -> dict:
    env = {"MODEL_VARIANT": "tiny", "NPROC": "2", "GBS": "4", "SEQ_LEN": "256", **VARIANTS[variant]}
    save_dir = os.path.join(workdir, f"{variant}-{fmt}")
    print(f"  {variant} {fmt}: save ...", file=sys.stderr, flush=True)
    saved = _run({**env, "TRAIN_ITERS": "1", "CKPT_SAVE": save_dir}, FORMATS[fmt])
    size = _size(os.path.join(save_dir, "iter_0000001"))
    resume_dir = save_dir + "-resumed"
    shutil.copytree(save_dir, resume_dir)
    print(f"  {variant} {fmt}: load ...", file=sys.stderr, flush=True)
    resumed = _run({**env, "TRAIN_ITERS": "2", "CKPT_RESUME": resume_dir}, FORMATS[fmt])
    setup = "model-and-optimizer-setup"
    return {
        "save_ms": _timer(saved, "save-checkpoint"),
        "load_ms": _timer(resumed, setup) - _timer(saved, setup),
        "bytes": size,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    print("| variant | format | save (s) | load (s) | size (MB) |\n| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as workdir:
        for variant in args.variants:
            rows = {fmt: measure(variant, fmt, workdir) for fmt in FORMATS}
            for fmt, r in rows.items():
                print(
                    f"| {variant} | {fmt} | {r['save_ms'] / 1e3:.2f} | {r['load_ms'] / 1e3:.2f} | "
                    f"{r['bytes'] / 1e6:.1f} |",
                    flush=True,
                )
            dp, full = rows["dp_reshardable"], rows["fully_reshardable"]
            print(
                f"| {variant} | fully / dp | {full['save_ms'] / dp['save_ms']:.2f}x | "
                f"{full['load_ms'] / dp['load_ms']:.2f}x | {full['bytes'] / dp['bytes']:.3f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Peak host memory of ``convert_checkpoint`` import, export and verify against the checkpoint's size.

    python -m examples.multimodal_dev.benchmarks.bench_convert_memory [--cases tiny,0.8b,35b_a3b-cut]
        [--workdir DIR] [--checkout DIR] [--config-mtp N] [--keep]

Each case is a random checkpoint written by transformers' ``save_pretrained`` (bf16, fp32 ``A_log`` /
``dt_bias``, default shard size; its config counts the MTP head that ``save_pretrained`` does not
write, as every Qwen3.5 fine-tuned on the Hugging Face side does):

    tiny          the CI model (a few MB): what a command costs with no model to speak of
    0.8b          Qwen3.5-0.8B's shape, 0.85 B parameters, 1.6 GB
    35b_a3b-cut   Qwen3.5-35B-A3B's widths (256 experts of 512, hidden 2048, vocabulary 248k, its
                  27-block vision tower) cut to one decoder layer (its attention layer: transformers'
                  Qwen3.5 does not run without one): 2.3 B parameters, 4.3 GiB, the layer's experts
                  1.6 GB of them, the embedding and the output head 1 GB each

Each command runs as the user runs it, in a process of its own; its peak resident memory is that of
it and its children, sampled every 0.2 s (a short peak between samples can be missed; the sampler
reads /proc, so Linux only). The table gives the peak, the checkpoint, their ratio, and the peak
above the same command on ``tiny``: what the model costs. ``--checkout DIR`` runs another checkout's
tools with the same harness (a before / after table); ``--config-mtp 0`` writes the configs without
the MTP head, for tools that refuse a checkpoint lacking it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

GIB = 1024**3
CASES = ("tiny", "0.8b", "35b_a3b-cut")
COMMANDS = ("import", "export", "verify")


def case_shape(name: str):
    from examples.multimodal_dev.models import default_model

    get_shape = default_model().shape_fn
    if name not in CASES:
        raise ValueError(f"--cases: unknown case {name!r}; valid: {', '.join(CASES)}")
    if name != "35b_a3b-cut":
        return get_shape(name, mtp=True)
    shape = get_shape("35b_a3b", mtp=True)
    return replace(shape, text=replace(shape.text, num_layers=1, layer_types=("full_attention",)))


def write_checkpoint(name: str, path: str, config_mtp: int | None) -> int:
    """``save_pretrained`` of a random model of the case in bf16; returns its parameter count."""
    import torch

    from examples.multimodal_dev.checkpoint.hf_models import hf_classes
    from examples.multimodal_dev.models import default_model

    cfg = default_model().shape_to_hf(case_shape(name))
    config_cls, model_cls = hf_classes(cfg.pop("model_type"))
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of billions of parameters
    try:
        model = model_cls(config_cls(**cfg))
    finally:
        torch.set_default_dtype(torch.float32)
    for pname, p in model.named_parameters():
        if pname.endswith(("A_log", "dt_bias")):
            p.data = p.data.float()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path)
    if config_mtp is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["text_config"]["mtp_num_hidden_layers"] = config_mtp
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return sum(p.numel() for p in model.parameters())


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants, from /proc."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_sampled(argv: list[str], env: dict, interval_s: float = 0.2) -> tuple[int, float, str]:
    """(peak resident bytes of the command and its children, seconds, its output's last lines)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    sampler.join()
    tail = "\n".join(out.strip().splitlines()[-3:])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[3:5])} exited {proc.returncode}:\n{out[-3000:]}")
    return peak[0], time.perf_counter() - start, tail


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def measure(name: str, work: str, checkout: str, config_mtp: int | None) -> dict:
    hf, mg, out = (os.path.join(work, name, d) for d in ("hf", "megatron", "export"))
    for d in (hf, mg, out):
        shutil.rmtree(d, ignore_errors=True)
    params = write_checkpoint(name, hf, config_mtp)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])}
    tool = [sys.executable, "-m", "examples.multimodal_dev.tools.convert_checkpoint"]
    argvs = {
        "import": [*tool, "import", "--hf-path", hf, "--megatron-path", mg],
        "export": [*tool, "export", "--megatron-path", mg, "--hf-path", out],
        "verify": [*tool, "verify", "--hf-path", hf, "--megatron-path", mg],
    }
    row = {"case": name, "parameters": params, "bytes": _size(hf)}
    for command in COMMANDS:
        peak, seconds, tail = run_sampled(argvs[command], env)
        row[command] = (peak, seconds)
        print(f"  {name} {command}: peak {peak / GIB:.2f} GiB in {seconds:.0f} s; {tail.splitlines()[-1]}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["case"] == "tiny"), None)
    lines = [
        "| case | parameters | safetensors | command | peak RSS | peak / checkpoint | above tiny | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for command in COMMANDS:
            peak, seconds = r[command]
            above = f"{(peak - base[command][0]) / GIB:+.2f} GiB" if base else "-"
            lines.append(
                f"| {r['case']} | {r['parameters'] / 1e9:.2f} B | {r['bytes'] / GIB:.2f} GiB | {command} | "
                f"{peak / GIB:.2f} GiB | {peak / r['bytes']:.2f} | {above} | {seconds:.0f} s |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--checkout", default=None, help="the repository whose tools run (default: this one)")
    parser.add_argument("--config-mtp", type=int, default=None, help="mtp_num_hidden_layers written to config.json")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    cases = args.cases.split(",")
    for name in cases:
        case_shape(name)  # an unknown case is refused before minutes of writing
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert_memory_")
    try:
        rows = [measure(name, work, args.checkout or here, args.config_mtp) for name in cases]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))


if __name__ == "__main__":
    main()

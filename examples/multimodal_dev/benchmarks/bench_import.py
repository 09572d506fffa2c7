"""Time and peak host memory of ``convert_checkpoint.py import`` on a random checkpoint of a
released shape (default ``0.8b``, about 0.9 B parameters with its vision tower), in bf16 with
fp32 ``A_log``/``dt_bias`` as released files are.

    python -m examples.multimodal_dev.benchmarks.bench_import [--variant 0.8b] [--workdir DIR]

The import runs in a child process, so its peak resident memory (``ru_maxrss``) is its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def write_random_checkpoint(variant: str, path: str) -> int:
    import torch

    from examples.multimodal_dev.checkpoint.hf_models import hf_classes
    from examples.multimodal_dev.models import default_model

    get_variant = default_model().shape_fn
    to_hf_config_dict = default_model().shape_to_hf

    shape = get_variant(variant, mtp=False)  # transformers does not build (or save) the MTP head
    cfg = to_hf_config_dict(shape)
    config_cls, model_cls = hf_classes(cfg.pop("model_type"))
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of 0.9 B parameters
    model = model_cls(config_cls(**cfg))
    torch.set_default_dtype(torch.float32)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            p.data = p.data.float()
    model.config.dtype = torch.bfloat16
    model.save_pretrained(path, max_shard_size="1GB")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="0.8b")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_import_")
    hf, mg = os.path.join(work, "hf"), os.path.join(work, "megatron")
    n_params = write_random_checkpoint(args.variant, hf)
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf))
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.multimodal_dev.tools.convert_checkpoint",
            "import",
            "--hf-path",
            hf,
            "--megatron-path",
            mg,
            "--overwrite",
        ],
        check=True,
    )
    seconds = time.perf_counter() - start
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2  # KiB on Linux
    print(
        f"| variant | parameters | safetensors | import time | peak RSS of the import |\n|---|---|---|---|---|\n"
        f"| {args.variant} | {n_params / 1e9:.2f} B | {size / 1024**3:.2f} GiB | {seconds:.1f} s | {peak_gib:.2f} GiB |"
    )
    print(f"checkpoints left in {work}")


if __name__ == "__main__":
    main()

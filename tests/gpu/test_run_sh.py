"""CPU check of tests/gpu/run.sh and of the GPU checks' own code (not marked gpu: it runs in the normal
suite). One run of run.sh as a rehearsal (gpu_results.rehearsal): the parity checks at the tiny shapes,
greedy decoding against transformers, the bf16 resume, Megatron-FSDP against DDP and the training
checks run on the tiny model on this CPU, so their launching, parsing, verdicts and rows are exercised
before a GPU's minutes are spent on them, while FLA's kernel checks skip (no test ran). Checked: the
groups run together start side by side and each gets its own rows (a group with no test gets its own
"no test ran" row), rows and outputs come back in the order the groups started, the groups run alone
follow, and the table is written with every step's exit in its header."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOGETHER = ["model parity fp32 tiny", "model parity fp32 wide", "model parity bf16 tiny", "model parity bf16 wide"]
TOGETHER = ["fla kernels bf16", "fla kernels fp32", *TOGETHER, "bf16 resume", "decode tokens", "Megatron-FSDP"]
REHEARSAL = {"GPU_CHECKS_REHEARSAL": "1", "GPU_TRAIN_ITERS": "8", "GPU_TRAIN_SEQ_LEN": "1024"}
# No skip for time: the caps and budget are a GPU's, and on a CPU host shared with the rest of the
# suite a group can take several times its cap (CI once skipped tiny-moe bf16 parity at the cap).
REHEARSAL.update(GPU_CHECKS_BUDGET_S="7200", GPU_CHECKS_CAP_SCALE="10")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One run of run.sh with the FLA, parity, resume, decode, FSDP and training groups: (results.json, run.log)."""
    tmp = tmp_path_factory.mktemp("gpu_run")
    out, scratch = tmp / "out", tmp / "scratch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_")}
    env.update(REHEARSAL, OUT=str(out), GPU_CHECKS_SCRATCH=str(scratch), PYTHON=sys.executable)
    env.update(GPU_CHECKS="fla parity resume decode fsdp train")
    env.pop("WHEELHOUSE", None)
    done = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "run.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the groups would run for real")
def test_groups_run_together_then_alone(rehearsal):
    result, log = rehearsal
    rows = [(row["check"], row["case"], row["status"]) for row in result["rows"][2:]]  # after bootstrap, env
    parity = "model vs transformers"
    expected = [
        # FLA's kernels need a GPU: their pytests ran no test, and each still gets a row of its own
        *[(f"fla kernels {dtype}", "", "skip") for dtype in ("bf16", "fp32")],
        *[(parity, f"tiny-{kind} fp32", "pass") for kind in ("dense", "moe")],
        (parity, "test_logits_match_transformers[wide-moe-fp32]", "skip"),
        *[(parity, f"tiny-{kind} bf16", "pass") for kind in ("dense", "moe")],
        (parity, "test_logits_match_transformers[wide-moe-bf16]", "skip"),
        ("bf16 resume", "tiny-moe straight vs resumed", "pass"),
        *[("decode", f"tiny-moe fp32 {prompt}", "pass") for prompt in ("text", "image")],
        ("Megatron-FSDP", "tiny-moe bf16, DP=1: FSDP vs DDP", "pass"),
        ("decode", "test_decode_tokens_per_second_bf16[1]", "skip"),  # alone, and timed: skipped here
        ("training", "tiny", "pass"),
        ("training", "tiny profile", "info"),
    ]
    assert rows == expected, rows  # in launch order, the groups run together before the one alone
    steps = result["meta"]["steps"]
    assert all(f"{name}: " in steps for name in [*TOGETHER, "training"]), steps

    started = [log.index(f"== [gpu] {name}: started beside the others") for name in TOGETHER]
    outputs = [log.index(f"== [gpu] {name} (timeout") for name in TOGETHER]
    # every launch is announced before any output comes back, and the outputs keep the launch order
    assert max(started) < min(outputs) and outputs == sorted(outputs)
    assert log.index("== [gpu] training (timeout") > max(outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the groups would run for real")
def test_a_rehearsal_trains_resumes_and_fills_the_rows(rehearsal):
    rows = {(row["check"], row["case"]): row for row in rehearsal[0]["rows"]}
    trained = rows[("training", "tiny")]
    metrics = trained["metrics"]
    assert metrics["iterations"] == 8 and metrics["loss last3"] < metrics["loss first3"]
    assert "no MFU: no peak known for this device" in trained["note"] and "entries in Triton's cache" in trained["note"]
    assert [r["iteration"] for r in trained["details"]["per iteration"]] == list(range(1, 9))
    profile = rows[("training", "tiny profile")]
    assert profile["metrics"]["profiled steps"] == 2 and "top CPU ops by count" in profile["details"]
    resumed = rows[("bf16 resume", "tiny-moe straight vs resumed")]
    assert resumed["metrics"] == {"resumed iterations": 3, "worst rel (loss, grad norm)": 0.0}
    parity = rows[("model vs transformers", "tiny-moe fp32")]
    assert parity["metrics"]["THD rel"] <= 2e-5 and parity["metrics"]["loss |THD-BSHD|"] <= 1e-5

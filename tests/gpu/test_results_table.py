"""CPU checks of the GPU checks' plumbing (not marked gpu: they run in the normal suite, in well under
a second): the rows file and the table written from it, the parsers of a training run's output and
profiler trace, the verdict of a training run, and the parameter count the 35b_a3b cut is sized with."""

import gzip
import json
import os
from dataclasses import replace

import gpu_profile
import gpu_results
import gpu_train as gt
import pytest

THROUGHPUT_LINE = (
    " model FLOPs (flops.py): 312.5 TFLOP/s per GPU over 1 iterations | tokens/s: 41234 |"
    " padding: 3.1% | MFU: 31.6% of 989 TFLOP/s dense bf16 |"
)


def _iteration_line(i: int, ms: float) -> str:
    return (
        f" [2026-11-20 10:00:00.000000] iteration {i:8d}/{20:8d} | consumed samples: {8 * i:12d} |"
        f" elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | lm loss: 1.0E+01 |"
    )


def test_rows_and_table(tmp_path, monkeypatch, capsys):
    rows_file = tmp_path / "rows.jsonl"
    monkeypatch.setenv("GPU_RESULTS", str(rows_file))
    gpu_results.record(
        "fla kernels", "chunk bf16", "pass", {"fwd max rel": 3.2e-3, "fla fwd ms": 1.234, "tokens": 2320}
    )
    gpu_results.record(
        "training",
        "proxy",
        "fail",
        {"tokens/s": 41234.5, "loss": float("nan")},
        "loss | did not fall",
        {"per iteration": [{"iteration": 1, "lm loss": 12.4}, {"iteration": 2, "lm loss": 11.9}]},
    )
    gpu_results.record("TE vs local", "test_te_equals_local", "skip", note="transformer_engine not importable")
    with open(rows_file, "a") as f:
        f.write('{"check": "cut by a kill\n')  # a half-written line must not lose the others
    result = gpu_results.collect(str(rows_file), str(tmp_path / "out"), extra_meta={"budget_s": "560"})
    assert result["summary"] == {"pass": 1, "fail": 2, "skip": 1, "info": 0}
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["case"] for r in saved["rows"]][:3] == ["chunk bf16", "proxy", "test_te_equals_local"]
    assert saved["rows"][1]["metrics"]["loss"] == "nan"  # JSON has no NaN: written as text
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| fla kernels | chunk bf16 | pass | fwd max rel=0.0032; fla fwd ms=1.234; tokens=2320 |  |" in md
    assert "loss \\| did not fall" in md  # a '|' in a note does not break the table
    assert "## training: proxy: per iteration" in md and "| 2 | 11.9 |" in md
    assert "- rows: 1 pass, 2 fail, 1 skip, 0 info" in md and "- budget_s: 560" in md
    assert "| check | case | status | numbers | note |" in capsys.readouterr().out


def test_no_rows_file_outside_run_sh(tmp_path, monkeypatch):
    """The CPU suite collects tests/gpu without GPU_RESULTS: recording writes nothing."""
    monkeypatch.delenv("GPU_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    gpu_results.record("x", "y", "info", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_add_command_parses_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_RESULTS", str(tmp_path / "rows.jsonl"))
    gpu_results.main(
        [
            "add",
            "--check",
            "bootstrap",
            "--status",
            "fail",
            "--note",
            "exit 1",
            "--metric",
            "seconds=12",
            "--metric",
            "rel=1e-5",
            "--metric",
            "name=proxy",
        ]
    )
    row = gpu_results.read_rows(str(tmp_path / "rows.jsonl"))[0]
    assert row["metrics"] == {"seconds": 12, "rel": 1e-5, "name": "proxy"} and row["status"] == "fail"


def test_log_parsing_and_steady_state(tmp_path):
    lines = []
    for i in range(1, 11):
        lines.append(_iteration_line(i, 900.0 + i))
        lines.append(THROUGHPUT_LINE.replace("312.5", str(300.0 + i)))
        if i % 5 == 0:
            lines.append(
                f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 1000.00 | max allocated: "
                f"{60000.0 + i:.2f} | reserved: 2000.00 | max reserved: 70000.00"
            )
    throughput, iter_ms, memory = gt.parse_log("\n".join(lines))
    assert sorted(throughput) == list(range(1, 11)) and throughput[3]["tflops"] == 303.0
    assert throughput[3]["tokens_per_s"] == 41234 and throughput[3]["padding"] == 3.1 and iter_ms[4] == 904.0
    assert memory == {"max allocated": 60010.0, "max reserved": 70000.0}
    run = gt.TrainRun("r", 0, False, 1.0, str(tmp_path / "none.log"), throughput=throughput, iter_ms=iter_ms)
    steady = gt.steady_state(run, 6, 9)
    assert steady["iterations"] == "6..9" and steady["tflops"] == 307.5 and steady["iter_ms"] == 907.5
    assert gt.steady_state(run, 50, 60)["iterations"] == "3..10"  # too few in the window: all after the 2nd


def test_top_kernels_from_a_chrome_trace(tmp_path):
    """calls are per step, like ms/step: 4 gemm launches over 2 profiled steps are 2 a step."""
    events = [
        *({"ph": "X", "cat": "kernel", "name": "gemm", "dur": d} for d in (300.0, 100.0, 50.0, 50.0)),
        {"ph": "X", "cat": "kernel", "name": "chunk_fwd_o", "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000.0},
    ]
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    top = gpu_profile.top_kernels(gpu_profile.load_trace(str(path)), steps=2)
    assert top == [
        {"kernel": "gemm", "calls/step": 2.0, "ms/step": 0.25, "share %": 500 / 6},
        {"kernel": "chunk_fwd_o", "calls/step": 0.5, "ms/step": 0.05, "share %": 100 / 6},
    ]


def _committed_cut_losses() -> list:
    """The 35b_a3b cut's 20 losses of 2026-11-28 (H200): stopped at its 200 s cap while exiting."""
    path = os.path.join(gpu_results.RESULTS_ROOT, "2026-11-28-h200", "run1_train", "results.json")
    with open(path) as f:
        row = next(r for r in json.load(f)["rows"] if r["case"] == "35b_a3b-cut")
    return [it["lm loss"] for it in row["details"]["per iteration"]]


def test_a_capped_run_is_judged_on_its_completed_iterations():
    losses = _committed_cut_losses()
    assert len(losses) == 20 and losses[0] > 12 and losses[-1] < 0.2
    status, why = gt.training_verdict(losses, 20, 0, True, 200.0)  # bash exits 0 when the cap kills it
    assert status == "pass" and "stopped by its time cap (200 s) after 20 iterations" in why
    assert "did not fall" not in why and "loss 11.37 -> 0.1106" in why
    status, why = gt.training_verdict(losses[:12], 20, 0, True, 200.0)
    assert status == "fail" and why.startswith("stopped by its time cap (200 s) after 12 iterations of 20")
    assert "falling over those" in why
    status, why = gt.training_verdict([5.0] * 8, 20, 0, True, 200.0)
    assert status == "fail" and "not falling over those" in why


def test_an_uncapped_runs_verdict():
    falling = [10.0 - 0.4 * i for i in range(20)]
    assert gt.training_verdict(falling, 20, 0, False, 200.0) == ("pass", "loss 9.6 -> 2.8")
    assert gt.training_verdict([5.0] * 20, 20, 0, False, 200.0)[1] == "loss did not fall: loss 5 -> 5"
    assert gt.training_verdict(falling[:4], 20, 1, False, 200.0)[1].startswith("exit 1 after 4 of 20 iterations")
    assert gt.training_verdict(falling[:4], 20, 0, False, 200.0)[0] == "fail"
    assert gt.training_verdict([*falling[:19], float("nan")], 20, 0, False, 200.0)[0] == "fail"


def test_param_count_equals_the_built_models():
    """Totals of build_model (megatron-core 0.19.2, local backend, TP=1, no MTP) for tiny, counted once
    with sum(p.numel() for p in model.parameters())."""
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    assert gt.param_count(get_variant("tiny", moe=False, mtp=False)) == 3031264
    assert gt.param_count(get_variant("tiny", moe=True, mtp=False)) == 3623648


def test_35b_cut_sizing_and_config(tmp_path):
    from examples.multimodal_dev.models.qwen35_vl.configuration import from_hf_config

    two, four = gt.cut_35b(2), gt.cut_35b(4)
    per_layer = (gt.param_count(four) - gt.param_count(two)) / 2
    assert 0.8e9 < per_layer < 0.9e9  # 256 experts of 3 x 2048 x 512 each, plus the mixer
    assert gt.choose_35b_layers(81559 * 2**20) == 2  # an 80 GB H100
    assert gt.choose_35b_layers(143771 * 2**20) == 4  # an H200
    shape = from_hf_config(gt.write_hf_config(two, str(tmp_path / "config.json")))
    assert shape.text.layer_types == ("linear_attention", "full_attention")
    assert shape.text.num_experts == 256 and shape.text.mtp_num_layers == 0
    assert shape == replace(two)


def test_docs_gpu_table_is_the_newest_committed_results():
    """docs/gpu.md's GPU table is made from the newest committed results folder (meta.json + each run's
    results.json); after a new GPU run: python tests/gpu/gpu_results.py docs."""
    folder = gpu_results.newest_results_folder()
    with open(gpu_results.DOCS_PAGE) as f:
        block = gpu_results.docs_block(f.read())
    assert block == gpu_results.docs_table(folder), (
        "docs/gpu.md's GPU table is stale: python tests/gpu/gpu_results.py docs"
    )
    rows = block.count("\n| run")  # one line per row of every run, after the header
    assert rows >= 1 and os.path.basename(folder) in block


def test_docs_gpu_table_changes_with_the_results(tmp_path):
    """The comparison above can fail: a changed row gives another table."""
    import shutil

    folder = tmp_path / "2099-01-01-gpu"
    shutil.copytree(gpu_results.newest_results_folder(), folder)
    result_file = next(folder.glob("*/results.json"))
    data = json.loads(result_file.read_text())
    data["rows"][0]["status"] = "pass" if data["rows"][0]["status"] != "pass" else "fail"
    result_file.write_text(json.dumps(data))
    assert gpu_results.docs_table(str(folder)) != gpu_results.docs_table(gpu_results.newest_results_folder())
    assert gpu_results.newest_results_folder(str(tmp_path)) == str(folder)


def test_stage_progress_survives_a_stage_that_never_ends(tmp_path, monkeypatch):
    """A check killed by its cap keeps the progress lines already written: the last one names the stage."""
    monkeypatch.setenv("GPU_CHECKS_OUTDIR", str(tmp_path))
    stage = gpu_results.Stages("parity wide-moe fp32")
    with stage("transformers model"):
        pass
    with pytest.raises(KeyboardInterrupt), stage("megatron model"):
        raise KeyboardInterrupt  # what a time cap's kill leaves: no end line
    lines = [line.split(" ", 1)[1] for line in (tmp_path / "progress.log").read_text().splitlines()]
    assert lines[0] == "parity wide-moe fp32: transformers model ..."
    assert lines[1].startswith("parity wide-moe fp32: transformers model done in ") and lines[1].endswith(" s")
    assert lines[2:] == ["parity wide-moe fp32: megatron model ..."]
    monkeypatch.delenv("GPU_CHECKS_OUTDIR")
    gpu_results.progress("nowhere to write: no file, no error")


def test_planner_step_is_the_planners_one_gpu_step_time():
    """The training row's planner figure is what the planner's own step_time says for one GPU, given
    the step's FLOPs as the run measures them (TFLOP/s x iteration time)."""
    from examples.multimodal_dev.planner import layout_cost as cost
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.layout_mix import Row

    hw, rows = cost.HARDWARE["h200"], [Row((900, 1400, 1796), ((1, 32, 48),))]
    planned = cost.step_time(gt.cut_35b(4), cost.Candidate(Layout(gpus=1)), rows, 2, 1.0, hw, 0.5)
    measured_s = 3.473  # any step time: the FLOPs are what the run counted
    steady = {"tflops": planned.parts["flops"] / 1e12 / measured_s, "iter_ms": measured_s * 1000}
    assert gt.planner_step_seconds(steady, hw.peak_tflops) == pytest.approx(planned.total, rel=1e-12)
    assert gt.planner_step_seconds({}, hw.peak_tflops) is None and gt.planner_step_seconds(steady, None) is None


def test_compile_caches_counts_what_a_warm_up_could_reuse(tmp_path, monkeypatch):
    triton, inductor = tmp_path / "triton", tmp_path / "inductor"
    for name in ("k1", "k2", "k3"):
        (triton / name).mkdir(parents=True)
    (inductor / "fxgraph" / "ab").mkdir(parents=True)
    (inductor / "fxgraph" / "ab" / "entry").write_text("x")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    assert gt.compile_caches() == "before the run: 3 entries in Triton's cache, 1 files in Inductor's"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "none"))
    assert gt.compile_caches() == "before the run: 0 entries in Triton's cache, 0 files in Inductor's"


def test_warm_up_work_reads_compiles_and_autotunes_from_the_log():
    log = "\n".join(
        [
            " torch.compile: 9 graphs compiled (9 since the last line) in 14.2 s |",
            "Triton autotuning for function causal_conv1d_fwd_kernel,",
            "with key as (8192, 4, 'torch.bfloat16'),",
            "finished after 6.31s,",
            "best config selected: BT: 64, num_warps: 4;",
            " torch.compile: 11 graphs compiled (2 since the last line) in 15.0 s |",
            "Triton autotuning for function l2norm_fwd_kernel_row finished after 1.50s; best config selected: w: 8;",
        ]
    )
    work = gt.warm_up_work(log)
    assert work == {"compiled graphs": 11, "compile s": 15.0, "autotuned kernels": 2, "autotune s": pytest.approx(7.81)}
    assert gt.warm_up_work("iteration 1/ 20 |") == {}


def test_autotune_row_sums_what_a_group_log_autotuned(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_RESULTS", str(tmp_path / "rows.jsonl"))
    log = tmp_path / "group.log"
    log.write_text(
        "Autotuning kernel chunk_fwd_kernel_h with config BK: 64\n"
        "Triton autotuning for function chunk_fwd_kernel_h,\nwith key as (64, True),\nfinished after 21.50s,\n"
        "Triton autotuning for function l2norm_fwd_kernel finished after 0.75s; best config selected: w: 8;\n"
    )
    row = gpu_results.autotune_row("model parity fp32 tiny", str(log))
    assert row["metrics"] == {"autotuned kernels": 2, "autotune s": 22.25}
    assert row["note"] == "slowest: chunk_fwd_kernel_h 21.5 s, l2norm_fwd_kernel 0.8 s"
    assert gpu_results.read_rows(str(tmp_path / "rows.jsonl")) == [row]
    (tmp_path / "quiet.log").write_text("no autotuning here\n")
    assert gpu_results.autotune_row("fsdp", str(tmp_path / "quiet.log")) is None

"""The benchmark tools at toy sizes: every contender must compute the same thing before its time
means anything (same outputs, gradients and losses), and each tool must run end to end."""

import pytest
import torch

from examples.multimodal_dev.benchmarks import (
    bench_balance,
    bench_checkpoint_formats,
    bench_decode,
    bench_gdn,
    bench_loader,
    bench_packing,
    bench_resume,
    bench_step,
    bench_vision_cp,
)


def test_bench_gdn_kernels_agree_forward_and_backward():
    rows = bench_gdn.run(heads=2, dk=16, dv=8, reps=1)
    assert [(r["input"].split()[0], r["pass"]) for r in rows] == [
        ("unpacked", "forward"),
        ("unpacked", "forward + backward"),
        ("packed", "forward"),
        ("packed", "forward + backward"),
    ]
    for r in rows:
        print(r)
        assert r["max_diff"] < 1e-5 and r["ours_s"] > 0 and r["ref_s"] > 0


def test_bench_packing_packed_and_padded_give_the_same_loss(mcore):
    result = bench_packing.run("tiny", [40, 90, 21], reps=1)
    losses = result["losses"]
    print(losses)
    assert abs(losses["packed (THD)"] - losses["padded (BSHD)"]) < 1e-5 * abs(losses["padded (BSHD)"])
    assert result["tokens"] == {"packed (THD)": 151, "padded (BSHD)": 270}
    assert result["spent_flops"]["packed (THD)"] == result["useful_flops"] < result["spent_flops"]["padded (BSHD)"]


def test_bench_step_contenders_compute_the_same_training_loss(mcore):
    shape = bench_step.bench_shape("tiny", num_layers=4, vocab_size=None, vision_depth=1, moe=True)
    samples = bench_step.mock_samples(shape, 3, mean_text_tokens=24)
    assert sum(len(s["image_grid_thw"]) for s in samples) > 0, "the batch must exercise the vision tower"
    device = torch.device("cpu")
    ours, hf = bench_step.build_pair(shape, device, torch.float32, "sdpa")
    losses = {
        name: run() for name, run in bench_step.contenders(ours, hf, shape, samples, device, torch.float32).items()
    }
    print(losses)
    reference = losses["transformers, padded batch"]
    for name, loss in losses.items():
        assert abs(loss - reference) < 1e-5 * abs(reference), name
    # the step really trained something: every contender left gradients on its model
    assert all(p.grad is not None for p in ours.language_model.parameters() if p.requires_grad)
    assert hf.lm_head.weight.grad is not None


def test_bench_step_shape_overrides():
    shape = bench_step.bench_shape("0.8b", num_layers=5, vocab_size=32768, vision_depth=2)
    assert shape.text.num_layers == 5 and shape.text.layer_types.count("full_attention") == 1
    assert shape.text.vocab_size == 32768 and shape.vision.depth == 2 and shape.text.mtp_num_layers == 0
    assert (
        max(shape.image_token_id, shape.video_token_id, shape.vision_start_token_id, shape.vision_end_token_id) < 32768
    )


def test_bench_packing_realistic_mix_keeps_images(mcore):
    result = bench_packing.run("tiny", None, reps=1, mix="realistic", micro_batch=3)
    losses = result["losses"]
    assert abs(losses["packed (THD)"] - losses["padded (BSHD)"]) < 1e-5 * abs(losses["padded (BSHD)"])
    assert result["tokens"]["packed (THD)"] == sum(result["lengths"])


def test_bench_loader_runs_the_engine_pipeline_with_workers(mcore, capsys):
    rows = bench_loader.main(
        ["--micro-batches", "2", "--workers", "0", "1", "--budget", "512", "--seq-length", "512", "--micro-batch", "2"]
    )
    assert [r["workers"] for r in rows] == [0, 1]
    assert all(r["loader_per_s"] > 0 and r["step_per_s"] > 0 for r in rows)
    assert "| workers | pipeline (conversations/s)" in capsys.readouterr().out


@pytest.mark.parametrize("dataset", ["jsonl", "energon"])
def test_bench_loader_reads_a_written_mix_of_images_and_videos(mcore, capsys, tmp_path, dataset):
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

    processor = build_processor(str(tmp_path / "processor"), chat_template=QWEN35_CHAT_TEMPLATE)
    rows = bench_loader.main(
        [
            "--dataset",
            dataset,
            "--hf-processor-path",
            processor,
            "--mix-conversations",
            "12",
            "--micro-batches",
            "1",
            "--workers",
            "0",
            "--budget",
            "4096",
            "--seq-length",
            "4096",
            "--micro-batch",
            "1",
        ]
    )
    assert [r["workers"] for r in rows] == [0] and rows[0]["loader_per_s"] > 0 and rows[0]["step_per_s"] > 0
    assert f"{dataset}, tiny, packing tokens" in capsys.readouterr().out


def test_bench_balance_summary_skips_start_up_and_reads_the_metrics():
    records = {
        i: {"real_tokens": 900.0 + i, "padded_tokens": 1000.0, "model_flops": 2e12, "dp_imbalance": 1 + i / 100}
        for i in range(1, 6)
    }
    out = bench_balance.summary({"records": records, "seconds": {i: 2.0 for i in range(1, 6)}}, ranks=2)
    assert out["iterations"] == "3..5" and out["step_s"] == 2.0 and out["tokens_per_step"] == 904.0
    assert out["tokens_per_s"] == (903 + 904 + 905) / 6 and out["tflops_per_rank"] == 6e12 / 6 / 2 / 1e12
    assert abs(out["padding"] - (1 - 2712 / 3000)) < 1e-12
    assert (out["imbalance_mean"], out["imbalance_worst"]) == (1.04, 1.05)


def test_bench_resume_restores_the_same_rows_reading_far_fewer_conversations(capsys):
    result = bench_resume.main(["--steps", "12", "--rows", "4", "--budget", "1024"])
    # replaying reads every conversation of steps 0-12; the state only the carried ones and step 12's
    assert result["replay_read"] > 5 * result["restore_read"] > 0
    assert "| the checkpoint's plan state |" in capsys.readouterr().out


def test_bench_vision_cp_splits_the_vision_work(capsys):
    results = bench_vision_cp.main(["--conversations", "120", "--row", "4096", "--cp", "2", "4"])
    # whole images: never below the ideal, well below the unsplit 1.0 (few rows at this toy size)
    assert 0.5 <= results[0]["busiest_share"] < 0.7 and 0.25 <= results[1]["busiest_share"] < 0.6
    assert "| CP | busiest rank's share" in capsys.readouterr().out


def test_bench_checkpoint_formats_reads_the_slowest_ranks_timer():
    """Its runs go through the engine (minutes); what it reads off their logs is checked here:
    megatron's timer line gives (min, max) over ranks, and the last occurrence counts."""
    log = (
        "    save-checkpoint ................................: (1200.50, 1375.25)\n"
        "    model-and-optimizer-setup ......................: (196.37, 201.00)\n"
        "    save-checkpoint ................................: (900.00, 950.75)\n"
    )
    assert bench_checkpoint_formats._timer(log, "save-checkpoint") == 950.75
    assert bench_checkpoint_formats._timer(log, "model-and-optimizer-setup") == 201.0


def test_bench_plan_layout_runs_within_its_budget(capsys):
    from examples.multimodal_dev.benchmarks import bench_plan_layout

    # 2b has no recommended layout, so no meta build: those need a process without a default group
    assert bench_plan_layout.main(["--variants", "2b", "--gpus", "8", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 2b | 8 |" in out and "budget 10 s: within" in out


def test_bench_decode_contenders_choose_the_same_tokens(mcore):
    """Cached decoding and whole-prefix recomputation are greedy on the same weights: the same tokens."""
    result = bench_decode.run("tiny", num_layers=4, vocab_size=8192, prompt_tokens=12, new_tokens=6)
    assert result["same_tokens"] and result["new_tokens"] == 6, result


def test_bench_lora_counts_and_steps(no_process_group):
    """The memory rows come from meta builds with and without adapters (far fewer trainable
    parameters, less gradient and optimizer memory); the step's two contenders start from the
    same loss and train different numbers of parameters."""
    from examples.multimodal_dev.benchmarks import bench_lora
    from examples.multimodal_dev.planner.meta_builds import Layout

    rows = bench_lora.memory("tiny", 4, Layout(tp=2, gpus=2))
    assert rows and all(r["lora"][0] < r["full"][0] / 10 and r["lora"][2] < r["full"][2] for r in rows)
    result = bench_lora.step("tiny", 4, layers=4, samples=2, reps=1)
    full, lora = result["losses"].values()
    assert abs(full - lora) <= 1e-6 * abs(full)
    assert result["trainable"]["LoRA rank 4"] < result["trainable"]["full"] / 10


def test_step_tally_counts_ops_and_syncs_where_they_happen():
    from examples.multimodal_dev.benchmarks.op_counter import StepTally

    tally = StepTally()
    with tally.counting():
        y = torch.arange(6.0) + 1  # arange, add
        y.sum().item()  # sum, and a read of its value
        y.tolist()
        (y > 2).nonzero()  # gt, nonzero (its output size is the host's to know)
        param = torch.nn.Parameter(torch.ones(2))
        param.grad = torch.ones(2)
        torch.optim.AdamW([param], foreach=False).step()  # reads its host-side step counts: ops, no sync
    summary = tally.summary(top=50)
    ops = dict(summary["top_ops"])
    assert ops["arange"] >= 1 and ops["add"] >= 1 and ops["nonzero"] == 1
    kinds = sorted(kind for kind, _, _ in summary["syncs"])
    assert kinds == ["Tensor.tolist", "aten._local_scalar_dense", "aten.nonzero"], summary["syncs"]
    assert all("test_benchmarks.py" in where for _, where, _ in summary["syncs"])  # the asking line is named
    assert summary["steps"] == 1 and summary["ops_per_step"] == sum(tally.ops.values())


def test_a_kernel_stand_in_counts_once_each_way_and_keeps_the_gradients():
    from examples.multimodal_dev.benchmarks.op_counter import StepTally, as_one_kernel

    def run(x, w, b):
        return torch.tanh(x @ w + b).cumsum(0)

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    plain = run(x, w, torch.zeros(2))
    plain.square().sum().backward()
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    tally = StepTally()
    with tally.counting():
        out = as_one_kernel(tally, "fused", run, x, w, torch.zeros(2))
        out.square().sum().backward()
    assert torch.equal(out, plain)
    assert torch.allclose(x.grad, want[0]) and torch.allclose(w.grad, want[1])
    assert tally.ops["fused"] == 1 and tally.ops["fused_backward"] == 1
    assert "tanh" not in tally.ops and "mm" not in tally.ops  # inside the stand-in: uncounted


def test_bench_step_ops_cases_keep_what_sets_the_op_count():
    from examples.multimodal_dev.benchmarks import bench_step_ops

    cut, proxy = bench_step_ops.case_shape("35b_a3b-cut"), bench_step_ops.case_shape("proxy")
    assert (cut.text.num_experts, cut.text.moe_top_k, proxy.text.num_experts, proxy.text.moe_top_k) == (256, 8, 8, 2)
    for shape in (cut, proxy):
        assert shape.text.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert shape.vision.depth == 27 and shape.text.mtp_num_layers == 0
    with pytest.raises(ValueError, match="unknown case"):
        bench_step_ops.case_shape("9b")


def test_step_tally_leaves_out_reads_of_what_stays_on_the_host():
    """A GPU run keeps the grids and the batch's host copies on the host: reads of them, and of what
    is computed from them alone (or beside factory-made tensors, which must then be on the host too),
    stop nothing. Reads of anything else count, and so does a boolean-mask read, whose ``nonzero``
    runs below the dispatcher; a boolean-mask fill with a Python number is ``masked_fill_``."""
    from examples.multimodal_dev.benchmarks.op_counter import StepTally
    from examples.multimodal_dev.models.common.batch_memo import host_side, on_host, to_device

    grid = host_side(torch.tensor([[1, 4, 6], [2, 2, 2]]))
    cu = to_device(torch.tensor([0, 3, 7], dtype=torch.int32), "cpu")
    x, mask = torch.ones(3), torch.tensor([True, False, True])
    tally = StepTally()
    with tally.counting():
        int(grid.prod(-1).sum())
        grid.tolist()
        frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        (torch.arange(4)[:, None] < frames[None, :]).sum().item()
        on_host(cu).tolist()
        x[mask] = 0.0
        cu.tolist()  # the device tensor itself
        x[mask]
        torch.arange(3).tolist()  # made by a factory, read alone: its device is unknown here
    kinds = sorted(kind for kind, _, _ in tally.summary()["syncs"])
    assert kinds == ["Tensor.tolist", "Tensor.tolist", "aten.index"], tally.summary()["syncs"]
    assert on_host(cu) is not cu and torch.equal(on_host(cu), cu)

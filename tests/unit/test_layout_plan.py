"""The layout planner (``planner/layout_plan.py``, ``tools/plan_layout.py``): the recommended
layouts are its choices, memory is refused by the part that is over, the schedule's micro-batches
in flight are megatron's, the step time answers to what it counts, and bad settings are refused in
one line. Weights, gradients and optimizer bytes are held to the meta-device builds in
``test_meta_builds.py``; activations to a CPU run in ``test_activation_memory.py``."""

import os
from types import SimpleNamespace

import pytest

from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS
from examples.multimodal_dev.planner import layout_cost as cost
from examples.multimodal_dev.planner.launch_layout import Layout
from examples.multimodal_dev.planner.layout_mix import Mix
from examples.multimodal_dev.planner.layout_plan import Request, balanced_split, evaluate, plan
from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS, stage_layers
from examples.multimodal_dev.tools import plan_layout as tool

PLANNER_PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "planner.md")


@pytest.fixture(scope="module")
def mixes():
    cache = {}

    def get(name, seq_len=4096):
        if (name, seq_len) not in cache:
            cache[name, seq_len] = Mix.mock_mix(VARIANTS[name], seq_len)
        return cache[name, seq_len]

    return get


def _request(mixes, name, gpus, **kw):
    return Request(
        name,
        VARIANTS[name],
        gpus,
        cost.HARDWARE["h100"],
        mixes(name, kw.pop("seq_len", 4096)),
        kw.pop("global_batch", 512),
        **kw,
    )


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_recommended_layouts_are_the_planners_choice(mixes, variant):
    """``pipeline_layout.LAYOUTS`` (what the meta builds, the docs and the run script use) is the
    planner's best layout at the default count, and docs/planner.md's table is its row: a change
    to the cost model shows up here."""
    result = plan(_request(mixes, variant, LAYOUTS[variant][-1]), keep=1)
    best = result.plans[0]
    assert best.candidate.layout == Layout.recommended(variant), best.candidate.describe()
    with open(PLANNER_PAGE) as f:
        assert tool.table_row(result) in f.read(), "docs/planner.md: rerun tools/plan_layout --docs-table"


def test_a_model_too_big_for_its_gpus_is_refused_by_its_weights(mixes):
    result = plan(_request(mixes, "397b_a17b", 8))
    assert not result.plans and set(result.refused) == {"over memory (weights + gradients + optimizer)"}
    out = tool.describe(result, 0.0)
    assert "no layout fits" in out


def test_activations_over_memory_are_named(mixes):
    """The 9b fits one 80 GB node as weights; 32k-token rows at MBS 4 do not fit as activations."""
    req = _request(mixes, "9b", 8, seq_len=32768, micro_batch=4, global_batch=64, recompute=(None,))
    refused = evaluate(req, cost.Candidate(Layout(tp=1, pp=1, gpus=8), 4)).refused
    assert refused == "over memory (activations)"
    assert evaluate(req, cost.Candidate(Layout(tp=8, pp=1, cp=1, gpus=8), 1)).refused in (
        "",
        "over memory (activations)",
    )


def test_tied_embeddings_with_mtp_are_planned_over_stages(mixes):
    """Their later last stage checkpoints (``test_meta_builds``), so PP > 1 is a candidate for them too;
    its output layer holds no weight of its own (the MTP head's copy of the embeddings serves)."""
    plans = plan(_request(mixes, "2b", 16), keep=200).plans
    assert any(p.candidate.layout.pp > 1 for p in plans)


def test_global_batch_must_split_into_micro_batches(mixes):
    req = _request(mixes, "9b", 8, global_batch=6)
    p = evaluate(req, cost.Candidate(Layout(tp=2, gpus=8), 1))  # DP 4 does not divide 6 rows
    assert p.refused.startswith("GBS 6 is not a multiple of DP x MBS = 4")


@pytest.mark.parametrize("pp,vp,m", [(4, None, 8), (4, None, 2), (8, 4, 32), (4, 2, 3), (2, 3, 12)])
def test_micro_batches_in_flight_are_megatrons_warm_up(pp, vp, m):
    """At its peak a stage holds its warm-up forwards plus the one of the steady state: megatron's
    own count (``get_pp_rank_microbatches``), in chunks of 1/VP of the stage."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    for rank in range(pp):
        comm = SimpleNamespace(
            pp_group=SimpleNamespace(size=lambda: pp, rank=lambda r=rank: r), virtual_pipeline_model_parallel_size=vp
        )
        total, _, warmup, _ = get_pp_rank_microbatches(m, vp or 1, pp, p2p_communicator=comm)
        chunks = min(warmup + 1, total)
        assert cost.in_flight(Layout(pp=pp, vp=vp, gpus=pp), rank, m) == pytest.approx(chunks / (vp or 1))


def test_balanced_split_gives_the_vision_stage_fewer_layers():
    shape = VARIANTS["397b_a17b"]
    first, last = balanced_split(shape, 8, None, vision_layers=2.0, head_layers=4.0)
    assert first < 60 // 8 and last < 60 // 8
    stage_layers(60, 8, None, first, last)  # a split megatron accepts
    assert balanced_split(shape, 4, None, 0.0, 0.0) is None  # 15 layers a stage: nothing to balance
    assert balanced_split(shape, 8, None, 0.0, 0.0)  # 60 do not split evenly over 8: a valid uneven split
    first, last = balanced_split(VARIANTS["35b_a3b"], 2, None, 3.0, 9.0)
    assert first + last == 40 and first > last


def test_step_time_counts_what_it_says(mixes):
    """Compute is the FLOPs at the stated rate; EP traffic appears only with EP; the pipeline
    bubble is (PP - 1) / VP micro-batch times; DP imbalance is 0 with one replica."""
    shape, mix = VARIANTS["35b_a3b"], mixes("35b_a3b")
    rows = [mix.mean_row]
    hw = cost.HARDWARE["h100"]
    one = cost.step_time(shape, cost.Candidate(Layout(gpus=1)), rows, 4, 1.0, hw, 0.5)
    from examples.multimodal_dev.models.qwen35_vl.flops import micro_batch_flops

    flops = micro_batch_flops(shape, rows[0].lengths, rows[0].grids).training * 4
    assert one.compute == pytest.approx(flops / (hw.peak_tflops * 1e12 * 0.5))
    assert one.tp == one.cp == one.ep == one.pp == one.dp == one.imbalance == 0
    ep = cost.step_time(shape, cost.Candidate(Layout(ep=8, gpus=8)), rows, 4, 1.0, hw, 0.5)
    assert ep.ep > 0 and ep.compute == pytest.approx(one.compute)
    piped = cost.step_time(shape, cost.Candidate(Layout(pp=4, vp=2, gpus=4)), rows, 8, 1.0, hw, 0.5)
    per_mb = (piped.compute + piped.tp + piped.cp + piped.ep) / 8 + (piped.pp - piped.parts["bubble"]) / 8
    assert piped.parts["bubble"] == pytest.approx(3 / 2 * per_mb)
    uneven = cost.step_time(shape, cost.Candidate(Layout(gpus=8)), rows, 4, 1.25, hw, 0.5)
    assert uneven.imbalance == pytest.approx(0.25 * (uneven.compute + uneven.tp + uneven.cp + uneven.ep))


def test_mix_imbalance_is_one_for_one_replica_and_small_when_dealt(mixes):
    mix = mixes("9b")
    assert mix.imbalance(1, 8) == 1.0
    assert 1.0 <= mix.imbalance(8, 8) < 1.05  # rows dealt by FLOPs even out
    assert len(mix.rows) > 100 and all(r.tokens <= 4096 for r in mix.rows)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["9b", "--gpus", "12"], "--gpus 12: not a whole number of nodes"),
        (["9b", "--gpus", "0"], "--gpus 0: must be at least 1"),
        (["9b", "--gpus", str(2**32)], f"--gpus {2**32}: at most 1048576"),  # searched for minutes before
        (["9b", "--gpus", "8", "--efficiency", "1.5"], r"--efficiency 1.5: a share of peak"),
        (["9b", "--gpus", "8", "--gpu-memory", "-1"], "--gpu-memory -1.0: must be a positive finite number"),
        (["9b", "--gpu-memory", "nan"], "--gpu-memory nan: must be a positive finite number"),
        (["9b", "--gpu-memory", "inf"], "--gpu-memory inf: must be a positive finite number"),
        (["9b", "--peak-tflops", "nan"], "--peak-tflops nan: must be a positive finite number"),
        (["9b", "--network-gbs", "nan"], "--network-gbs nan: must be a positive finite number"),
        (["9b", "--efficiency", "nan"], "--efficiency nan: a share of peak"),
        (["9b", "--global-batch", str(10**15)], f"--global-batch {10**15}: at most 1048576 rows a step"),
        (["9b", "--layout", "TP=2 TP=4"], "--layout TP=2 TP=4: item 'TP=4': TP is given twice"),
        (["9b", "--layout", "TP=2 GPUS=16"], "GPUS=16 disagrees with --gpus 8; give the count once"),
        (
            ["9b", "--gpus", "1000000", "--brief"],
            "--global-batch 512 is not a multiple of any layout's DP x MBS on "
            "1000000 GPUs; raise --global-batch or lower --gpus",
        ),
        (["nine", "--gpus", "8"], "variant 'nine': expected one of"),
        (["tiny"], "--gpus: needed for tiny"),
        (
            ["9b", "--layout", "TP=3"],
            "--layout TP=3: invalid parallel settings: --tensor-model-parallel-size 3 does not "
            "divide the 16 attention heads; ",
        ),
        (["9b", "--layout", "XP=2"], "--layout XP=2: item 'XP=2': expected KEY=N"),
        (["9b", "--gpus", "8", "--lora-rank", "-2"], "--lora-rank -2: must be 0 (off) or a positive rank"),
        (["9b", "--gpus", "8", "--lora-targets", "in_proj"], "--lora-targets in_proj: needs --lora-rank"),
        (["9b", "--gpus", "8", "--lora-rank", "8", "--lora-targets", "qkv"], "no linear is named qkv"),
    ],
)
def test_bad_settings_are_refused_in_one_line(argv, message):
    with pytest.raises(SystemExit) as exc:
        tool.main(argv)
    text = str(exc.value)
    assert "\n" not in text and message in text, text


def test_the_tool_prints_the_memory_and_time_parts(capsys):
    assert tool.main(["35b_a3b", "--gpus", "16", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n#") == 2 and "weights" in out and "optimizer" in out and "activations" in out
    assert (
        "EP" in out
        and "bubble" in out
        and "\n   run (DP=" in out
        and "run (DP=4): MODEL_VARIANT=35b_a3b TP=2" in out
        and "GBS=512 NPROC=8 sbatch --nodes=2 examples/multimodal_dev/launcher/qwen35_vl.sbatch" in out
    )
    assert tool.main(["35b_a3b", "--brief"]) == 0
    brief = capsys.readouterr().out.strip()
    tp, pp, vp, cp, ep, etp, first, last, gpus = LAYOUTS["35b_a3b"]
    assert brief.startswith(f"TP={tp} PP={pp} CP={cp}") and f"on {gpus} GPUs" in brief and "\n" not in brief


def test_the_mix_of_your_own_jsonl_is_what_its_dataset_describes(tmp_path, capsys):
    """``--data-path``: the conversations' token counts and grids as the training loader reads them
    (``describe``), packed into rows; the plan says whose mix it planned for."""
    import json

    from tiny_processor import build_processor, png_bytes

    from examples.multimodal_dev.data.jsonl import build_datasets

    processor = build_processor(str(tmp_path / "processor"))
    (tmp_path / "cat.png").write_bytes(png_bytes((96, 64), (200, 10, 10)))
    records = [
        {
            "messages": [
                {"role": "user", "content": "<image>" * (i % 3) + "describe " * (5 + 7 * i)},
                {"role": "assistant", "content": "ok " * (3 + i)},
            ],
            "images": ["cat.png"] * (i % 3),
        }
        for i in range(40)
    ]
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    train, _, _ = build_datasets(1024, (40, 0, 0), data_path=str(data), hf_processor_path=processor)
    mix = Mix.from_dataset(VARIANTS["9b"], 1024, train, "mine")
    described = [train.describe(i) for i in range(40)]
    assert sum(r.tokens for r in mix.rows) <= sum(n for n, _ in described)
    from collections import Counter

    assert not Counter(g for r in mix.rows for g in r.grids) - Counter(tuple(g) for _, gs in described for g in gs)
    assert any(r.grids for r in mix.rows) and all(r.tokens <= 1024 for r in mix.rows)

    assert (
        tool.main(
            [
                "9b",
                "--gpus",
                "8",
                "--seq-len",
                "1024",
                "--global-batch",
                "64",
                "--top",
                "1",
                "--data-path",
                str(data),
                "--hf-processor-path",
                processor,
            ]
        )
        == 0
    )
    assert f"from --data-path {data}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="needs --hf-processor-path"):
        tool.main(["9b", "--gpus", "8", "--data-path", str(data)])
    # records training would skip are left out and counted; a file with none usable is refused
    bad = {
        "messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
        "images": ["missing.png"],
    }
    data.write_text("\n".join(json.dumps(r) for r in [bad, records[1], bad]) + "\n")
    train, _, _ = build_datasets(1024, (3, 0, 0), data_path=str(data), hf_processor_path=processor)
    mix = Mix.from_dataset(VARIANTS["9b"], 1024, train, "mine")
    assert mix.name == "mine (1 of 3 conversations; skipped missing_image=2)" and len(mix.rows) == 1
    data.write_text(json.dumps(bad) + "\n")
    with pytest.raises(SystemExit, match=r"none of the 1 conversations read would train \(missing_image=1\)$"):
        tool.main(["9b", "--gpus", "8", "--data-path", str(data), "--hf-processor-path", processor])


def test_a_lora_run_is_planned_with_the_base_frozen(mixes):
    """The same layout of 35b_a3b under LoRA: the weights stay, gradients and optimizer state shrink
    to the adapters'; the step computes no weight gradients (two passes, not three), runs the
    tower without adapters forward only, and moves no base gradients over DP."""
    from examples.multimodal_dev.lora.targets import LoraSettings

    layout = Layout.recommended("35b_a3b")
    cand = cost.Candidate(layout, 1)
    full = evaluate(_request(mixes, "35b_a3b", layout.gpus), cand)
    lora = evaluate(_request(mixes, "35b_a3b", layout.gpus, lora=LoraSettings(16)), cand)
    for a, b in zip(full.memory, lora.memory):
        assert a.weights < b.weights < 1.05 * a.weights  # plus the adapters (3.5 % at rank 16)
        assert b.grads < 0.05 * a.grads and b.optimizer < 0.05 * a.optimizer
    assert lora.memory[0].vision < full.memory[0].vision
    # the busiest stage is the last (no tower): two passes of three
    assert lora.time.parts["busiest_stage"] == full.time.parts["busiest_stage"] == 1
    assert lora.time.compute == pytest.approx(full.time.compute * 2 / 3, rel=1e-12)
    assert lora.time.dp <= full.time.dp
    settings = tool.run_settings(lora, _request(mixes, "35b_a3b", layout.gpus, lora=LoraSettings(16)))
    assert settings.endswith("LORA_RANK=16")


def test_a_chunked_tower_is_planned_with_one_chunk_held(mixes):
    """``--vision-chunk-patches``: the first stage keeps the tower's pixels and one chunk's
    activations, not every patch's, and the step runs the tower's forward once more."""
    layout = Layout.recommended("9b")
    cand = cost.Candidate(layout, 1)
    whole = evaluate(_request(mixes, "9b", layout.gpus), cand)
    chunked = evaluate(_request(mixes, "9b", layout.gpus, vision_chunk_patches=1024), cand)
    assert chunked.memory[0].vision < 0.5 * whole.memory[0].vision
    assert chunked.memory[1].total == whole.memory[1].total  # the other stage holds no tower
    assert chunked.time.compute > whole.time.compute
    request = _request(mixes, "9b", layout.gpus, vision_chunk_patches=1024)
    assert tool.command(chunked, request).endswith("bash run_qwen35_vl.sh --vision-chunk-patches 1024")


def test_the_checkpoint_line_counts_a_lora_save_as_its_adapters_alone():
    """A LoRA save writes the adapters and their optimizer state (14 bytes a parameter: bf16 weight,
    fp32 main copy and two moments), not the frozen base; a full run's, all of it."""
    from examples.multimodal_dev.lora.targets import LoraSettings
    from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS
    from examples.multimodal_dev.planner.launch_layout import Layout
    from examples.multimodal_dev.planner.rank_params import adapter_params, stage_params
    from examples.multimodal_dev.tools.plan_layout import checkpoint_line

    shape, lora = VARIANTS["9b"], LoraSettings(rank=16)
    adapters, whole = adapter_params(shape, Layout(), 0, lora).total, stage_params(shape, Layout(), 0).total
    assert 0 < adapters < whole / 100
    gib = 1024**3
    assert checkpoint_line(shape, lora).startswith(f"checkpoint: {14 * adapters / gib:,.2f} GiB a save: the adapters")
    assert f"the frozen base ({2 * whole / gib:,.1f} GiB)" in checkpoint_line(shape, lora)
    assert (
        checkpoint_line(shape, None)
        == f"checkpoint: {14 * whole / gib:,.1f} GiB a save (weights, fp32 main copy, Adam moments)"
    )

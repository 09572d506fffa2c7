"""The layout planner (``planner/layout_plan.py``, ``tools/plan_layout.py``): the recommended
layouts are its choices, memory is refused by the part that is over, the schedule's micro-batches
in flight are megatron's, the step time answers to what it counts, and bad settings are refused in
one line. Weights, gradients and optimizer bytes are held to the meta-device builds in
``test_meta_builds.py``; activations to a CPU run in ``test_activation_memory.py``."""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS
from examples.multimodal_dev.planner import layout_cost as cost
from examples.multimodal_dev.planner.launch_layout import Layout
from examples.multimodal_dev.planner.layout_mix import Mix
from examples.multimodal_dev.planner.layout_plan import Request, balanced_split, candidates, evaluate, plan
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
        (["9b", "--layout", "PP=2 FSDP=1"], "--layout PP=2 FSDP=1: FSDP=1 with PP=2: its fsdp_dtensor checkpoints"),
        (
            ["9b", "--layout", "FSDP=1", "--lora-rank", "8"],
            "FSDP=1 with --lora-rank 8: LoRA checkpoints are torch_dist",
        ),
        (["9b", "--layout", "FSDP=1", "--vision-chunk-patches", "64"], "FSDP=1 with --vision-chunk-patches 64: "),
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
    lay = Layout.recommended("35b_a3b")
    assert brief.startswith(f"TP={lay.tp} PP={lay.pp} CP={lay.cp}") and f"on {lay.gpus} GPUs" in brief
    assert "\n" not in brief


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


@pytest.fixture(scope="module")
def fsdp_rank(no_process_group):
    """A rank's parameters as megatron-core's Megatron-FSDP groups them, read off a meta-device build
    (in a process whose group, from an earlier test, is put away meanwhile):
    its units are the ``TransformerLayer`` modules (``mcore_fsdp_adapter``'s default for
    ``optim_grads_params``); every other parameter is in no unit. ``(variant, TP, EP)`` -> (units'
    [(numel, bytes)], outside parameters [(numel, bytes)], [(numel, bytes, expert)] of every parameter)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from examples.multimodal_dev.planner import meta_builds as mb

    cache = {}

    def get(variant, tp, ep):
        if (variant, tp, ep) not in cache:
            build = mb.rank_build(
                VARIANTS[variant], Layout(tp=tp, ep=ep, gpus=tp * ep), 0, shards=False, keep_models=True
            )
            modules = [m for model in build.models for m in model.modules()]
            units = [list(m.parameters()) for m in modules if isinstance(m, TransformerLayer)]
            in_units = {id(p) for unit in units for p in unit}
            every = [p for model in build.models for p in model.parameters()]
            cache[variant, tp, ep] = (
                [(sum(p.numel() for p in u), sum(p.numel() * p.dtype.itemsize for p in u)) for u in units],
                [(p.numel(), p.numel() * p.dtype.itemsize) for p in every if id(p) not in in_units],
                [(p.numel(), p.numel() * p.dtype.itemsize, not getattr(p, "allreduce", True)) for p in every],
            )
        return cache[variant, tp, ep]

    return get


@pytest.mark.parametrize(
    "variant,layout",
    [
        ("2b", Layout(tp=2, gpus=8)),  # dense, DP 4
        ("2b", Layout(tp=2, cp=2, gpus=8)),  # DP 2 x CP 2: dense parameters over 4
        ("proxy", Layout(tp=2, ep=2, gpus=8)),  # MoE: dense over DP 4, experts over expert DP 4
        ("proxy", Layout(tp=2, ep=4, gpus=16)),  # experts over expert DP 4, dense over 8
    ],
    ids=lambda v: v if isinstance(v, str) else v.describe(),
)
def test_fsdp_shards_weights_and_gradients_and_holds_one_layer(mixes, fsdp_rank, variant, layout):
    """Under Megatron-FSDP a rank keeps 1/shards of every weight and fp32 gradient (dense over DP x CP,
    experts over expert DP) plus what FSDP gathers whole: two units' bf16 weights (running and
    prefetched), the parameters in no unit (megatron-core keeps those gathered), and one unit's fp32
    gradient or the largest tensor outside a unit's, whichever is larger. Expected from the meta
    build's own parameters, against the distributed optimizer's figures for the same layout."""
    units, outside, every = fsdp_rank(variant, layout.tp, layout.ep)
    shards = [layout.expert_dp if expert else layout.dense_shards for _, _, expert in every]
    held_weights = 2 * max(b for _, b in units) + sum(b for _, b in outside)
    held_grads = 4 * max(max(n for n, _ in units), max(n for n, _ in outside))
    expect_weights = sum(b / s for (_, b, _), s in zip(every, shards)) + held_weights
    expect_grads = sum(4 * n / s for (n, _, _), s in zip(every, shards)) + held_grads

    req = _request(mixes, variant, layout.gpus)
    plain = evaluate(req, cost.Candidate(layout, 1)).memory[0]
    fsdp = evaluate(req, cost.Candidate(replace(layout, fsdp=True), 1)).memory[0]
    assert plain.weights == sum(b for _, b, _ in every) and plain.grads == 4 * sum(n for n, _, _ in every)
    assert fsdp.weights == pytest.approx(expect_weights, rel=1e-12)
    assert fsdp.grads == pytest.approx(expect_grads, rel=1e-12)
    assert fsdp.optimizer == plain.optimizer
    # what it saves: the sharded-away weights and gradients less the gathered copies; small for the
    # proxy, whose embeddings and output layer (in no unit) are most of its parameters
    assert (plain.weights + plain.grads) - (fsdp.weights + fsdp.grads) > 0


def test_fsdp_at_one_shard_saves_nothing_and_holds_its_working_set(mixes, fsdp_rank):
    """TP = GPUs: DP x CP = 1, nothing to shard; FSDP keeps the whole of every weight and gradient and
    its gathered copies on top (the planner therefore offers no such layout)."""
    layout = Layout(tp=2, gpus=2)
    units, outside, _ = fsdp_rank("2b", 2, 1)
    req = _request(mixes, "2b", 2)
    plain = evaluate(req, cost.Candidate(layout, 1)).memory[0]
    fsdp = evaluate(req, cost.Candidate(replace(layout, fsdp=True), 1)).memory[0]
    assert fsdp.weights - plain.weights == 2 * max(b for _, b in units) + sum(b for _, b in outside)
    assert fsdp.grads - plain.grads == 4 * max(max(n for n, _ in units), max(n for n, _ in outside))
    assert fsdp.optimizer == plain.optimizer and fsdp.activations == plain.activations
    assert not any(c.layout.fsdp and c.layout.dense_shards == 1 for c in candidates(req))


def test_fsdp_communicates_on_every_micro_batch(mixes):
    """27b at TP=8 on two nodes: DP=2 runs over the network. The distributed optimizer's reduce-scatter
    and all-gather happen once a step, whatever the micro-batch count; FSDP's all-gathers (forward,
    backward) and reduce-scatter on every micro-batch, so what compute does not hide grows with the
    count, by the same amount a micro-batch: the bytes at the network's rate less the micro-batch's
    forward (1/3) and backward (2/3) time."""
    shape, hw = VARIANTS["27b"], cost.HARDWARE["h100"]
    rows = [mixes("27b").mean_row]
    layout = Layout(tp=8, gpus=16)

    def dp_seconds(lay, m):
        return cost.step_time(shape, cost.Candidate(lay), rows, m, 1.0, hw, 0.5).dp

    plain = [dp_seconds(layout, m) for m in (4, 8, 16)]
    fsdp = [dp_seconds(replace(layout, fsdp=True), m) for m in (4, 8, 16)]
    assert plain[0] == plain[1] == plain[2] > 0
    assert 0 < fsdp[0] < fsdp[1] < fsdp[2]
    assert fsdp[2] - fsdp[1] == pytest.approx(2 * (fsdp[1] - fsdp[0]), rel=1e-9)

    sp, outside = cost.stage_params(shape, layout, 0), cost.fsdp_units(shape, layout, 0).outside
    seconds_a_byte = 1 / 2 / (hw.network_gbs * 1e9)  # a ring over 2 ranks moves half its bytes
    gather = (2 * (sp.dense - outside) + 4 * sp.fp32) * seconds_a_byte
    reduce_scatter = 4 * sp.total * seconds_a_byte
    t = cost.step_time(shape, cost.Candidate(layout), rows, 4, 1.0, hw, 0.5)
    per_mb = (t.compute + t.tp + t.cp + t.ep) / 4
    a_micro_batch = max(0, gather - per_mb / 3) + max(0, gather + reduce_scatter - 2 * per_mb / 3)
    assert (fsdp[1] - fsdp[0]) / 4 == pytest.approx(a_micro_batch, rel=1e-9)


def test_fsdp_is_offered_with_one_stage_and_where_training_runs_it(mixes):
    """Asked for (``--fsdp``), every layout of one pipeline stage with something to shard comes again
    under FSDP; never with PP > 1, for a LoRA run, with a chunked tower, for MoE at EP > 1 (its grouped
    experts save at EP 1 only), or when not asked for."""
    from examples.multimodal_dev.lora.targets import LoraSettings

    req = _request(mixes, "9b", 8, fsdp=True)
    layouts = {c.layout for c in candidates(req)}
    fsdp = {lay for lay in layouts if lay.fsdp}
    assert fsdp and all(lay.pp == 1 for lay in fsdp)
    one_stage = {lay for lay in layouts if lay.pp == 1 and not lay.fsdp and lay.dense_shards > 1}
    assert {replace(lay, fsdp=True) for lay in one_stage} == fsdp
    assert any(lay.pp > 1 for lay in layouts)
    for kw in (dict(lora=LoraSettings(16), fsdp=True), dict(vision_chunk_patches=1024, fsdp=True), dict()):
        assert not any(c.layout.fsdp for c in candidates(_request(mixes, "9b", 8, **kw))), kw
    moe = {c.layout for c in candidates(_request(mixes, "35b_a3b", 16, fsdp=True))}
    assert any(lay.fsdp for lay in moe) and all(lay.ep == 1 for lay in moe if lay.fsdp)


def test_fsdp_fits_the_27b_on_one_node_where_tp1_does_not(mixes, capsys):
    """27b on one node of 8 x H200: at TP=1 without FSDP every rank would hold its 27.8 B parameters'
    bf16 weights and fp32 gradients whole (155 GiB), over the 127 usable; FSDP shards them over
    DP x CP = 8, and its TP=1 layout is the planner's first choice (94.27 s a step, against 101.38 s
    for the best layout without FSDP, TP=2 PP=2 VP=4)."""
    req = replace(_request(mixes, "27b", 8, fsdp=True), hardware=cost.HARDWARE["h200"])
    tp1 = [evaluate(req, c) for c in candidates(req) if c.layout.tp == 1 and c.layout.pp == 1]
    assert {p.refused for p in tp1 if not p.candidate.layout.fsdp} == {"over memory (weights + gradients + optimizer)"}
    assert any(not p.refused for p in tp1 if p.candidate.layout.fsdp)
    best = plan(req, keep=1).plans[0]
    assert best.candidate.layout == Layout(tp=1, cp=2, etp=1, gpus=8, fsdp=True), best.candidate.describe()
    assert "FSDP, DP=4" in best.candidate.describe()
    assert tool.run_settings(best, req) == "TP=1 PP=1 CP=2 FSDP=1 PACKING=tokens SEQ_LEN=4096 GBS=512"
    assert tool.main(["27b", "--gpus", "8", "--gpu", "h200", "--fsdp", "--brief"]) == 0
    assert capsys.readouterr().out.startswith("TP=1 PP=1 CP=2 FSDP=1 ")
    assert tool.main(["27b", "--gpus", "8", "--gpu", "h200", "--brief"]) == 0  # FSDP is asked for
    assert "FSDP" not in capsys.readouterr().out


def test_fsdp_in_a_layout_string_and_its_refusals():
    assert Layout.parse("TP=2 FSDP=1") == Layout(tp=2, fsdp=True)
    assert Layout.parse("TP=2 FSDP=0") == Layout(tp=2)
    assert Layout.parse("TP=2 FSDP=1 GPUS=8").describe() == "TP=2 PP=1 FSDP, DP=4, 8 GPUs"
    with pytest.raises(ValueError, match=r"item 'FSDP=2': expected KEY=N \(.*FSDP 0 or 1\)"):
        Layout.parse("FSDP=2")
    with pytest.raises(ValueError) as err:
        Layout(pp=2, gpus=2, fsdp=True).check(VARIANTS["9b"])
    assert str(err.value).startswith("FSDP=1 with PP=2: ") and "\n" not in str(err.value)

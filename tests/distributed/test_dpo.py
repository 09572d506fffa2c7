"""DPO through ``run_qwen35_vl.sh`` (``TRAIN_MODE=dpo``) on the tiny MoE model, fp32, with LoRA on the
default targets (the routed experts' included) and the base, adapters off, as the reference.

- On a toy preference set (eight pairs, half with an image; the chosen answer names the colour asked
  about) the reward margin rises and the preference accuracy reaches 1 within 20 steps.
- From that run's checkpoint, the first step's loss, margin and accuracy equal the DPO formula computed
  here from transformers' model of the base with the run's adapters exported to ``peft`` (policy) and
  with those adapters disabled (reference), on the same pairs (fp32, 1e-5).
- From the same checkpoint, TP=2 with SP, EP=2, CP=2, PP=2 (interleaved, VP=2) and the tower on a
  rank of its own (VISION_NPROC=1, alone and ahead of PP=2) track the single process (the bounds of
  ``test_parallelism.py``).
- Stopped at step 18 (its saved checkpoint) and resumed, the run gives the straight run's steps 19
  and 20 bitwise.
"""

import os

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from launch import NO_EVAL, run_script, stopped_at
from post_training import dpo_formula, hf_log_prob, pair_samples, write_preferences
from test_parallelism import REL, assert_tracks

from examples.multimodal_dev.tools.convert_checkpoint import main

PAIRS = 8  # every record in every step: each step's loss is the mean over the whole set
COMMON = dict(TRAIN_MODE="dpo", LORA_RANK=4, LORA_ALPHA=8, SEQ_LEN=512, MBS=2, GBS=PAIRS, MOE=1)
TRAINED = dict(TRAIN_ITERS=20, LR=5e-3)


@pytest.fixture(scope="module")
def dpo_base(tmp_path_factory):
    """(the HF base, its import, the processor, the preference records, the data variables)."""
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor, tiny_shape_for

    root = tmp_path_factory.mktemp("dpo")
    hf, imported = root / "hf", root / "imported"
    processor = build_processor(str(hf), chat_template=QWEN35_CHAT_TEMPLATE)
    write_hf_checkpoint(hf, tiny_shape_for(processor, moe=True), dtype=torch.float32)
    assert main(["import", "--hf-path", str(hf), "--megatron-path", str(imported)]) == 0
    pairs = write_preferences(str(root / "data"))
    data = dict(DATASET="jsonl", DATA_PATH=pairs, HF_PROCESSOR_PATH=processor)
    return hf, imported, processor, pairs, data


@pytest.fixture(scope="module")
def dpo_trained(dpo_base, tmp_path_factory):
    """20 DPO steps from the import, saved: (the run, its checkpoint)."""
    _, imported, _, _, data = dpo_base
    path = tmp_path_factory.mktemp("dpo_trained") / "tuned"
    run = run_script(NO_EVAL, CKPT_LOAD=imported, CKPT_SAVE=path, SAVE_INTERVAL=18, **TRAINED, **COMMON, **data)
    return run.check(), path


@pytest.fixture(scope="module")
def dpo_from_trained(dpo_base, dpo_trained):
    """2 DPO steps from the trained checkpoint, one process: the reference of the checks below."""
    return run_script(NO_EVAL, CKPT_LOAD=dpo_trained[1], TRAIN_ITERS=2, **COMMON, **dpo_base[4]).check()


def test_dpo_margin_rises_and_the_pairs_are_learnt_within_20_steps(dpo_trained):
    run, _ = dpo_trained
    margins = {i: r["reward margin"] for i, r in run.records.items()}
    accuracy = {i: r["preference accuracy"] for i, r in run.records.items()}
    print(f"DPO: loss {run.losses[1]:.4f} -> {run.losses[20]:.4f}; margin {margins[1]:.4f} -> {margins[20]:.4f}")
    print(f"DPO: preference accuracy {accuracy[1]} -> {accuracy[20]}")
    # the adapters start at B = 0: the policy is its reference, every pair's loss is log 2
    assert margins[1] == 0 and abs(run.losses[1] - torch.log(torch.tensor(2.0)).item()) < 1e-6
    assert margins[20] > 1.0 and accuracy[20] == 1.0 and run.losses[20] < 0.3
    assert all(margins[i] > margins[1] for i in range(15, 21)), margins
    assert "reward margin" in run.output and "dpo loss" in run.output


def test_dpo_loss_equals_the_formula_on_transformers_and_peft(dpo_base, dpo_trained, dpo_from_trained, tmp_path):
    """The first step from the trained adapters against the DPO formula on transformers' model (fp32):
    the policy is the base with the adapters exported by ``export-peft`` and loaded by ``peft``, the
    reference the same model with them disabled."""
    from peft import PeftModel
    from tiny_processor import tiny_shape_for

    from examples.multimodal_dev.checkpoint.hf_models import hf_classes
    from examples.multimodal_dev.models import model_of

    hf, _, processor, pairs, _ = dpo_base
    adapter = tmp_path / "adapter"
    argv = ["export-peft", "--megatron-path", str(dpo_trained[1]), "--peft-path", str(adapter)]
    assert main([*argv, "--base-model-name-or-path", str(hf)]) == 0
    shape = tiny_shape_for(processor, moe=True)
    hf_class = hf_classes(model_of(shape).shape_to_hf(shape)["model_type"])[1]
    policy_model = PeftModel.from_pretrained(hf_class.from_pretrained(str(hf), dtype=torch.float32), str(adapter))
    samples = [s for pair in pair_samples(pairs, processor) for s in pair]
    policy = [hf_log_prob(policy_model.eval(), shape, s) for s in samples]
    with policy_model.disable_adapter():
        reference = [hf_log_prob(policy_model, shape, s) for s in samples]
    theirs = dpo_formula(policy, reference, beta=0.1)
    ours = {key: dpo_from_trained.records[1][key] for key in theirs}
    print(f"DPO step 1 from the trained adapters: ours {ours}, transformers + peft {theirs}")
    assert theirs["reward margin"] > 0.5  # the adapters moved the policy well away from its reference
    for key, value in theirs.items():
        assert abs(ours[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, ours[key], value)


# PP=2: the reference's activations travel beside the policy's (post_training/reference_pass.py);
# VISION_NPROC=1: the tower's features, sent once, serve both passes (ahead of PP=2: in megatron's
# multi-module dict)
LAYOUTS = {"TP=2 SP": dict(TP=2), "EP=2": dict(EP=2, NPROC=2), "CP=2": dict(CP=2), "PP=2 VP=2": dict(PP=2, VP=2)}
LAYOUTS.update({"VISION_NPROC=1": dict(VISION_NPROC=1), "VISION_NPROC=1 PP=2": dict(VISION_NPROC=1, PP=2)})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_layout_matches_single_process(name, dpo_base, dpo_trained, dpo_from_trained):
    run = run_script(NO_EVAL, CKPT_LOAD=dpo_trained[1], TRAIN_ITERS=2, **COMMON, **dpo_base[4], **LAYOUTS[name])
    assert_tracks(f"DPO {name}", run.check(), dpo_from_trained, 2)
    margin = [r["reward margin"] for r in (run.records[1], dpo_from_trained.records[1])]
    assert abs(margin[0] - margin[1]) <= REL * abs(margin[1]), margin


def test_dpo_resumes_exactly(dpo_base, dpo_trained, tmp_path):
    _, imported, _, _, data = dpo_base
    straight, saved = dpo_trained
    resumed_path = stopped_at(saved, tmp_path / "resumed", 18)
    resumed = run_script(NO_EVAL, CKPT_LOAD=imported, CKPT_RESUME=resumed_path, **TRAINED, **COMMON, **data).check()
    assert sorted(resumed.losses) == [19, 20], sorted(resumed.losses)
    for i in (19, 20):
        assert resumed.records[i]["dpo loss"] == straight.records[i]["dpo loss"], i
        assert resumed.grad_norms[i] == straight.grad_norms[i], i
        assert resumed.records[i]["reward margin"] == straight.records[i]["reward margin"], i

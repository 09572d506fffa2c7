"""DPO's parts without ranks: preference records read into pairs (``data/preferences.py``), the pairs'
log-probabilities and loss (``post_training/dpo.py``) against the formula, the adapters switched off
(``lora/switch.py``), and the settings refused by name in the launcher's and the trainer's words."""

from __future__ import annotations

import json

import pytest
import torch
from post_training import dpo_formula, pair_samples, write_preferences
from test_checked_once import _launcher_says, _trainer_says

from examples.multimodal_dev.data.collate import Collator, pad_row_to
from examples.multimodal_dev.data.sample import DataError
from examples.multimodal_dev.post_training import dpo


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor

    return build_processor(str(tmp_path_factory.mktemp("processor")), chat_template=QWEN35_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def pairs(processor, tmp_path_factory):
    return pair_samples(write_preferences(str(tmp_path_factory.mktemp("pairs"))), processor)


def _tokens(processor):
    from examples.multimodal_dev.data.processor import load_processor

    return load_processor(processor)[1].tokens


def test_dpo_pairs_from_every_format_share_the_prompt_and_train_the_answer_alone(pairs, processor):
    """Chosen and rejected share the prompt's tokens and media; each trains its answer and end of turn
    only (a multi-turn prompt's earlier answers are not counted)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(processor)
    for chosen, rejected in pairs:
        prompt = int(torch.nonzero(chosen["loss_mask"])[0]) + 1  # the first trained position predicts token p+1
        assert torch.equal(chosen["input_ids"][:prompt], rejected["input_ids"][:prompt])
        assert torch.equal(chosen["image_grid_thw"], rejected["image_grid_thw"])
        assert torch.equal(chosen["pixel_values"], rejected["pixel_values"])
        for sample in (chosen, rejected):
            answer = tokenizer.decode(sample["labels"][sample["loss_mask"] > 0])
            assert answer.endswith("<|im_end|>") and answer.count("<|im_end|>") == 1, answer
    assert sum(bool(c["image_grid_thw"].shape[0]) for c, _ in pairs) == 4


def test_dpo_a_multi_turn_prompt_counts_only_the_last_answer(processor, tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": "Say red."},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": "Again."},
        ],
        "chosen": "red",
        "rejected": "blue",
    }
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (chosen, rejected), *_ = pair_samples(str(path), processor)
    assert int(chosen["loss_mask"].sum()) == len("red") + 1 and int(rejected["loss_mask"].sum()) == len("blue") + 1


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"messages": [{"role": "user", "content": "Hi"}], "chosen": "a"}, "not_a_pair: 'rejected' must be"),
        ({"messages": [{"role": "user", "content": "Hi"}], "chosen": "a", "rejected": "a"}, "the same text"),
        (
            {
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "b"}],
                "chosen": "a",
                "rejected": "c",
            },
            "answer_in_prompt",
        ),
        ({"chosen": "a", "rejected": "b"}, "bad_record: expected a 'messages' or 'conversations' list"),
    ],
    ids=["one answer", "same answers", "answer in the prompt", "no prompt"],
)
def test_dpo_a_record_that_is_not_a_pair_is_refused_naming_its_line(processor, tmp_path, record, reason):
    from examples.multimodal_dev.data.jsonl import build_datasets

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(record) + "\n")
    train, _, _ = build_datasets(
        512, (1, 0, 0), data_path=str(path), hf_processor_path=processor, strict_data=True, preference_pairs=True
    )
    with pytest.raises(DataError) as err:
        train[0]
    assert f"{path}:1: " in str(err.value) and reason in str(err.value), str(err.value)


def _collated(pairs, processor, packed: bool = True):
    return Collator(_tokens(processor), packed=packed)(pairs)


@pytest.mark.parametrize("layout", ["thd", "thd padded for dispatch", "bshd"])
def test_dpo_loss_of_packed_pairs_equals_the_formula(pairs, processor, layout):
    """Per-token losses laid on the packed (or padded) pairs give each sample's log-probability, and
    the loss, margin and accuracy the formula gives on them; one rank of a CP group alone counts."""
    batch = _collated(pairs[:3], processor, packed=layout != "bshd")
    if layout == "thd padded for dispatch":  # an extra empty segment, as equalise_for_expert_dispatch adds
        batch = pad_row_to(batch, batch.tokens.shape[1] + 6)
    token_losses = torch.rand(batch.tokens.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    token_losses.requires_grad_(True)
    ref_losses = torch.rand(batch.tokens.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    log_probs = dpo.SequenceLogProbs(batch, None)
    reference = log_probs(ref_losses, batch.loss_mask)

    samples = [s for pair in pairs[:3] for s in pair]
    rows = _sample_rows(batch, len(samples))
    mask = batch.loss_mask.reshape(-1) > 0
    expected = [-float(token_losses.detach().reshape(-1)[row & mask].sum()) for row in rows]
    expected_ref = [-float(ref_losses.reshape(-1)[row & mask].sum()) for row in rows]
    assert torch.allclose(reference, torch.tensor(expected_ref, dtype=reference.dtype))

    loss_sum, count, report = dpo.loss_func(log_probs, reference, 0.3, True, batch.loss_mask, token_losses)
    theirs = dpo_formula(expected, expected_ref, 0.3)
    assert int(count) == 3
    for key, value in theirs.items():
        assert abs(float(report[key][0] / report[key][1]) - value) < 1e-6, (key, report[key], value)
    assert abs(float(loss_sum) / 3 - theirs["dpo loss"]) < 1e-6
    loss_sum.backward()  # the gradient reaches the answers' tokens only
    assert token_losses.grad is not None and bool((token_losses.grad.reshape(-1)[~mask] == 0).all())
    _, count, report = dpo.loss_func(log_probs, reference, 0.3, False, batch.loss_mask, token_losses.detach())
    assert int(count) == 0 and all(not r.any() for r in report.values())


def _sample_rows(batch, n: int) -> list[torch.Tensor]:
    """Each sample's positions in the flattened row(s), from the collate's own layout."""
    if batch.thd:
        bounds = batch.cu_seqlens_padded.tolist()
        positions = torch.arange(batch.tokens.numel())
        return [(positions >= bounds[i]) & (positions < bounds[i + 1]) for i in range(n)]
    width = batch.tokens.shape[1]
    return [(torch.arange(batch.tokens.numel()) // width) == i for i in range(n)]


def test_dpo_reference_is_the_linear_with_its_adapter_off():
    """Inside ``adapters_off`` an adapted linear gives its base's output; outside, the adapter's."""
    from examples.multimodal_dev.lora import switch
    from examples.multimodal_dev.lora.adapter import LoraLinear

    class Base(torch.nn.Module):
        def forward(self, x):
            return 2 * x, None

    class Adapted(LoraLinear, Base):
        def lora_input(self, x):
            return x

        def lora_delta(self, x):
            return x + 1

    x = torch.ones(3)
    assert torch.equal(Adapted()(x)[0], 3 * x + 1)
    with switch.adapters_off():
        with switch.adapters_off():  # nested: off until the outer one ends
            assert torch.equal(Adapted()(x)[0], 2 * x)
        assert torch.equal(Adapted()(x)[0], 2 * x)
    assert switch.adapters_on()


# a DPO run on the user's pairs, as the launcher's environment and as the trainer's flags
PAIRS_ENV = dict(TRAIN_MODE="dpo", DATASET="jsonl", DATA_PATH="/d.jsonl", HF_PROCESSOR_PATH="/p")
PAIRS_ARGV = "--train-mode dpo --dataset-provider jsonl --data-path /d.jsonl --hf-processor-path /p".split()


@pytest.mark.parametrize(
    "environ,argv,world,said",
    [
        (dict(TRAIN_MODE="dpo"), ["--train-mode", "dpo"], 1, "TRAIN_MODE=dpo with DATASET=mock"),
        (
            PAIRS_ENV,
            PAIRS_ARGV,
            1,
            "TRAIN_MODE=dpo with LORA_RANK unset: the reference is the base with the adapters off",
        ),
        (
            dict(PAIRS_ENV, LORA_RANK="4", LORA_TARGETS="linear_qkv,vision.linear_qkv", VISION_NPROC="1"),
            [*PAIRS_ARGV, "--lora-rank", "4", "--lora-targets", "linear_qkv,vision.linear_qkv", "--vision-nproc", "1"],
            2,
            "TRAIN_MODE=dpo with VISION_NPROC=1 and adapters in the vision tower (LORA_TARGETS)",
        ),
        (dict(DPO_BETA="0.2"), ["--dpo-beta", "0.2"], 1, "DPO_BETA=0.2 without TRAIN_MODE=dpo"),
    ],
    ids=["mock data", "no adapters", "adapted tower on its own ranks", "beta alone"],
)
def test_dpo_settings_it_cannot_run_are_refused_by_name(monkeypatch, environ, argv, world, said):
    """The launcher's line, and the trainer's, which starts with it and names the flags."""
    line = _launcher_says({"MODEL_VARIANT": "tiny", **environ})
    assert line.startswith(said), line
    trainer = _trainer_says(argv, world, monkeypatch)
    assert trainer is not None and trainer.startswith(line + " ("), (line, trainer)


def test_dpo_train_mode_is_one_of_the_modes_built():
    line = _launcher_says({"MODEL_VARIANT": "tiny", "TRAIN_MODE": "ppo"})
    assert line.startswith("TRAIN_MODE=ppo") and "sft" in line and "dpo" in line, line

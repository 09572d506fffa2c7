"""``--gen-eval-*`` settings refused before any process group exists, one line naming the flag."""

from types import SimpleNamespace

import pytest

from examples.multimodal_dev.training.gen_eval import check

GOOD = dict(
    gen_eval_interval=10,
    gen_eval_samples=16,
    gen_eval_max_new_tokens=64,
    gen_eval_batch_size=4,
    dataset_provider="jsonl",
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    sequence_parallel=False,
    vision_nproc=0,
    seq_length=4096,
)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(gen_eval_interval=-1), "--gen-eval-interval -1: must be at least 1"),
        (dict(gen_eval_samples=0), "--gen-eval-samples 0: must be at least 1"),
        (dict(gen_eval_batch_size=0), "--gen-eval-batch-size 0: must be at least 1"),
        (
            dict(gen_eval_max_new_tokens=10**9),
            "--gen-eval-max-new-tokens 1000000000: at most --seq-length 4096",
        ),
        (dict(dataset_provider="mock"), "--gen-eval-interval with --dataset-provider mock: evaluation by generation"),
        (
            dict(pipeline_model_parallel_size=2),
            "--gen-eval-interval 10: generation runs with --pipeline-model-parallel-size 1",
        ),
        (dict(context_parallel_size=2), "--gen-eval-interval 10: generation runs with --context-parallel-size 1"),
        (
            dict(vision_nproc=2),
            "--gen-eval-interval 10: generation needs the vision tower on the language model's ranks",
        ),
    ],
)
def test_refused_in_one_line(change, message):
    with pytest.raises(ValueError) as refused:
        check(SimpleNamespace(**{**GOOD, **change}))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_off_and_good_settings_pass():
    check(SimpleNamespace(**GOOD))
    check(SimpleNamespace(**{**GOOD, "sequence_parallel": True}))  # switched off while decoding
    check(SimpleNamespace(**{**GOOD, "gen_eval_interval": 0, "dataset_provider": "mock", "sequence_parallel": True}))


@pytest.mark.parametrize(
    "dest,flag", [("gen_eval_samples", "--gen-eval-samples"), ("gen_eval_batch_size", "--gen-eval-batch-size")]
)
def test_a_setting_without_the_interval_is_refused_not_dropped(dest, flag):
    off = SimpleNamespace(**{**GOOD, "gen_eval_interval": 0})
    with pytest.raises(ValueError, match=f"^{flag} without --gen-eval-interval: evaluation by generation is off"):
        check(off, {dest: flag})
    check(off, {"lr": "--lr"})  # other flags are no business of this check

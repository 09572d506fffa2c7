"""The user's own data through ``bash run_qwen35_vl.sh`` (torchrun, gloo, megatron.training).

- The example JSONL files (images and a video), two blended by weight with a malformed line added
  and the third as the validation set, train a tiny model built around the test's processor: the
  loss falls, the skipped line is named and counted by reason, and validation runs.
- Under token-budget packing at DP=2 with dropout, a run resumed from a straight one's halfway
  checkpoint equals it.
- The same files converted to Megatron-Energon shards train at DP=2, and a stopped and resumed
  run equals a straight one: the loader's position per DP rank comes back from the checkpoint (the
  straight run saves halfway, as a stopped run would, and the resumed run starts from that save).
"""

import dataclasses
import json
import os
import shutil

from launch import ROOT, run_script, stopped_at
from tiny_processor import build_processor

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant, to_hf_config_dict

EXAMPLES = os.path.join(ROOT, "examples", "multimodal_dev", "data", "examples")


def _example_media(folder: str) -> None:
    from tiny_media import write_example_media

    write_example_media(folder)


def _model_for(processor_path: str, out: str) -> str:
    """tiny, with the processor's vision token ids (the model and the processor must agree)."""
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(processor_path).tokenizer
    ids = {
        name: tokenizer.convert_tokens_to_ids(text)
        for name, text in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    shape = dataclasses.replace(get_variant("tiny"), **ids)
    with open(out, "w") as f:
        json.dump(to_hf_config_dict(shape), f)
    return out


def _example_data(tmp_path) -> tuple[str, str, str]:
    """(data folder, processor, model config) for the example files."""
    folder = str(tmp_path / "data")
    shutil.copytree(EXAMPLES, folder)
    _example_media(folder)
    processor = build_processor(str(tmp_path / "processor"))
    return folder, processor, _model_for(processor, str(tmp_path / "config.json"))


def test_own_jsonl_trains_with_counted_skips(tmp_path):
    folder, processor, config = _example_data(tmp_path)
    with open(os.path.join(folder, "sharegpt.jsonl"), "a") as f:
        f.write('{"conversations": [{"from": "human", "value": "unterminated\n')
    data_path = f"{folder}/messages.jsonl:2,{folder}/sharegpt.jsonl:1"
    run = run_script(
        DATASET="jsonl",
        DATA_PATH=data_path,
        VALID_DATA_PATH=f"{folder}/parts.jsonl",
        HF_PROCESSOR_PATH=processor,
        HF_CONFIG=config,
        TRAIN_ITERS=16,
        GBS=4,
        MBS=2,
        SEQ_LEN=1024,
    ).check()
    losses = [run.losses[i] for i in range(1, 17)]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    print(f"jsonl: first-4 mean loss {first:.3f}, last-4 mean {last:.3f}, validation {run.validation}")
    assert last < first - 0.5, losses
    assert 16 in run.validation
    assert "bad_json: " in run.output and "sharegpt.jsonl:11: not a JSON line" in run.output, run.output[-3000:]
    assert "skipped so far in this run (all workers)" in run.output, run.output[-3000:]


def test_own_jsonl_resumes_exactly_under_token_budget_packing(tmp_path):
    """DP=2, rows of 1024 tokens planned from describe() (headers only), shuffled records, dropout 0.1:
    6 iterations straight, saving at step 3, against 3 resumed from that save, bitwise (losses, grad
    norms, validation and the final checkpoint), with the plan continued from the checkpoint."""
    from checkpoint_diff import entries, state_differences

    folder, processor, config = _example_data(tmp_path)
    env = dict(
        DATASET="jsonl",
        DATA_PATH=f"{folder}/messages.jsonl:2,{folder}/sharegpt.jsonl:1",
        VALID_DATA_PATH=f"{folder}/parts.jsonl",
        HF_PROCESSOR_PATH=processor,
        HF_CONFIG=config,
        TRAIN_ITERS=6,
        GBS=4,
        SEQ_LEN=1024,
        PACKING="tokens",
        NPROC=2,
    )
    dropout = ("--hidden-dropout", "0.1")
    straight = run_script(dropout, CKPT_SAVE=tmp_path / "straight", SAVE_INTERVAL=3, **env).check()
    second = run_script(dropout, CKPT_RESUME=stopped_at(tmp_path / "straight", tmp_path / "resumed", 3), **env).check()
    assert sorted(straight.losses) == [1, 2, 3, 4, 5, 6] and sorted(second.losses) == [4, 5, 6]
    assert "token-budget plan: continues at step 3 from" in second.output, second.output[-3000:]
    assert second.losses == {i: straight.losses[i] for i in (4, 5, 6)}
    assert second.grad_norms == {i: straight.grad_norms[i] for i in (4, 5, 6)}
    assert second.validation == straight.validation
    differing = state_differences(
        entries(tmp_path / "straight" / "iter_0000006", tmp_path),
        entries(tmp_path / "resumed" / "iter_0000006", tmp_path),
    )
    assert not differing, differing


def test_energon_shards_train_and_resume_exactly_at_dp2(tmp_path):
    """tools/jsonl_to_energon.py writes the example files as Megatron-Energon shards (media inside,
    a val split held out); DATASET=energon reads them with energon's loader, a part per DP rank, two
    loader workers each, packing rows of 1024 tokens (PACKING=tokens). 8 iterations straight learn and
    save at step 4; 4 resumed from that checkpoint's loader states (packing buffers included) give the
    same losses, grad norms and final checkpoint, bitwise (dropout 0.1)."""
    import subprocess
    import sys

    from checkpoint_diff import entries, state_differences

    folder, processor, config = _example_data(tmp_path)
    converted = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.multimodal_dev.tools.jsonl_to_energon",
            folder,
            str(tmp_path / "shards"),
            "--valid-fraction",
            "0.2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    env = dict(
        DATASET="energon",
        DATA_PATH=tmp_path / "shards",
        HF_PROCESSOR_PATH=processor,
        HF_CONFIG=config,
        TRAIN_ITERS=8,
        GBS=4,
        SEQ_LEN=1024,
        PACKING="tokens",
        NPROC=2,
    )
    flags = ("--hidden-dropout", "0.1", "--num-workers", "2")
    straight = run_script(flags, CKPT_SAVE=tmp_path / "straight", SAVE_INTERVAL=4, **env).check()
    losses = [straight.losses[i] for i in range(1, 9)]
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    print(f"energon: first-2 mean loss {first:.3f}, last-2 mean {last:.3f}, validation {straight.validation}")
    assert last < first - 0.5, losses
    assert 8 in straight.validation

    states = sorted(os.listdir(tmp_path / "straight" / "iter_0000004" / "loader_state"))
    assert states == ["dp00000.json", "dp00001.json"], states
    resumed = run_script(flags, CKPT_RESUME=stopped_at(tmp_path / "straight", tmp_path / "resumed", 4), **env).check()
    state = tmp_path / "resumed" / "iter_0000004" / "loader_state" / "dp00000.json"
    assert f"data loader: DP rank 0 continues from {state}" in resumed.output, resumed.output[-3000:]
    assert "restarts its stream" not in resumed.output, resumed.output[-3000:]  # said by any DP rank
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    assert resumed.tokens == {i: straight.tokens[i] for i in resumed.tokens}
    assert resumed.losses == {i: straight.losses[i] for i in resumed.losses}
    assert resumed.grad_norms == {i: straight.grad_norms[i] for i in resumed.grad_norms}
    differing = state_differences(
        entries(tmp_path / "straight" / "iter_0000008", tmp_path),
        entries(tmp_path / "resumed" / "iter_0000008", tmp_path),
    )
    assert not differing, differing

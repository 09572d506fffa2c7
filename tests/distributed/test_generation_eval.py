"""Evaluation by generation while training (``training/gen_eval.py``) through ``bash run_qwen35_vl.sh``:
two data-parallel ranks answer the example validation conversations every 2 iterations; the scores
are the same on both ranks (the last rank's metrics file, rank 0's answers file), every conversation
is answered once, and the losses and grad norms are those of the run without it, bitwise."""

import json

from launch import run_script
from test_own_data import _example_data

from examples.multimodal_dev.evaluation.scores import Scores


def test_two_ranks_evaluate_by_generation_without_changing_training(tmp_path):
    folder, processor, config = _example_data(tmp_path)
    env = dict(
        DATASET="jsonl",
        DATA_PATH=f"{folder}/messages.jsonl",
        VALID_DATA_PATH=f"{folder}/parts.jsonl",
        HF_PROCESSOR_PATH=processor,
        HF_CONFIG=config,
        TRAIN_ITERS=4,
        GBS=4,
        MBS=2,
        SEQ_LEN=1024,
        NPROC=2,
    )
    flags = ("--eval-interval", "100", "--eval-iters", "1")
    plain = run_script(flags, **env).check()
    hook = ("--gen-eval-interval", "2", "--gen-eval-samples", "3", "--gen-eval-max-new-tokens", "6")
    evaluated = run_script(flags + hook, CKPT_SAVE=tmp_path / "ckpt", SAVE_INTERVAL=4, **env).check()
    print("\n".join(line for line in evaluated.output.splitlines() if "generation eval" in line))
    assert evaluated.losses == plain.losses and evaluated.grad_norms == plain.grad_norms
    assert sorted(evaluated.gen_eval) == [2, 4], evaluated.output[-3000:]
    assert " generation eval at iteration 2 | 3 answers |" in evaluated.output, evaluated.output[-3000:]
    for iteration, logged in evaluated.gen_eval.items():
        lines = (tmp_path / "ckpt" / "gen_eval" / f"iter_{iteration:07d}.jsonl").read_text().splitlines()
        header, answers = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
        assert {k: v for k, v in logged.items() if k in header and k != "iteration"} == {
            k: v for k, v in header.items() if k != "iteration"
        }
        assert set(header) >= {"exact_match", "token_f1", "anls"}
        assert [a["index"] for a in answers] == [0, 1, 2]  # dealt over the two replicas, each once
        assert all(a["reference"] for a in answers)
        rescored = Scores()  # the all-reduced sums are those of exactly the answers written
        for a in answers:
            rescored.add(a["prediction"], a["reference"])
        assert rescored.means() == {k: v for k, v in header.items() if k != "iteration"}

"""Answer prompts with a checkpoint: cached decoding of the training model (``generation/``).

    python -m examples.multimodal_dev.tools.generate --megatron-path CKPT --hf-processor-path HF \\
        --prompt "What is on the receipt?" --image receipt.png
    python -m examples.multimodal_dev.tools.generate --megatron-path CKPT --hf-processor-path HF \\
        --prompts questions.jsonl --output answers.jsonl

``--megatron-path``: a checkpoint of a training run, or a Hugging Face import
(``convert_checkpoint import``), at any layout. ``--prompts``: conversations in any JSONL format the
data path reads (docs/data.md); each is asked for its next assistant turn, and where it ends with an
assistant turn, that turn is the reference answer: the answer is scored against it (exact match,
token F1, ANLS; field F1 and tree accuracy for JSON answers) and the set's scores are printed at the
end. The prompt is the chat template's generation prompt with thinking off, the format training
gave its answers (``data/answer_spans.py``).

Greedy by default; ``--temperature`` above 0 samples (``--top-k``, ``--top-p``, ``--seed``). A row
ends at the end-of-turn or end-of-text token, or after ``--max-new-tokens``. Prompts are answered in
batches of ``--batch-size`` (left-padded; each row's answer is the one it gets alone).

Where it runs (``generation/loading.py``): one process, or TP x EP ranks that it starts through the
launcher's torchrun (``--tensor-model-parallel-size``, ``--expert-model-parallel-size``); a GPU a rank
where CUDA is, in the checkpoint's dtype (``--dtype``), else the host in fp32. Every rank decodes every
prompt and takes rank 0's tokens; rank 0 writes the answers. A user's mistake is one line,
``generate: error: ...``, with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

from examples.multimodal_dev.checkpoint.adapters_only import LORA_BASE_HELP
from examples.multimodal_dev.generation.loading import add_layout_flags, check_layout_fits, layout_of, on_ranks


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-path", required=True, help="checkpoint folder (its latest iteration)")
    parser.add_argument("--hf-config-path", default=None, help="config.json describing the model (else recorded)")
    parser.add_argument("--lora-base", default=None, help=LORA_BASE_HELP)
    parser.add_argument("--hf-processor-path", required=True, help="tokenizer, chat template, image processor")
    asked = parser.add_mutually_exclusive_group(required=True)
    asked.add_argument("--prompts", help="JSONL file of conversations")
    asked.add_argument("--prompt", help="one question (with --image / --video)")
    parser.add_argument("--image", action="append", default=[], help="an image for --prompt (repeatable)")
    parser.add_argument("--video", action="append", default=[], help="a video for --prompt (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-tokens", type=int, default=8192, help="longer prompts are refused")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: every token")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSONL of answers (else printed)")
    parser.add_argument("--with-token-ids", action="store_true", help="each answer's token ids too")
    parser.add_argument("--media-root", default=None, help="where relative media paths start (else the file's folder)")
    parser.add_argument("--allow-media-anywhere", action="store_true", help="records may name media outside it")
    add_layout_flags(parser)
    return parser


def check_args(args) -> None:
    layout_of(args)
    for flag, value in (
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--batch-size", args.batch_size),
    ):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.prompts is not None and (args.image or args.video):
        raise ValueError("--image / --video go with --prompt; a --prompts file names its media in each record")
    # every path before anything loads: the processor alone takes minutes on a slow disk
    from examples.multimodal_dev.data.sources import resolve

    if not os.path.isdir(args.megatron_path):
        raise FileNotFoundError(f"--megatron-path {args.megatron_path}: no such directory")
    resolve(args.hf_processor_path, "--hf-processor-path")
    if args.hf_config_path is not None and not os.path.isfile(args.hf_config_path):
        raise FileNotFoundError(f"--hf-config-path {args.hf_config_path}: no such file")
    if args.media_root is not None and not os.path.isdir(args.media_root):
        raise FileNotFoundError(f"--media-root {args.media_root}: no such directory")
    for flag, path in [("--prompts", args.prompts)] * (args.prompts is not None) + [
        *(("--image", p) for p in args.image),
        *(("--video", p) for p in args.video),
    ]:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path}: no such file")
        # opening the output truncates it: an input named again (a link, another spelling) would be lost
        if args.output is not None and os.path.exists(args.output) and os.path.samefile(args.output, path):
            raise ValueError(f"--output {args.output}: is the {flag} input {path}; name another file for the answers")
    check_layout_fits(layout_of(args), args.megatron_path, args.hf_config_path, args.lora_base)


def _records(args):
    """(record text, where, folder its relative media start from) of every prompt."""
    if args.prompt is not None:
        content = [{"type": "image", "image": os.path.abspath(p)} for p in args.image]
        content += [{"type": "video", "video": os.path.abspath(p)} for p in args.video]
        record = {"messages": [{"role": "user", "content": content + [{"type": "text", "text": args.prompt}]}]}
        return [(json.dumps(record), "--prompt", os.getcwd())]
    lines = []
    with open(args.prompts, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"--prompts {args.prompts}:{n}: not UTF-8 text ({err.reason} at byte {err.start})"
                ) from None
            if line.strip():
                lines.append((line, f"{args.prompts}:{n}"))
    if not lines:
        raise ValueError(f"--prompts {args.prompts}: no records")
    return [(line, where, os.path.dirname(os.path.abspath(args.prompts))) for line, where in lines]


def _fitting_reader(args):
    """The prompt reader of ``--hf-processor-path``, once its processor is found to fit the checkpoint."""
    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.generation.loading import check_processor_fits

    # media named on the command line are the user's own choice; a file's records stay in their folder
    anywhere = args.allow_media_anywhere or args.prompt is not None
    reader = prompt_reader(args.hf_processor_path, args.max_prompt_tokens, args.media_root, False, anywhere)
    check_processor_fits(reader, args.megatron_path, args.hf_config_path, args.hf_processor_path, args.lora_base)
    return reader


def run(args, log=print, answers_to=None) -> list[dict]:
    """Every prompt's answer ({"where", "answer"[, "reference"]}), written to ``--output`` as they come
    (else to ``answers_to``, stdout by default)."""
    import torch

    from examples.multimodal_dev.data.processor import answer_end_ids, answer_text
    from examples.multimodal_dev.evaluation.scores import Scores
    from examples.multimodal_dev.generation.decode import Prompt, Sampling, generate
    from examples.multimodal_dev.generation.loading import load_for_generation

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    records = _records(args)
    reader = _fitting_reader(args)
    model, _, dtype = load_for_generation(
        args.megatron_path, args.hf_config_path, args.lora_base, layout_of(args), args.dtype
    )
    if torch.distributed.get_rank() != 0:  # every rank decodes; rank 0 speaks and writes
        log, answers_to, args.output = (lambda line: None), open(os.devnull, "w"), None
    tokenizer = reader.processor.tokenizer
    end_ids = answer_end_ids(reader.processor, reader.info)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    where = f"{torch.distributed.get_world_size()} rank(s) on {next(model.parameters()).device.type}"
    log(f"generate: {len(records)} prompt(s), batches of {args.batch_size}, {_describe(sampling)}, {where}, {dtype}")
    out, scores, answers = open(args.output, "w") if args.output else None, Scores(), []
    try:
        for first in range(0, len(records), args.batch_size):
            batch = records[first : first + args.batch_size]
            encoded = [reader.prompt_sample(line, base_dir, where) for line, where, base_dir in batch]
            for (sample, _), (_, where, _) in zip(encoded, batch):
                if len(sample["input_ids"]) > args.max_prompt_tokens:
                    raise ValueError(
                        f"{where}: the prompt is {len(sample['input_ids'])} tokens > --max-prompt-tokens "
                        f"{args.max_prompt_tokens}"
                    )
            prompts = [
                Prompt(s["input_ids"].tolist(), **{k: v for k, v in s.items() if k != "input_ids"}) for s, _ in encoded
            ]
            started = time.monotonic()
            done = generate(model, prompts, args.max_new_tokens, end_ids, sampling, pad_id, agree_over_world=True)
            new = sum(map(len, done.tokens))
            log(
                f"generate: prompts {first + 1}-{first + len(batch)} of {len(records)}: {new} tokens in "
                f"{time.monotonic() - started:.1f} s"
            )
            for tokens, (_, reference), (_, where, _) in zip(done.tokens, encoded, batch):
                answer: dict[str, Any] = {"where": where, "answer": answer_text(reader.processor, tokens)}
                if args.with_token_ids:
                    answer["token_ids"] = tokens
                if reference is not None:
                    answer["reference"] = reference
                    scores.add(answer["answer"], reference)
                answers.append(answer)
                print(json.dumps(answer, ensure_ascii=False), file=out or answers_to or sys.stdout, flush=True)
    finally:
        if out is not None:
            out.close()
    if scores.sums["answers"]:
        means = " | ".join(f"{name} {value:.4f}" for name, value in scores.means().items())
        log(f"generate: scores over {int(scores.sums['answers'])} reference answer(s): {means}")
    return answers


def _describe(sampling) -> str:
    if not sampling.temperature:
        return "greedy"
    s = sampling
    return f"sampled (temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}, seed {s.seed})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    from examples.multimodal_dev.data.sample import DataError

    started = on_ranks("generate", "examples.multimodal_dev.tools.generate", args, argv, check_args)
    if started is not None:  # a mistake, or the ranks this process started (rank 0 answers)
        return started

    # stdout carries the answers only (JSONL a script reads): megatron.training gives the root logger a
    # handler to stdout on import unless one is there already, and megatron prints progress.
    logging.basicConfig(stream=sys.stderr)
    answers_to = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            run(args, lambda line: print(line, file=sys.stderr, flush=True), answers_to)
    except (OSError, ValueError, KeyError, DataError) as err:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

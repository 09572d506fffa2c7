"""Serving speed: new tokens per second through ``tools/serve.py`` (HTTP, JSON, each answer's text
followed token by token, the decoding loop) against ``generate`` called directly on the same model, with
the same prompts and limits, so the server's own cost shows.

    python -m examples.multimodal_dev.benchmarks.bench_serve --megatron-path CKPT --hf-processor-path HF \\
        [--concurrency 1 8 --new-tokens 64]

For each concurrency C: C text prompts, sent at once to the server (C threads; the server batches what
has arrived), and decoded directly as one batch of C, each side warmed up at that batch size and then
timed ``--reps`` times taking turns (the median); greedy, at most ``--new-tokens`` each, ending at
the end of turn as the server does. The server runs in a process of its own (one rank, this host's
device); the direct side loads the checkpoint in this process. Prints tokens/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

NAME = "bench"


def _start_server(megatron_path: str, processor: str, new_tokens: int, batch: int):
    argv = [sys.executable, "-m", "examples.multimodal_dev.tools.serve", "--megatron-path", megatron_path]
    argv += ["--hf-processor-path", processor, "--port", "0", "--served-model-name", NAME]
    argv += ["--max-tokens", str(new_tokens), "--max-batch-size", str(batch)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "serve: listening on" in line:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # keep it drained
            return proc, re.search(r"(http://\S+)", line).group(1)
    raise RuntimeError("bench_serve: the server stopped before listening:\n" + "".join(seen[-20:]))


def _ask(url: str, question: str, new_tokens: int) -> int:
    body = {"model": NAME, "messages": [{"role": "user", "content": question}], "max_tokens": new_tokens}
    body.update(temperature=0, return_token_ids=True)
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as answer:
        return len(json.loads(answer.read())["choices"][0]["token_ids"])


def run(
    megatron_path: str, processor: str, concurrency=(1, 8), new_tokens: int = 64, reps: int = 3, progress=False
) -> dict:
    from examples.multimodal_dev.benchmarks.timing import alternating_medians
    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.data.processor import answer_end_ids
    from examples.multimodal_dev.generation.decode import Prompt, generate
    from examples.multimodal_dev.generation.loading import Layout, load_for_generation

    questions = [f"Question {i}: what comes after {i}?" for i in range(max(concurrency))]
    reader = prompt_reader(processor, 8192)
    prompts = []
    for q in questions:
        record = {"messages": [{"role": "user", "content": q}]}
        prompts.append(Prompt(reader.prompt_sample(json.dumps(record), ".", "bench")[0]["input_ids"].tolist()))
    end_ids, pad = answer_end_ids(reader.processor, reader.info), reader.processor.tokenizer.pad_token_id or 0
    model, _, _ = load_for_generation(megatron_path, None, None, Layout())
    proc, url = _start_server(megatron_path, processor, new_tokens, max(concurrency))
    rows = {}
    try:
        for c in concurrency:

            def direct(c=c):
                return sum(map(len, generate(model, prompts[:c], new_tokens, end_ids, pad_id=pad).tokens))

            def served(c=c):
                with ThreadPoolExecutor(c) as pool:
                    return sum(pool.map(lambda q: _ask(url, q, new_tokens), questions[:c]))

            seconds, tokens = alternating_medians({"direct": direct, "served": served}, reps, progress)
            rates = {name: tokens[name] / seconds[name] for name in seconds}
            rows[c] = {
                "direct_tokens_per_s": rates["direct"],
                "served_tokens_per_s": rates["served"],
                "ratio": rates["served"] / rates["direct"],
                "tokens": (tokens["direct"], tokens["served"]),
            }
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-path", required=True)
    parser.add_argument("--hf-processor-path", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed runs of each side, taking turns (median)")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.new_tokens < 1 or args.reps < 1:
        raise SystemExit("bench_serve: --concurrency, --new-tokens and --reps must be at least 1")
    rows = run(args.megatron_path, args.hf_processor_path, args.concurrency, args.new_tokens, args.reps, True)
    for c, row in rows.items():
        print(
            f"{c} concurrent: generate {row['direct_tokens_per_s']:8.1f} tokens/s, server "
            f"{row['served_tokens_per_s']:8.1f} tokens/s, server / generate {row['ratio']:.2f} "
            f"(tokens {row['tokens'][0]} / {row['tokens'][1]})"
        )


if __name__ == "__main__":
    main()

"""Serve a checkpoint as an OpenAI-compatible chat-completions endpoint (``serving/``).

    python -m examples.multimodal_dev.tools.serve --megatron-path CKPT --hf-processor-path HF [--port 8000]

``POST /v1/chat/completions`` answers ``messages`` of text and ``image_url`` parts (``data:`` URLs; http(s)
with ``--allow-remote-media``; a local path never), with ``max_tokens``, ``temperature``, ``top_p``,
``seed``, ``stop`` and ``stream``; ``GET /v1/models`` names the model (``--served-model-name``, the
checkpoint folder's name by default). It listens on 127.0.0.1 unless ``--host`` says otherwise.

The model is the one ``tools/generate.py`` answers with, loaded the same way (``generation/loading.py``):
one process, or TP x EP ranks started through the launcher's torchrun, on GPUs in the checkpoint's
dtype where CUDA is. Rank 0 serves; the other ranks decode every batch with it. Requests that arrive
while a batch decodes are decoded together in the next one (``--max-batch-size``).

Limits, each answered with a 4xx JSON error naming the field while the server goes on:
``--max-request-bytes``, ``--max-tokens`` (the most a request may ask, and its default),
``--max-prompt-tokens``, ``--max-images``, ``--max-image-pixels``, ``--max-queue``; a request that has
not arrived in full within ``--request-timeout`` seconds is answered 408 and its connection closed. A
mistake on the command line is one line, ``serve: error: ...``, status 2.

Stopping: SIGTERM or SIGINT to the PID this command started as (what ``kill``, a supervisor or Ctrl-C
sends) stops every rank. New requests are answered 503; those waiting at once with an error; the batch
in flight may finish within ``--shutdown-timeout`` seconds and is then cut, its requests answered 503.
A second signal cuts it at once. On ranks, the PID is torchrun's, which passes the signal on; a rank
ends whenever its torchrun does (``lifetime.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from examples.multimodal_dev.checkpoint.adapters_only import LORA_BASE_HELP
from examples.multimodal_dev.generation.loading import add_layout_flags, check_layout_fits, layout_of, on_ranks
from examples.multimodal_dev.serving.chat_request import Limits

MODULE = "examples.multimodal_dev.tools.serve"


def _parser() -> argparse.ArgumentParser:
    defaults = Limits()
    parser = argparse.ArgumentParser(prog="serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-path", required=True, help="checkpoint folder (its latest iteration)")
    parser.add_argument("--hf-config-path", default=None, help="config.json describing the model (else recorded)")
    parser.add_argument("--lora-base", default=None, help=LORA_BASE_HELP)
    parser.add_argument("--hf-processor-path", required=True, help="tokenizer, chat template, image processor")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port, printed when listening")
    parser.add_argument("--served-model-name", default=None, help="the model name requests give [the folder's]")
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    parser.add_argument(
        "--batch-wait-ms", type=float, default=10.0, help="after a first request, how long others may join its batch"
    )
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting; more are answered 429")
    parser.add_argument("--max-request-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="the most new tokens asked")
    parser.add_argument("--max-prompt-tokens", type=int, default=8192)
    parser.add_argument("--max-images", type=int, default=defaults.max_images, help="images in one request")
    parser.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels, help="width x height")
    parser.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs")
    parser.add_argument(
        "--request-timeout", type=float, default=30.0, help="seconds a request may take to arrive (408 past it)"
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=5.0, help="seconds the batch in flight may go on once stopped"
    )
    add_layout_flags(parser)
    return parser


def check_args(args) -> None:
    from examples.multimodal_dev.data.sources import resolve

    layout_of(args)
    for flag in ("max_batch_size", "max_queue", "max_request_bytes", "max_tokens", "max_prompt_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    for flag in ("max_images", "max_image_pixels"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 0")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise ValueError(f"--batch-wait-ms {args.batch_wait_ms}: expected 0-10000")
    if not 0 < args.request_timeout <= 3600:
        raise ValueError(f"--request-timeout {args.request_timeout}: expected seconds above 0, at most 3600")
    if not 0 <= args.shutdown_timeout <= 600:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: expected seconds from 0 to 600")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: expected 0-65535")
    if not os.path.isdir(args.megatron_path):
        raise FileNotFoundError(f"--megatron-path {args.megatron_path}: no such directory")
    resolve(args.hf_processor_path, "--hf-processor-path")
    if args.hf_config_path is not None and not os.path.isfile(args.hf_config_path):
        raise FileNotFoundError(f"--hf-config-path {args.hf_config_path}: no such file")
    check_layout_fits(layout_of(args), args.megatron_path, args.hf_config_path, args.lora_base)


def limits_of(args) -> Limits:
    return Limits(
        max_body_bytes=args.max_request_bytes,
        max_tokens=args.max_tokens,
        max_images=args.max_images,
        max_image_pixels=args.max_image_pixels,
        allow_remote_media=args.allow_remote_media,
    )


def serve(args, log) -> None:
    """Load the model on this rank, then serve (rank 0) or follow (the others) until stopped."""
    import torch

    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.data.processor import answer_end_ids, answer_text
    from examples.multimodal_dev.generation.loading import check_processor_fits, load_for_generation
    from examples.multimodal_dev.serving.engine import Engine

    reader = prompt_reader(args.hf_processor_path, args.max_prompt_tokens, None, args.allow_remote_media, False)
    check_processor_fits(reader, args.megatron_path, args.hf_config_path, args.hf_processor_path, args.lora_base)
    model, _, dtype = load_for_generation(
        args.megatron_path, args.hf_config_path, args.lora_base, layout_of(args), args.dtype
    )
    tokenizer = reader.processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    end_ids = answer_end_ids(reader.processor, reader.info)
    decode = lambda tokens: answer_text(reader.processor, tokens)  # noqa: E731
    engine = Engine(model, decode, end_ids, pad_id, args.max_batch_size, args.max_queue, log, args.batch_wait_ms / 1000)
    if not engine.leader:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 ends this loop (None), at the same token
            signal.signal(sig, signal.SIG_IGN)
        engine.run()
        return
    server, http = _start_http(args, engine, reader)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.megatron_path))
    where = f"{torch.distributed.get_world_size()} rank(s) on {next(model.parameters()).device.type}, {dtype}"
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    log(f"serve: listening on http://{host}:{port} (model {name!r}, {where}); Ctrl-C stops it")

    def on_signal(signum, _frame):
        first = not engine.stopping.is_set()  # a second signal cuts the batch in flight at once
        engine.stop(args.shutdown_timeout if first else 0.0)
        if first:
            log(
                f"serve: {signal.Signals(signum).name}: stopping (the batch in flight gets {args.shutdown_timeout:g} s)"
            )

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        engine.run()
    finally:
        server.should_exit = True  # answers already handed over are sent, then the connections close
        http.join(args.shutdown_timeout + 1)
    log("serve: stopped")


def _start_http(args, engine, reader):
    """(uvicorn serving the app, its thread), started (its socket bound) on return."""
    import time

    import uvicorn

    from examples.multimodal_dev.serving.app import Served, build_app
    from examples.multimodal_dev.serving.http_timeout import timed_h11

    name = args.served_model_name or os.path.basename(os.path.normpath(args.megatron_path))
    app = build_app(Served(name, engine, reader, limits_of(args), args.max_prompt_tokens))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=timed_h11(args.request_timeout),
        log_level="warning",
        timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)),
        access_log=False,
    )
    server = uvicorn.Server(config)
    # in a thread of its own uvicorn installs no signal handlers: the main thread's stop the engine (serve)
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise OSError(f"--host {args.host} --port {args.port}: could not listen there (see above)")
        time.sleep(0.05)
    return server, thread


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    started = on_ranks("serve", MODULE, args, argv, check_args)
    if started is not None:  # a mistake, or the ranks this process started (rank 0 answers)
        return started
    from examples.multimodal_dev.data.sample import DataError

    try:
        serve(args, lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, ValueError, KeyError, DataError) as err:
        print(f"serve: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

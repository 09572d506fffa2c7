"""The decoding loop behind the endpoint: requests queued by the HTTP side, decoded in batches on every
rank, their text handed back token by token.

- **Batches**: the loop takes every request waiting (up to ``max_batch``; after the first, those that
  arrive within ``batch_wait_s``) and decodes them together
  (``generation/decode.py``, left-padded, each row with its own sampling, token limit and stop strings).
  A request that arrives while a batch decodes joins the next batch. Each answer is the one the request
  gets alone: rows do not see each other, and a row's draws come from its own seed.
- **Ranks**: rank 0 holds the queue and broadcasts each batch to the other ranks, which decode it too
  (tensor and expert parallelism split the model, not the batch) and take rank 0's tokens. While idle,
  rank 0 sends an empty batch every ``HEARTBEAT_S`` seconds, so the others never wait on a collective
  long enough to time out; ``None`` ends every rank's loop.
- **Stopping**: ``stop(grace_s)`` on rank 0 (its SIGTERM / SIGINT) refuses new requests and answers
  those waiting with an error at once; the batch in flight may finish within ``grace_s``, after which
  it is cut on every rank at the same token (``generate``'s ``abort``) and its requests answered with
  an error too. Then rank 0 sends ``None`` and every rank's loop ends.
- **Text**: every rank follows each row's text (``answer_text.AnswerText``): a stop string ends the row
  on every rank at the same token. Rank 0 hands the text to the request as it grows.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..generation.decode import Prompt, Sampling, generate
from .answer_text import AnswerText

HEARTBEAT_S = 5.0


@dataclass
class Row:
    """What every rank needs of one request to decode it."""

    prompt: Prompt
    sampling: Sampling
    max_tokens: int
    stop: list[str]


@dataclass
class Job:
    """One request waiting for its answer: ``deliver(event)`` is called on the decoding thread with
    ``{"delta": text}`` as the answer grows and ``{"done": ...}`` (or ``{"error": ...}``) once."""

    row: Row
    deliver: Callable[[dict], object]  # called for its effect (what it returns is not read)


class QueueFull(Exception):
    pass


class Stopping(Exception):
    pass


STOPPING = "the server is stopping"


class Engine:
    def __init__(
        self,
        model,
        decode: Callable[[list[int]], str],
        end_ids,
        pad_id: int,
        max_batch: int,
        max_queue: int,
        log=None,
        batch_wait_s: float = 0.0,
    ):
        self.model, self.decode, self.end_ids, self.pad_id = model, decode, list(end_ids), pad_id
        self.log = log or (lambda line: None)
        self.batch_wait_s = batch_wait_s
        self.max_batch = max_batch
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.cut_at = float("inf")  # once stopping: when the batch in flight is cut (time.monotonic)
        self.leader = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise Stopping(STOPPING)
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.waiting.maxsize} requests are waiting already (--max-queue)") from None

    def run(self) -> None:
        """Every rank's loop, until ``stopping`` is set on rank 0."""
        while True:
            jobs = self._next_batch() if self.leader else []
            rows = self._agree([j.row for j in jobs] if not self.stopping.is_set() else None)
            if rows is None:
                while not self.waiting.empty():
                    jobs.append(self.waiting.get_nowait())
                for job in jobs:
                    job.deliver({"error": STOPPING, "status": 503})
                return
            if rows:
                self._decode(rows, jobs)

    def _next_batch(self) -> list[Job]:
        """The requests waiting (after the first, those already there); [] after ``HEARTBEAT_S`` idle
        seconds or once stopping."""
        deadline = time.monotonic() + HEARTBEAT_S
        while not self.stopping.is_set() and time.monotonic() < deadline:
            try:
                jobs = [self.waiting.get(timeout=0.2)]
                break
            except queue.Empty:
                continue
        else:
            return []
        gathered = time.monotonic() + self.batch_wait_s  # requests sent together arrive a moment apart
        while len(jobs) < self.max_batch:
            try:
                jobs.append(self.waiting.get(timeout=max(gathered - time.monotonic(), 0)))
            except queue.Empty:
                break
        return jobs

    def _agree(self, rows: list[Row] | None) -> list[Row] | None:
        """Rank 0's batch on every rank."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return rows
        box = [rows]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def _decode(self, rows: list[Row], jobs: list[Job]) -> None:
        texts = [AnswerText(self.decode, row.stop) for row in rows]
        started = time.monotonic()

        def on_step(b: int, token: int) -> bool:
            delta = texts[b].add(token)
            if delta and jobs:
                jobs[b].deliver({"delta": delta})
            return texts[b].stopped

        try:
            done = generate(
                self.model,
                [r.prompt for r in rows],
                max(r.max_tokens for r in rows),
                self.end_ids,
                [r.sampling for r in rows],
                self.pad_id,
                row_limits=[r.max_tokens for r in rows],
                on_step=on_step,
                agree_over_world=True,
                abort=self._past_grace if self.leader else None,
            )
        except Exception as err:  # the ranks' loop cannot go on in step: every request hears why
            for job in jobs:
                job.deliver({"error": f"decoding failed: {type(err).__name__}: {err}"})
            raise
        if jobs:
            new = sum(map(len, done.tokens))
            self.log(f"serve: a batch of {len(rows)} request(s): {new} tokens in {time.monotonic() - started:.2f} s")
        for b, job in enumerate(jobs):
            if done.ended_by[b] == "abort":
                job.deliver(
                    {"error": f"{STOPPING}; the answer was cut after {len(done.tokens[b])} tokens", "status": 503}
                )
                continue
            rest = texts[b].finish()
            if rest:
                job.deliver({"delta": rest})
            finish = "length" if done.ended_by[b] == "length" else "stop"
            usage = {
                "prompt_tokens": len(rows[b].prompt.input_ids),
                "completion_tokens": len(done.tokens[b]),
                "total_tokens": len(rows[b].prompt.input_ids) + len(done.tokens[b]),
            }
            job.deliver({"done": {"finish_reason": finish, "usage": usage, "token_ids": done.tokens[b]}})

    def _past_grace(self) -> bool:
        return time.monotonic() >= self.cut_at

    def stop(self, grace_s: float = 0.0) -> None:
        """From any thread (a signal handler): no new requests; the batch in flight cut after
        ``grace_s`` seconds (a second call may shorten it)."""
        self.cut_at = min(self.cut_at, time.monotonic() + grace_s)
        self.stopping.set()

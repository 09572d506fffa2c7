"""Generate from the training model: one prefill forward over the left-padded prompts (vision once per
prompt), then one forward a new token, each continuing the attention layers' KV cache and the Gated
DeltaNet layers' states (``context.py``).

Positions continue as transformers' do: the prompt's MRoPE positions from the collate's function,
then, for the i-th new token, ``i + rope_delta`` on all three axes, where ``rope_delta`` makes the first
new token the prompt's largest position plus one.

Across ranks:
- Every rank of a tensor-parallel group runs the same steps. Logits are gathered over its ranks and
  the chosen tokens broadcast from its first rank (sampling on every rank from one seed would agree
  too, but one source of truth costs one small broadcast).
- Sequence parallelism is switched off while decoding (``without_sequence_parallelism``): a step
  has one token a row.
- Under expert parallelism every rank's batch has the same number of rows and the same prompt
  length (megatron's dispatchers gather equal parts): a smaller batch gets rows of one pad token,
  whose tokens are dropped.
- A batch ends for all ranks together. Every rank calls ``generate`` as often, with the same
  ``max_new_tokens``.
- MTP is off while decoding. Context and pipeline parallelism are refused (``check_layout``, and
  the Gated DeltaNet layer's own check).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.inference.utils import InferenceMode

from ..data.batch import VISION_INPUTS
from ..models import model_of
from .context import DecodingContext


@dataclass
class Prompt:
    """One prompt: its token ids (vision placeholders expanded, as the processor leaves them) and the
    pixel values and grids of its images and videos, as the data path produces them."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


@dataclass
class Sampling:
    """Greedy where ``temperature`` is 0; else softmax(logits / temperature) restricted to the ``top_k``
    most likely tokens (0: all) and to the smallest set whose probability reaches ``top_p``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        for flag, value, ok, expected in (
            # inf would divide every logit to 0 or nan: no token could be drawn
            (
                "--temperature",
                self.temperature,
                math.isfinite(self.temperature) and self.temperature >= 0,
                "finite, >= 0",
            ),
            ("--top-k", self.top_k, self.top_k >= 0, ">= 0"),
            ("--top-p", self.top_p, 0 < self.top_p <= 1, "(0, 1]"),
        ):
            if not ok:
                raise ValueError(f"{flag} {value}: expected {expected}")


@dataclass
class Generated:
    tokens: list[list[int]]  # per prompt, the new tokens up to and including an end token
    logits: list[torch.Tensor] = field(default_factory=list)  # per step [B, V] fp32, when kept
    # per prompt, log softmax(logits) of each new token, fp32 (``keep_log_probs``): the model's own
    # probability at temperature 1 of what it drew, whatever the sampling (and its ``banned_ids``), which
    # GRPO's training step recomputes (post_training/grpo.py)
    log_probs: list[list[float]] = field(default_factory=list)
    # per prompt, why it ended: "end" (an end token), "stop" (``on_step`` ended it), "length" (its limit),
    # "abort" (``abort`` ended every row still running)
    ended_by: list[str] = field(default_factory=list)


# ``on_step(row, token)`` is called on every rank for each row's new token, in row order; it returns True
# to end that row there (a stop string). It sees the same tokens on every rank, so ranks agree.
OnStep = Callable[[int, int], bool]


def check_layout(config) -> None:
    """One line for what decoding does not do."""
    if config.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--pipeline-model-parallel-size {config.pipeline_model_parallel_size}: generation runs the "
            "whole decoder on each rank; load the checkpoint with pipeline size 1 (it converts between layouts)"
        )


def choose(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row [B]."""
    if sampling.temperature == 0:
        return logits_BV.argmax(-1)
    scores = logits_BV.float() / sampling.temperature
    if sampling.top_k:
        kth = scores.topk(min(sampling.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)  # mass of the more likely tokens
        ordered = ordered.masked_fill(before >= sampling.top_p, float("-inf"))  # the first always stays
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(scores.softmax(-1).cpu(), 1, generator=generator)[:, 0].to(logits_BV.device)


def choose_rows(logits_BV: torch.Tensor, samplings: Sequence[Sampling], generators: list) -> torch.Tensor:
    """The next token of every row [B], each row by its own sampling and generator: a row draws the same
    tokens whatever rows share its batch."""
    if all(not s.temperature for s in samplings):
        return logits_BV.argmax(-1)
    return torch.cat([choose(logits_BV[b : b + 1], s, g) for b, (s, g) in enumerate(zip(samplings, generators))])


def _cat(parts):
    parts = [p for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def decode_positions(vlm, ids_BL, real_BL, image_grid_thw, video_grid_thw, max_new_tokens: int) -> torch.Tensor:
    """MRoPE positions [3, B, L + max_new_tokens] of left-padded prompts (the collate's, 0 at padding)
    and of the tokens generated after them: the i-th new token of a row is at its prompt's largest
    position + 1 + i on all three axes (transformers' ``cache_position + rope_deltas``)."""
    batch, length = ids_BL.shape
    positions = torch.zeros(3, batch, length + max_new_tokens, dtype=torch.long, device=ids_BL.device)
    positions[:, :, :length] = model_of(vlm.shape).padded_position_ids(
        ids_BL,
        real_BL,
        image_grid_thw,
        video_grid_thw,
        vlm.image_token_id,
        vlm.video_token_id,
        vlm.shape.vision.spatial_merge_size,
    )
    first_new = positions[:, :, :length].amax(dim=(0, 2)) + 1  # [B]
    positions[:, :, length:] = (first_new[:, None] + torch.arange(max_new_tokens, device=ids_BL.device))[None]
    return positions


@torch.no_grad()
def generate(
    model,
    prompts: list[Prompt],
    max_new_tokens: int,
    end_ids=(),
    sampling: Sampling | Sequence[Sampling] | None = None,
    pad_id: int = 0,
    keep_logits: bool = False,
    keep_log_probs: bool = False,
    banned_ids: Sequence[int] = (),
    row_limits: Sequence[int] | None = None,
    on_step: OnStep | None = None,
    agree_over_world: bool = False,
    abort: Callable[[], bool] | None = None,
) -> Generated:
    """New tokens for ``prompts`` (at most ``max_new_tokens`` each; a row ends at a token of
    ``end_ids``). ``model``: the VLM (megatron's wrappers around it are taken off).

    Per row: ``sampling`` (one for all, or one a prompt; each row draws from a generator of its own
    seed), ``row_limits`` (its most new tokens, at most ``max_new_tokens``), ``on_step`` (ends a row
    after a token). ``agree_over_world``: every rank holds the same prompts (a server's followers), and
    takes world rank 0's tokens, not only its tensor-parallel group's first rank's. ``abort()`` true on
    any rank after a token ends every row still running, on every rank at that token (a server that
    stops); it rides on the collective that already asks whether any row goes on. ``keep_log_probs``:
    ``Generated.log_probs``; ``banned_ids``: tokens never drawn (GRPO's answers hold no placeholder)."""
    from megatron.core.utils import unwrap_model

    vlm = unwrap_model(model)
    check_layout(vlm.config)
    asked = len(prompts)
    device, dtype = next(vlm.parameters()).device, next(vlm.parameters()).dtype
    batch, length = _common_shape(vlm, asked, max(len(p.input_ids) for p in prompts), device)
    prompts = list(prompts) + [Prompt([pad_id])] * (batch - asked)  # rows that only keep the shapes equal
    samplings, limits = _per_row(sampling, row_limits, asked, batch, max_new_tokens)
    ids, real = _left_padded(prompts, batch, length, pad_id, device)
    media = {name: _cat([getattr(p, name) for p in prompts]) for name in VISION_INPUTS}
    positions = decode_positions(vlm, ids, real, media["image_grid_thw"], media["video_grid_thw"], max_new_tokens)
    context = DecodingContext(real, max_new_tokens)
    generators = [torch.Generator().manual_seed(s.seed) if s.temperature else None for s in samplings]
    out = Generated(tokens=[[] for _ in range(asked)], ended_by=["length"] * asked)
    drawn = [] if keep_log_probs else None  # per step, [B] log-probabilities of the tokens drawn
    running = torch.arange(batch, device=device) < asked
    end, banned = (torch.tensor(sorted(set(i)), dtype=torch.long, device=device) for i in (end_ids, banned_ids))
    with InferenceMode.active(), without_sequence_parallelism(vlm):
        decoder_input = vlm.embed(ids, **{k: _on(v, device, dtype) for k, v in media.items()})
        step_ids = ids
        for step in range(max_new_tokens):
            span = step_ids.shape[1]
            logits = _last_logits(vlm, step_ids, span, positions, decoder_input, context)
            token = _agreed(choose_rows(_drawable(logits, banned), samplings, generators), vlm, agree_over_world)
            _keep(out, drawn, logits, token, asked, keep_logits)
            running &= ~_record(out, token, running, torch.isin(token, end), limits, on_step)
            if not _goes_on(out, running, asked, step + 1 < max_new_tokens, abort):
                break
            context.sequence_len_offset += span
            context.enable_decode_mode()
            step_ids = token[:, None]
            decoder_input = vlm.embed_words(step_ids)
    out.log_probs = _answer_log_probs(drawn, out.tokens)
    return out


def _keep(out: Generated, drawn: list | None, logits, token, asked: int, keep_logits: bool) -> None:
    """What a step keeps: its logits (``keep_logits``), the drawn tokens' log-probabilities (``drawn``)."""
    if keep_logits:
        out.logits.append(logits[:asked].cpu())
    if drawn is not None:
        drawn.append(logits.log_softmax(-1).gather(1, token[:, None])[:, 0])


def _answer_log_probs(drawn: list | None, tokens: list[list[int]]) -> list[list[float]]:
    """Each row's log-probabilities, as many as its tokens, read back once for the whole answer."""
    if drawn is None:
        return []
    return [row[: len(t)] for row, t in zip(torch.stack(drawn, 1).cpu().tolist(), tokens)]


def _drawable(logits_BV: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """The logits the next token is drawn from: the ``banned`` ids never."""
    return logits_BV.index_fill(1, banned, float("-inf")) if banned.numel() else logits_BV


def _per_row(sampling, row_limits, asked: int, batch: int, max_new_tokens: int) -> tuple[list[Sampling], list[int]]:
    """Every row's sampling and token limit, the ``batch - asked`` rows of padding greedy to the end."""
    samplings = list(sampling) if isinstance(sampling, Sequence) else [sampling or Sampling()] * asked
    limits = list(row_limits) if row_limits is not None else [max_new_tokens] * asked
    if len(samplings) != asked or len(limits) != asked or max(limits, default=0) > max_new_tokens:
        raise ValueError(f"generate: {asked} prompts, {len(samplings)} samplings, row limits {limits}")
    padding = batch - asked
    return samplings + [Sampling()] * padding, limits + [max_new_tokens] * padding


def _record(out: Generated, token, running, ended, limits, on_step: OnStep | None) -> torch.Tensor:
    """Each running row's new token kept; the rows that end with it [B] (an end token, ``on_step``'s
    stop, the row's limit)."""
    for b in running.nonzero().flatten().tolist():
        out.tokens[b].append(int(token[b]))
        if bool(ended[b]):
            out.ended_by[b] = "end"
        elif on_step is not None and on_step(b, int(token[b])):
            out.ended_by[b], ended[b] = "stop", True
        elif len(out.tokens[b]) >= limits[b]:
            ended[b] = True
    return ended


def _on(tensor: torch.Tensor | None, device, dtype) -> torch.Tensor | None:
    """A media tensor on the model's device, pixels in the model's dtype (a bf16 tower takes bf16)."""
    if tensor is None:
        return None
    return tensor.to(device, dtype=dtype) if tensor.is_floating_point() else tensor.to(device)


def _left_padded(
    prompts: list[Prompt], batch: int, length: int, pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], real [B, L]) of the prompts padded on the left: every row's next token at the same
    position."""
    ids = torch.full((batch, length), pad_id, dtype=torch.long, device=device)
    real = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for b, prompt in enumerate(prompts):
        ids[b, length - len(prompt.input_ids) :] = torch.tensor(prompt.input_ids, device=device)
        real[b, length - len(prompt.input_ids) :] = True
    return ids, real


def _last_logits(vlm, step_ids, span: int, positions, decoder_input, context: DecodingContext) -> torch.Tensor:
    """fp32 logits [B, V] of each row's last token, continuing the cache of the steps before (``span``
    new tokens a row)."""
    return vlm.language_model(
        input_ids=step_ids,
        position_ids=positions[:, :, : context.sequence_len_offset + span],
        attention_mask=context.attention_mask(span),
        decoder_input=decoder_input,
        inference_context=context,
        runtime_gather_output=True,
    )[:, -1].float()


@contextlib.contextmanager
def without_sequence_parallelism(model):
    """Sequence parallelism off for the duration: a decoding step has one token a row, nothing to split
    over tensor-parallel ranks. megatron's modules read it at run time from their configs and their own
    ``sequence_parallel`` (linears) / ``reduce_scatter_embeddings`` (the embedding) flags; every one that
    is on is turned off, and back on after. The weights are the same either way."""
    switched = []
    for module in model.modules():
        for owner, name in ((module, "sequence_parallel"), (module, "reduce_scatter_embeddings")):
            if getattr(owner, name, None) is True:
                switched.append((owner, name))
        config = getattr(module, "config", None)
        if getattr(config, "sequence_parallel", None) is True and not any(o is config for o, _ in switched):
            switched.append((config, "sequence_parallel"))
    for owner, name in switched:
        setattr(owner, name, False)
    try:
        yield
    finally:
        for owner, name in switched:
            setattr(owner, name, True)


def _common_shape(vlm, rows: int, length: int, device) -> tuple[int, int]:
    """(rows, prompt length) of this rank's batch. Under expert parallelism megatron's token dispatchers
    gather every rank's tokens in equal parts: every rank then pads to the largest batch of any."""
    if vlm.config.expert_model_parallel_size == 1:
        return rows, length
    shape = torch.tensor([rows, length], device=device)
    torch.distributed.all_reduce(shape, op=torch.distributed.ReduceOp.MAX)
    return int(shape[0]), int(shape[1])


def _agreed(token: torch.Tensor, vlm, over_world: bool = False) -> torch.Tensor:
    """Tensor-parallel rank 0's choice, on every rank of its group (``over_world``: world rank 0's, on
    every rank)."""
    if over_world:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast(token, 0)
        return token
    group = getattr(vlm.pg_collection, "tp", None)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return token
    torch.distributed.broadcast(token, torch.distributed.get_global_rank(group, 0), group=group)
    return token


def _goes_on(out: Generated, running: torch.Tensor, asked: int, more: bool, abort) -> bool:
    """Whether decoding takes another step on every rank; rows still running when any rank's
    ``abort()`` is true end as "abort"."""
    going_on, aborted = _any_running(running, more, abort is not None and abort())
    if aborted:
        for b in running[:asked].nonzero().flatten().tolist():
            out.ended_by[b] = "abort"
    return going_on


def _any_running(running: torch.Tensor, more: bool, abort: bool) -> tuple[bool, bool]:
    """(whether any row of any rank goes on, whether any rank aborts): ranks that share experts step
    together even where their own prompts have all ended, and stop together where one aborts."""
    flags = torch.tensor([int(more and bool(running.any())), int(abort)], device=running.device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    going_on, aborted = flags.tolist()
    return bool(going_on) and not aborted, bool(aborted)

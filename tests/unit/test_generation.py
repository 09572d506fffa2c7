"""Generation (``generation/decode.py``) against transformers' ``generate`` on the same weights (our
HF import), and against the model's own full forward: cached decoding must be the same function of
the tokens as recomputing the whole prefix. fp32, tiny random models, dense and MoE."""

import pytest
import torch
from hf_reference import build_hf_model, image_tokens, megatron_position_ids, pixel_values_for

from examples.multimodal_dev.generation.decode import Prompt, Sampling, choose, decode_positions, generate
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.models.qwen35_vl.hf_mapping import load_hf_into_model

LOGIT_TOL = 1e-4  # per step, relative to the largest reference logit (the bound)


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request, mcore):
    shape = get_variant("tiny", moe=request.param == "moe")
    hf = build_hf_model(shape)
    mg = build_model(shape).eval()
    load_hf_into_model(mg, hf.state_dict(), shape)
    return request.param, shape, hf, mg


def _image_prompt(shape, seed=1):
    grids = [(1, 4, 6), (1, 2, 8)]
    ids = [5, 6] + image_tokens(shape, 4, 6) + [7, 8, 9] + image_tokens(shape, 2, 8) + [10, 11]
    pixels = pixel_values_for(shape, grids, torch.Generator().manual_seed(seed))
    return Prompt(ids, pixels, torch.tensor(grids))


def _video_prompt(shape, seed=2):
    """A two-frame video as Qwen3.5 lays it out: a timestamp and a start/end pair per frame."""
    merged = (4 // shape.vision.spatial_merge_size) ** 2
    frame = [shape.vision_start_token_id] + [shape.video_token_id] * merged + [shape.vision_end_token_id]
    ids = [5, 6] + [30, 31] + frame + [32, 33] + frame + [7, 8]
    pixels = pixel_values_for(shape, [(2, 4, 4)], torch.Generator().manual_seed(seed))
    return Prompt(ids, pixel_values_videos=pixels, video_grid_thw=torch.tensor([(2, 4, 4)]))


PROMPTS = {"text": lambda shape: Prompt([5, 6, 7, 8, 9, 10]), "two images": _image_prompt, "video": _video_prompt}


def _close(name, ours, ref):
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    print(f"{name}: max abs diff {diff:.2e} (reference max {scale:.2f})")
    assert diff <= LOGIT_TOL * max(scale, 1.0), f"{name}: {diff:.2e}"


def test_each_step_equals_a_full_forward_over_the_prefix(pair):
    """The logits of every cached step equal those of one forward over prompt + tokens so far."""
    kind, shape, _, mg = pair
    prompt = _image_prompt(shape)
    done = generate(mg, [prompt], max_new_tokens=6, keep_logits=True)
    tokens = torch.tensor([prompt.input_ids + done.tokens[0]])
    mask = torch.ones_like(tokens)
    with torch.no_grad():
        full = mg(
            tokens,
            megatron_position_ids(shape, tokens, mask, prompt.image_grid_thw),
            None,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw,
        )[0]
    start = len(prompt.input_ids) - 1
    _close(f"{kind} cached vs full", torch.stack([s[0] for s in done.logits]), full[start : start + 6])


@pytest.mark.parametrize("what", PROMPTS)
def test_greedy_tokens_equal_transformers_generate(pair, what):
    """32 new tokens, no end token (the length is fixed): the same tokens, each step's logits close.
    transformers continues the MRoPE positions by its rope delta: equal tokens and logits over 32 steps
    say our positions continue as its do, with images, a video and neither."""
    kind, shape, hf, mg = pair
    prompt = PROMPTS[what](shape)
    ids = torch.tensor([prompt.input_ids])
    media_type = (ids == shape.image_token_id).long() + 2 * (ids == shape.video_token_id).long()
    media = {k: getattr(prompt, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    ref = hf.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=media_type,
        **{k: v for k, v in media.items() if v is not None},
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ours = generate(mg, [prompt], max_new_tokens=32, keep_logits=True)
    print(f"{kind} {what}: {len(set(ours.tokens[0]))} distinct tokens of 32")
    assert ours.tokens[0] == ref.sequences[0, ids.shape[1] :].tolist()
    _close(f"{kind} {what} logits vs transformers", torch.stack([s[0] for s in ours.logits]), torch.cat(ref.logits))


def test_a_batch_of_unequal_prompts_equals_each_alone(pair):
    kind, shape, _, mg = pair
    prompts = [
        _image_prompt(shape),
        Prompt([3, 4, 5]),
        Prompt([9] + image_tokens(shape, 2, 4) + [10], pixel_values_for(shape, [(1, 2, 4)]), torch.tensor([(1, 2, 4)])),
    ]
    batched = generate(mg, prompts, max_new_tokens=8, keep_logits=True)
    for b, prompt in enumerate(prompts):
        alone = generate(mg, [prompt], max_new_tokens=8, keep_logits=True)
        assert batched.tokens[b] == alone.tokens[0]
        _close(
            f"{kind} row {b} batched vs alone",
            torch.stack([s[b] for s in batched.logits]),
            torch.stack([s[0] for s in alone.logits]),
        )


def test_a_row_ends_at_its_end_token_and_the_others_go_on(pair):
    kind, shape, _, mg = pair
    prompts = [_image_prompt(shape), Prompt([3, 4, 5])]
    free = generate(mg, prompts, max_new_tokens=6)
    end = free.tokens[0][2]  # row 0's third token: it stops there, row 1 unless it meets it too
    ended = generate(mg, prompts, max_new_tokens=6, end_ids=[end])
    assert ended.tokens[0] == free.tokens[0][:3]
    cut = free.tokens[1].index(end) + 1 if end in free.tokens[1] else 6
    assert ended.tokens[1] == free.tokens[1][:cut]


def test_abort_cuts_every_running_row_at_the_same_token(pair):
    """A stopping server's cut: rows still running end with ``abort``'s first true, their tokens so
    far the uncut run's; a row that ended before keeps its own reason."""
    kind, shape, _, mg = pair
    prompts = [_image_prompt(shape), Prompt([3, 4, 5])]
    free = generate(mg, prompts, max_new_tokens=6)
    asked = []
    cut = generate(mg, prompts, max_new_tokens=6, row_limits=[2, 6], abort=lambda: asked.append(1) or len(asked) >= 4)
    assert cut.tokens == [free.tokens[0][:2], free.tokens[1][:4]]
    assert cut.ended_by == ["length", "abort"]


def test_a_stopping_engine_answers_the_waiting_and_the_cut_with_503(pair):
    from examples.multimodal_dev.serving.engine import STOPPING, Engine, Job, Row, Stopping

    kind, shape, _, mg = pair
    engine = Engine(mg, lambda ids: "x" * len(ids), [], 0, max_batch=1, max_queue=4)
    heard: list[list[dict]] = [[], []]
    jobs = [Job(Row(Prompt([3, 4, 5]), Sampling(), 50, []), heard[i].append) for i in range(2)]
    for job in jobs:
        engine.submit(job)
    first = jobs[0].deliver
    # the first answer's third token stops the server, with no grace: its batch is cut there
    jobs[0].deliver = lambda event: (first(event), len(heard[0]) == 3 and engine.stop(0.0))
    engine.run()
    deltas = [e for e in heard[0] if "delta" in e]
    assert len(deltas) == 3 and heard[0][-1]["status"] == 503 and "cut after 3 tokens" in heard[0][-1]["error"]
    assert heard[1] == [{"error": STOPPING, "status": 503}]
    with pytest.raises(Stopping):
        engine.submit(jobs[0])


def test_sampling_keeps_to_top_k_and_top_p_and_repeats_with_its_seed():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    draw = lambda sampling: choose(logits, sampling, torch.Generator().manual_seed(sampling.seed))  # noqa: E731
    assert set(draw(Sampling(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    # probabilities 0.64, 0.24, 0.09, ...: top_p 0.8 keeps the two that first reach it
    assert set(draw(Sampling(temperature=1.0, top_p=0.8)).tolist()) == {0, 1}
    assert set(draw(Sampling(temperature=1.0)).tolist()) >= {0, 1, 2}
    assert torch.equal(draw(Sampling(temperature=0.7, seed=3)), draw(Sampling(temperature=0.7, seed=3)))
    assert torch.equal(draw(Sampling()), torch.zeros(200, dtype=torch.long))  # greedy
    with pytest.raises(ValueError, match=r"--top-p 0: expected \(0, 1\]"):
        Sampling(temperature=1.0, top_p=0)


def test_decode_positions_continue_as_transformers(pair):
    """A left-padded batch with no image, one, two and a video: the prompts' positions and those of 8
    new tokens equal transformers' (``get_rope_index``, then ``cache_position + rope_deltas`` over the
    real tokens, as its generate computes them)."""
    _, shape, hf, mg = pair
    prompts = [
        PROMPTS["text"](shape),
        Prompt([9] + image_tokens(shape, 2, 4) + [10], image_grid_thw=torch.tensor([(1, 2, 4)])),
        _image_prompt(shape),
        _video_prompt(shape),
    ]
    length, new = max(len(p.input_ids) for p in prompts), 8
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    real = torch.zeros_like(ids, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, length - len(p.input_ids) :], real[b, length - len(p.input_ids) :] = torch.tensor(p.input_ids), True
    image_grids = torch.cat([p.image_grid_thw for p in prompts if p.image_grid_thw is not None])
    video_grids = torch.cat([p.video_grid_thw for p in prompts if p.video_grid_thw is not None])
    ours = decode_positions(mg, ids, real, image_grids, video_grids, new)
    media_type = (ids == shape.image_token_id).long() + 2 * (ids == shape.video_token_id).long()
    theirs, deltas = hf.model.get_rope_index(ids, media_type, image_grids, video_grids.clone(), real.long())
    assert torch.equal(ours[:, :, :length][:, real], theirs[:, real])
    cache_position = real.sum(1, keepdim=True) + torch.arange(new)  # the real tokens before each new one
    assert torch.equal(ours[:, :, length:], (cache_position + deltas.view(-1, 1)).unsqueeze(0).expand(3, -1, -1))

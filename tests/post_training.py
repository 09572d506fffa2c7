"""A toy preference set, the model it trains and the DPO loss computed from transformers (and peft) on
the same weights and pairs: shared by the DPO tests (tests/distributed/test_dpo.py, tests/unit); and
GRPO's toy prompts (tests/distributed/test_grpo.py)."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

# (prompt, chosen, rejected, image colour or None): the chosen answer names the colour it is asked
# about; about half the prompts hold an image, so the pairs carry pixels and MRoPE grids
COLOURS = (("red", (220, 20, 20)), ("green", (20, 200, 40)), ("blue", (30, 40, 230)), ("black", (5, 5, 5)))


def preference_records(folder: str) -> list[dict]:
    """Eight preference records in the three formats of docs/data.md, images written beside them."""
    from tiny_processor import png_bytes

    records = []
    for i, (name, rgb) in enumerate(COLOURS):
        wrong = COLOURS[(i + 1) % len(COLOURS)][0]
        image = f"square_{name}.png"
        with open(os.path.join(folder, image), "wb") as f:
            f.write(png_bytes((32, 48), rgb))
        records.append(
            {
                "messages": [{"role": "user", "content": "<image>Which colour is it?"}],
                "images": [image],
                "chosen": name,
                "rejected": wrong,
            }
        )
        records.append(
            {"conversations": [{"from": "human", "value": f"Say {name}."}], "chosen": name, "rejected": wrong}
        )
    records[-1] = {  # the parts format, with a system turn
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Say black."}]},
        ],
        "chosen": "black",
        "rejected": "red",
    }
    return records


def write_preferences(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "pairs.jsonl")
    with open(path, "w") as f:
        for record in preference_records(folder):
            f.write(json.dumps(record) + "\n")
    return path


def pair_samples(path: str, processor: str, seq_length: int = 512) -> list[tuple[dict, dict]]:
    """Every record of ``path`` as the training reads it: (chosen sample, rejected sample)."""
    from examples.multimodal_dev.data.jsonl import build_datasets

    lines = sum(1 for _ in open(path))
    train, _, _ = build_datasets(
        seq_length, (lines, 0, 0), data_path=path, hf_processor_path=processor, no_shuffle=True, preference_pairs=True
    )
    return [train[i] for i in range(lines)]


def hf_log_prob(model, shape, sample: dict) -> float:
    """``log p(answer | prompt)`` of one contract sample under a transformers model (fp32): the sum of
    the log-probabilities of its trained labels."""
    from hf_reference import hf_forward

    ids = sample["input_ids"].unsqueeze(0)
    grids = sample["image_grid_thw"] if sample["image_grid_thw"].shape[0] else None
    pixels = sample["pixel_values"] if grids is not None else None
    logits = hf_forward(model, shape, ids, torch.ones_like(ids), pixels, grids)[0].double()
    trained = sample["loss_mask"] > 0
    log_probs = F.log_softmax(logits, -1).gather(-1, sample["labels"].clamp(min=0).unsqueeze(-1))[:, 0]
    return float(log_probs[trained].sum())


def dpo_formula(policy: list[float], reference: list[float], beta: float) -> dict[str, float]:
    """The DPO loss, reward margin and preference accuracy (means over the pairs) from the log-probabilities
    [chosen, rejected] of each pair under the policy and the reference."""
    z = [
        beta * ((pc - rc) - (pr - rr))
        for (pc, pr), (rc, rr) in zip(zip(policy[0::2], policy[1::2]), zip(reference[0::2], reference[1::2]))
    ]
    zt = torch.tensor(z, dtype=torch.float64)
    return {
        "dpo loss": float(-F.logsigmoid(zt).mean()),
        "reward margin": float(zt.mean()),
        "preference accuracy": float((zt > 0).double().mean()),
    }


def grpo_records(folder: str) -> list[dict]:
    """Eight prompts in the three formats of docs/data.md, half with an image, each asking for the digit
    seven (the reference): a task a random model's answer solves by chance once in ~the vocabulary."""
    from tiny_processor import png_bytes

    records = []
    for i, (name, rgb) in enumerate(COLOURS):
        image = f"square_{name}.png"
        with open(os.path.join(folder, image), "wb") as f:
            f.write(png_bytes((32, 48), rgb))
        question = f"How many sides has the {name} heptagon?"
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"<image>{question}"},
                    {"role": "assistant", "content": "7"},
                ],
                "images": [image],
            }
        )
        records.append({"conversations": [{"from": "human", "value": f"Say 7 ({i})."}, {"from": "gpt", "value": "7"}]})
    records[-1] = {  # the parts format, with a system turn
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Three plus four?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "7"}]},
        ]
    }
    return records


def write_grpo_prompts(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "prompts.jsonl")
    with open(path, "w") as f:
        for record in grpo_records(folder):
            f.write(json.dumps(record) + "\n")
    return path

"""Start from Hugging Face weights, end to end through ``run_qwen35_vl.sh``:

- import a tiny bf16 checkpoint, train LoRA adapters from it (``CKPT_LOAD``, shape taken from the
  import's hf_config.json): the first-iteration loss equals the HF model's per-token loss on the
  same four mock samples (1e-5 relative; both fp32 on the CPU, the bf16 weights upcast exactly; the
  adapters start at B = 0), and the run's checkpoint leaves as docs/lora.md shows (export, PEFT);
- import an fp32 checkpoint with MTP, save it from a TP=2 run (and from a PP=2 x VP=2 run: the
  import trains directly at PP>1) whose step leaves the weights untouched (LR=0), export that
  sharded checkpoint (the converter loads it at TP=PP=1): every tensor bitwise equal to the
  original, which is what the import, saved at PP=1, exports. The same from TP=2 with the vision
  tower at its own TP of 1 (two copies of it, one the checkpoint's), and with the tower alone on a
  rank of its own ahead of the language model's two (VISION_NPROC=1: each module's ranks write
  their own shards, the language model the common state).
"""

import json
import os
import re

import pytest
import torch
from checkpoint_diff import entries
from hf_checkpoints import write_hf_checkpoint
from launch import NO_EVAL, run_script
from lora_exports import peft_equals_merged

from examples.multimodal_dev.checkpoint.files import checkpoint_directory
from examples.multimodal_dev.checkpoint.hf_export import export_hf
from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.checkpoint.hf_models import hf_classes
from examples.multimodal_dev.checkpoint.hf_safetensors import HFTensorSource
from examples.multimodal_dev.data import get_dataset_provider
from examples.multimodal_dev.data.sample import VisionTokens
from examples.multimodal_dev.models.qwen35_vl.configuration import from_hf_config, get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main


def _hf_loss_on_first_batch(hf_path: str, seq_length: int, global_batch: int, train_iters: int) -> float:
    """The run script's first global batch (mock, seed 1234), through the HF model sample by sample."""
    shape = from_hf_config(hf_path)
    with open(os.path.join(hf_path, "config.json")) as f:
        _, model_cls = hf_classes(json.load(f)["model_type"])
    hf = model_cls.from_pretrained(hf_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    train = get_dataset_provider("mock")(
        tokens=VisionTokens.from_shape(shape),
        vocab_size=shape.text.vocab_size,
        patch_dim=shape.vision.patch_dim,
        seq_length=seq_length,
        num_samples=(train_iters * global_batch, 0, 0),
        seed=1234,
        mean_text_tokens=96,
    )[0]
    loss_sum, tokens = 0.0, 0.0
    with torch.no_grad():
        for i in range(global_batch):
            s = train[i]
            ids = s["input_ids"][None]
            grid = s["image_grid_thw"] if len(s["image_grid_thw"]) else None
            logits = hf(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == shape.image_token_id).long(),
                pixel_values=s["pixel_values"] if grid is not None else None,
                image_grid_thw=grid,
            ).logits[0]
            per_token = torch.nn.functional.cross_entropy(logits.double(), s["labels"].clamp(min=0), reduction="none")
            loss_sum += float((per_token * s["loss_mask"]).sum())
            tokens += float(s["loss_mask"].sum())
    return loss_sum / tokens


def test_lora_from_an_import_starts_at_the_hf_loss_and_leaves_as_docs_lora_md_shows(tmp_path, mcore):
    """docs/lora.md's commands: import, a LoRA run from the import through the run script (saving
    as it does by default, optimizer state and all), then ``export`` and ``export-peft``; the
    adapter, loaded by ``peft`` onto transformers' model of the imported folder, gives the merged
    export's logits. The adapters start at B = 0, so the run's first loss is the HF model's."""
    hf_path, ckpt, tuned = tmp_path / "hf", tmp_path / "imported", tmp_path / "lora"
    write_hf_checkpoint(hf_path, get_variant("tiny", moe=False, mtp=True))
    assert main(["import", "--hf-path", str(hf_path), "--megatron-path", str(ckpt)]) == 0
    lora = dict(LORA_RANK=4, LORA_ALPHA=12, CKPT_SAVE=tuned, LR=5e-3)
    run = run_script(NO_EVAL, CKPT_LOAD=ckpt, TRAIN_ITERS=2, SEQ_LEN=512, GBS=4, MBS=2, **lora).check()
    assert "model shape from" in run.output and "successfully loaded checkpoint" in run.output
    reference = _hf_loss_on_first_batch(str(hf_path), 512, 4, 2)
    rel = abs(run.losses[1] - reference) / reference
    print(f"first iteration after import: Megatron {run.losses[1]:.6f}, HF {reference:.6f} (rel {rel:.1e})")
    assert rel < 1e-5
    assert any(k.startswith("optimizer.state.exp_avg.") for k in entries(tuned / "iter_0000002", tmp_path))
    line = peft_equals_merged(tuned, hf_path, tmp_path, "dense, from an import")
    assert f"trained on {os.path.abspath(checkpoint_directory(str(ckpt)))}" in line


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores for two ranks")
@pytest.mark.parametrize(
    "layout",
    [dict(TP=2), dict(PP=2, VP=2), dict(TP=2, VISION_TP=1), dict(TP=2, VISION_TP=1, VISION_NPROC=1)],
    ids=["TP=2", "PP=2 VP=2", "TP=2 VISION_TP=1", "VISION_NPROC=1 TP=2"],
)
def test_export_of_a_sharded_checkpoint_is_bitwise(layout, tmp_path, mcore):
    hf_path, ckpt, tp_ckpt, out = (tmp_path / n for n in ("hf", "imported", "sharded", "out"))
    write_hf_checkpoint(hf_path, get_variant("tiny", moe=False, mtp=True), dtype=torch.float32)
    import_hf(str(hf_path), str(ckpt))
    run_script(NO_EVAL, CKPT_LOAD=ckpt, CKPT_SAVE=tp_ckpt, MTP=1, TRAIN_ITERS=1, SEQ_LEN=512, LR=0, **layout).check()
    assert (tp_ckpt / "iter_0000001").is_dir()
    export_hf(str(tp_ckpt), str(out))
    original, back = HFTensorSource(str(hf_path)), HFTensorSource(str(out))
    assert back.names == original.names
    for name in sorted(original.names):
        a, b = original.get(name), back.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    print(f"{len(original.names)} tensors bitwise equal after import -> {layout} save -> export")


def test_generate_answers_from_a_lora_checkpoint_as_transformers_does_from_its_merged_export(tmp_path, mcore):
    """``tools/generate.py`` on a LoRA run's checkpoint (the adapters alone; the base read from the
    import it names): greedy answers equal transformers' on that checkpoint's merged export."""
    import json

    from hf_generate import hf_greedy
    from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor, tiny_shape_for

    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.tools import generate

    hf_path, ckpt, tuned, merged = tmp_path / "hf", tmp_path / "imported", tmp_path / "lora", tmp_path / "merged"
    processor = build_processor(str(hf_path), chat_template=QWEN35_CHAT_TEMPLATE)
    write_hf_checkpoint(hf_path, tiny_shape_for(processor), dtype=torch.float32)
    assert main(["import", "--hf-path", str(hf_path), "--megatron-path", str(ckpt)]) == 0

    # trained on the user's own records, through the processor the answers are asked with
    def chat(n: int) -> dict:
        answer = " ".join(map(str, range(n)))
        return {"messages": [{"role": "user", "content": f"Count to {n}."}, {"role": "assistant", "content": answer}]}

    lines = [json.dumps(chat(n)) + "\n" for n in range(2, 18)]
    (tmp_path / "train.jsonl").write_text("".join(lines))
    data = dict(DATASET="jsonl", DATA_PATH=tmp_path / "train.jsonl", HF_PROCESSOR_PATH=processor)
    lora = dict(LORA_RANK=4, LORA_ALPHA=12, CKPT_SAVE=tuned, LR=5e-3)
    run = run_script(NO_EVAL, CKPT_LOAD=ckpt, TRAIN_ITERS=2, SEQ_LEN=512, GBS=4, MBS=2, **data, **lora).check()
    assert "its checkpoints hold the adapters, not the base" in run.output
    assert (
        main(["export", "--megatron-path", str(tuned), "--hf-path", str(merged), "--hf-processor-path", processor]) == 0
    )
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]}
    (tmp_path / "prompts.jsonl").write_text(json.dumps(record) + "\n")
    answers = tmp_path / "answers.jsonl"
    argv = [
        "--megatron-path",
        str(tuned),
        "--hf-processor-path",
        processor,
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
    ]
    assert generate.main([*argv, "--max-new-tokens", "8", "--output", str(answers), "--with-token-ids"]) == 0
    sample, _ = prompt_reader(processor, 8192).prompt_sample(json.dumps(record), str(tmp_path), "prompts.jsonl:1")
    ours = json.loads(answers.read_text())["token_ids"]
    print(f"generate from the LoRA checkpoint: {ours}")
    assert ours == hf_greedy(merged, sample["input_ids"].tolist(), 8, processor_dir=processor), ours


def test_a_save_pretrained_checkpoint_imports_trains_a_new_mtp_head_exports_and_verifies(tmp_path, mcore):
    """What a fine-tune done with transformers hands over: ``save_pretrained`` writes no ``mtp.*`` while
    its config.json counts the head. Import takes it without the head; ``MTP=1`` from the import trains a
    head started afresh (its loss is logged) beside the imported weights; the run's export loads in
    transformers, and the import verifies against the folder it came from."""
    from hf_reference import build_hf_model

    from examples.multimodal_dev.checkpoint.hf_models import hf_classes

    hf_path, ckpt, tuned, out = (tmp_path / n for n in ("hf", "imported", "tuned", "out"))
    hf = build_hf_model(get_variant("tiny", moe=True, mtp=True)).to(torch.bfloat16)
    hf.config.dtype = torch.bfloat16
    hf.save_pretrained(hf_path)
    assert not any(n.startswith("mtp.") for n in HFTensorSource(str(hf_path)).names)
    assert main(["import", "--hf-path", str(hf_path), "--megatron-path", str(ckpt)]) == 0
    run = run_script(NO_EVAL, CKPT_LOAD=ckpt, CKPT_SAVE=tuned, MTP=1, TRAIN_ITERS=2, SEQ_LEN=512, GBS=2, MBS=1)
    run.check()
    assert re.search(r"holds no MTP head: the model's head \(\d+ entries\) starts from its initialisation", run.output)
    assert len(run.mtp_losses) == 2 and all(v > 0 for v in run.mtp_losses.values()), run.mtp_losses
    assert main(["export", "--megatron-path", str(tuned), "--hf-path", str(out)]) == 0
    _, cls = hf_classes("qwen3_5_moe")
    _, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert any(n.startswith("mtp.") for n in HFTensorSource(str(out)).names)  # the head it trained
    assert main(["verify", "--hf-path", str(hf_path), "--megatron-path", str(ckpt)]) == 0

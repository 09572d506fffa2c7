"""``tools/generate.py`` end to end: a Hugging Face checkpoint imported, prompts read from JSONL and from
``--prompt``/``--image`` through a Qwen3.5-style processor, greedy answers equal to those of
transformers' ``generate`` on the same weights and the same prompt tokens, scores against the
records' answers, and a user's mistake in one line."""

import json
import os
import random

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from hf_generate import hf_greedy
from tiny_processor import QWEN35_CHAT_TEMPLATE, build_processor, png_bytes, tiny_shape_for

from examples.multimodal_dev.tools import convert_checkpoint, generate

NEW = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mcore):
    root = tmp_path_factory.mktemp("generate")
    processor_dir = build_processor(str(root / "hf"), chat_template=QWEN35_CHAT_TEMPLATE)
    shape = tiny_shape_for(processor_dir)
    write_hf_checkpoint(root / "hf", shape, dtype=torch.float32)
    assert convert_checkpoint.main(["import", "--hf-path", str(root / "hf"), "--megatron-path", str(root / "mg")]) == 0
    (root / "red.png").write_bytes(png_bytes((64, 48), (200, 40, 40)))
    records = [
        {
            "messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."}],
            "images": ["red.png"],
        },
        {
            "messages": [
                {"role": "user", "content": "Say a receipt."},
                {"role": "assistant", "content": '{"total": {"total_price": "5.75"}}'},
            ]
        },
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]},
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root, shape


def test_answers_from_a_jsonl_file_equal_transformers_and_are_scored(checkpoint, capsys):
    from examples.multimodal_dev.data.jsonl import prompt_reader

    root, _ = checkpoint
    out = root / "answers.jsonl"
    argv = [
        "--megatron-path",
        str(root / "mg"),
        "--hf-processor-path",
        str(root / "hf"),
        "--prompts",
        str(root / "prompts.jsonl"),
        "--max-new-tokens",
        str(NEW),
        "--batch-size",
        "2",
        "--output",
        str(out),
        "--with-token-ids",
    ]
    assert generate.main(argv) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a.get("reference") for a in answers] == ["Red.", '{"total": {"total_price": "5.75"}}', None]
    reader = prompt_reader(str(root / "hf"), 8192)
    for (n, line), answer in zip(enumerate(open(root / "prompts.jsonl"), 1), answers):
        sample, _ = reader.prompt_sample(line, str(root), f"prompts.jsonl:{n}")
        assert answer["where"].endswith(f"prompts.jsonl:{n}")
        expected = hf_greedy(
            root / "hf", sample["input_ids"].tolist(), NEW, sample["pixel_values"], sample["image_grid_thw"]
        )
        assert answer["token_ids"] == expected, n
        with capsys.disabled():
            print(f"prompt {n}: {answer['token_ids']}")
    err = capsys.readouterr().err
    assert "generate: scores over 2 reference answer(s): exact_match" in err and "field_f1" in err, err


def test_one_prompt_with_an_image(checkpoint, capsys):
    root, _ = checkpoint
    argv = [
        "--megatron-path",
        str(root / "mg"),
        "--hf-processor-path",
        str(root / "hf"),
        "--prompt",
        "What colour?",
        "--image",
        str(root / "red.png"),
        "--max-new-tokens",
        "4",
    ]
    assert generate.main(argv) == 0
    answer = json.loads(capsys.readouterr().out.strip())
    assert answer["where"] == "--prompt" and "reference" not in answer


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompts", "nowhere.jsonl"], "generate: error: --prompts nowhere.jsonl: no such file"),
        (["--prompt", "x", "--max-new-tokens", "0"], "generate: error: --max-new-tokens 0: must be at least 1"),
        (["--prompt", "x", "--temperature", "1", "--top-p", "0"], "generate: error: --top-p 0.0: expected (0, 1]"),
        (["--prompt", "x", "--image", "missing.png"], "generate: error: --image missing.png: no such file"),
        (["--prompt", "x", "--temperature", "inf"], "generate: error: --temperature inf: expected finite, >= 0"),
        (["--prompt", "x", "--temperature", "nan"], "generate: error: --temperature nan: expected finite, >= 0"),
    ],
)
def test_mistakes_are_one_line(checkpoint, capsys, extra, message):
    root, _ = checkpoint
    argv = ["--megatron-path", str(root / "mg"), "--hf-processor-path", str(root / "hf"), *extra]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_an_output_over_an_input_and_a_prompts_file_that_is_not_utf8_are_refused(checkpoint, tmp_path, capsys):
    """Opening ``--output`` truncates it: the same file as an input (as named, through a link, or an
    image) is refused before anything is written. Undecodable prompts name the file and line."""
    root, _ = checkpoint
    base = ["--megatron-path", str(root / "mg"), "--hf-processor-path", str(root / "hf")]
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    link = tmp_path / "answers.jsonl"
    os.symlink(prompts, link)
    image = str(root / "red.png")
    for asked, output, flag, source in [
        (["--prompts", str(prompts)], prompts, "--prompts", prompts),
        (["--prompts", str(prompts)], link, "--prompts", prompts),
        (["--prompt", "x", "--image", image], image, "--image", image),
    ]:
        assert generate.main([*base, *asked, "--output", str(output)]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err
            == f"generate: error: --output {output}: is the {flag} input {source}; name another file for the answers"
        )
    assert prompts.read_text().startswith('{"messages"') and open(image, "rb").read(4) == b"\x89PNG"

    prompts.write_bytes(
        '{"messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": "caf\xe9"}\n'.encode("latin-1")
    )
    assert generate.main([*base, "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"generate: error: --prompts {prompts}:3: not UTF-8 text (invalid continuation byte at byte 17)", err


def _bad_processor(root, name: str, **image_processor) -> str:
    """A copy of the fixture's processor with other image-processor sizes or token ids."""
    from tiny_processor import SPECIALS

    if "swap_vision_tokens" in image_processor:  # image and video pads trade ids
        image_processor.pop("swap_vision_tokens")
        specials = [{"<|image_pad|>": "<|video_pad|>", "<|video_pad|>": "<|image_pad|>"}.get(s, s) for s in SPECIALS]
        return build_processor(str(root / name), specials=specials, chat_template=QWEN35_CHAT_TEMPLATE)
    path = build_processor(str(root / name), chat_template=QWEN35_CHAT_TEMPLATE)
    config = json.loads((root / name / "processor_config.json").read_text())
    config["image_processor"].update(image_processor)
    (root / name / "processor_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "change, differs",
    [
        ({"patch_size": 14}, "image patch_size 14 (processor) vs 16 (checkpoint)"),
        (
            {"merge_size": 4, "temporal_patch_size": 1},
            "image merge_size 4 (processor) vs 2 (checkpoint); image temporal",
        ),
        ({"swap_vision_tokens": True}, "image_token_id 6 (processor) vs 5 (checkpoint); video_token_id 5 (processor)"),
    ],
)
def test_a_processor_that_does_not_fit_the_checkpoint_is_refused_before_weights_load(
    checkpoint, tmp_path, monkeypatch, capsys, change, differs
):
    """Its prompts would scatter vision features at the wrong places (or at another patch size) and end
    in a tensor-size RuntimeError inside the model; it is named before the weights are read."""
    from examples.multimodal_dev.checkpoint import hf_conversion

    root, _ = checkpoint
    bad = _bad_processor(tmp_path, "bad", **change)
    monkeypatch.setattr(hf_conversion, "load_megatron_with_lora", lambda *a, **k: pytest.fail("weights loaded"))
    argv = ["--megatron-path", str(root / "mg"), "--hf-processor-path", bad, "--prompt", "x"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"generate: error: --hf-processor-path {bad} does not fit the checkpoint --megatron-path")
    assert differs in err and len(err.splitlines()) == 1, err


def test_a_vocabulary_past_the_embedding_is_a_difference(checkpoint):
    from dataclasses import replace

    from examples.multimodal_dev.data.processor import load_processor, processor_differences

    root, shape = checkpoint
    processor, info = load_processor(str(root / "hf"))
    assert processor_differences(processor, info, shape) == []
    small = replace(shape, text=replace(shape.text, vocab_size=50))
    assert processor_differences(processor, info, small) == [
        f"a vocabulary of {len(processor.tokenizer)} tokens (processor) > 50 (checkpoint)"
    ]


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--megatron-path", "missing", "--megatron-path {}: no such directory"),
        ("--hf-processor-path", "missing", "--hf-processor-path '{}': no such file or directory"),
        ("--hf-config-path", "missing.json", "--hf-config-path {}: no such file"),
        ("--media-root", "missing", "--media-root {}: no such directory"),
    ],
)
def test_every_path_is_checked_before_anything_loads(checkpoint, tmp_path, monkeypatch, capsys, flag, value, message):
    """A missing checkpoint was named only after the processor had loaded (141 s on a slow host)."""
    from examples.multimodal_dev.data import jsonl

    root, _ = checkpoint
    monkeypatch.setattr(jsonl, "prompt_reader", lambda *a, **k: pytest.fail("the processor loaded"))
    paths = {"--megatron-path": str(root / "mg"), "--hf-processor-path": str(root / "hf")}
    paths[flag] = str(tmp_path / value)
    argv = [x for kv in paths.items() for x in kv] + ["--prompt", "x"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"generate: error: {message.format(tmp_path / value)}") and len(err.splitlines()) == 1, err


def test_stdout_carries_only_the_answers(checkpoint):
    """A script reads the answers from stdout as JSONL; megatron's log lines (its root logger writes to
    stdout once megatron.training is imported) go to stderr."""
    import subprocess
    import sys

    root, _ = checkpoint
    out = subprocess.run(
        [sys.executable, "-m", "examples.multimodal_dev.tools.generate", "--megatron-path", str(root / "mg")]
        + ["--hf-processor-path", str(root / "hf"), "--prompt", "x", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert [json.loads(line)["where"] for line in out.stdout.splitlines()] == ["--prompt"], out.stdout
    assert "generate: 1 prompt(s)" in out.stderr


@pytest.mark.parametrize("damage", ["planted", "overwritten"])
def test_a_planted_or_damaged_common_state_is_one_line(checkpoint, tmp_path, capsys, damage):
    """A ``common.pt`` planted in a checkpoint (megatron reads it first where it exists) ended in torch's
    UnpicklingError, whose text advises loading with weights_only=False; generate and export say it in
    one line naming the file."""
    import shutil

    from examples.multimodal_dev.tools import convert_checkpoint

    root, _ = checkpoint
    shutil.copytree(root / "mg", tmp_path / "mg")
    (folder,) = (tmp_path / "mg").glob("iter_*")
    common = folder / "common.pt"
    if damage == "planted":
        torch.save({"args": _Plant(tmp_path / "ran")}, common)
    else:
        torch.save({"args": {"x": "y" * 9000}}, common)
        with open(common, "r+b") as f:
            f.seek(64)
            f.write(random.Random(damage).randbytes(4096))  # the same bytes on every run
    base = ["--megatron-path", str(tmp_path / "mg")]
    assert generate.main([*base, "--hf-processor-path", str(root / "hf"), "--prompt", "x"]) == 2
    assert convert_checkpoint.main(["export", *base, "--hf-path", str(tmp_path / "out")]) == 2
    for line in capsys.readouterr().err.strip().splitlines():
        assert f"--megatron-path {tmp_path / 'mg'}: checkpoint refused: {common}: " in line, line
        assert "weights_only" not in line
    assert not (tmp_path / "ran").exists()


class _Plant:
    """Unpickling this runs ``os.system`` (it would create ``path``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_record_already_read_is_encoded_as_its_line_without_the_jsonl_line_limit(checkpoint, monkeypatch):
    """A server hands the reader the request's record (under the server's own --max-request-bytes):
    the same encoding as its JSONL line, and the JSONL reader's line limit not applied to it."""
    from examples.multimodal_dev.data import jsonl_source
    from examples.multimodal_dev.data.jsonl import prompt_reader
    from examples.multimodal_dev.data.sample import DataError

    root, _ = checkpoint
    reader = prompt_reader(str(root / "hf"), 8192)
    line = open(root / "prompts.jsonl").readline()
    from_line, _ = reader.prompt_sample(line, str(root), "line")
    monkeypatch.setattr(jsonl_source, "MAX_LINE_BYTES", 10)
    with pytest.raises(DataError, match="line_too_long"):
        reader.prompt_sample(line, str(root), "line")
    from_record, _ = reader.prompt_sample(json.loads(line), str(root), "request")
    assert from_record.keys() == from_line.keys()
    assert all(torch.equal(from_record[k], v) for k, v in from_line.items() if v is not None)

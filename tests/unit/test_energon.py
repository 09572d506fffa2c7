"""The energon provider and its converter: the example JSONL files of docs/data.md (media drawn here)
converted to energon shards, read back with energon's loader, give the jsonl provider's samples
for the same conversations (ids, labels, pixels, grids); two data-parallel ranks see disjoint
shares that cover the data; a bad input to the converter is one line and leaves no OUT_DIR."""

import json
import os

import pytest
import torch
from tiny_processor import png_bytes

from examples.multimodal_dev.data import energon, get_dataset_provider
from examples.multimodal_dev.data.jsonl import build_datasets as jsonl_datasets
from examples.multimodal_dev.data.sample import FIELDS, BadSample, DataError
from examples.multimodal_dev.tools import jsonl_to_energon

OPTIONS = dict(min_pixels=32 * 32, max_pixels=128 * 128, video_min_pixels=32 * 32, video_max_pixels=64 * 64)
SEQ = 4096


def conversations(path, split="train", rank=0, world=1, encoder=None):
    """One unshuffled pass over ``split`` on one rank: cooked conversations (or ``encoder``'s samples)."""
    config = energon.worker_config(rank, world, 0)
    dataset = energon.open_dataset(
        str(path),
        split,
        config,
        encoder or energon.ConversationEncoder(),
        None,
        True,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    return list(energon.get_loader(dataset, worker_config=config))


def test_converter_writes_every_conversation_with_its_media(example_data):
    data, out, counts, _ = example_data
    records = [
        json.loads(line)
        for name in sorted(os.listdir(data))
        if name.endswith(".jsonl")
        for line in open(data / name)
        if line.strip()
    ]
    assert counts["train"] == len(records) and counts["val"] == 0 and not counts["skipped"]
    assert {"dataset.yaml", "split.yaml", ".info.json"} <= set(os.listdir(out / ".nv-meta"))
    assert "CrudeWebdataset" in (out / ".nv-meta" / "dataset.yaml").read_text()
    assert not [p for p in os.listdir(out.parent) if ".partial-" in p]
    cooked = conversations(out)
    assert len(cooked) == len(records)
    first = next(c for c in cooked if json.loads(c.text)["source"].endswith("messages.jsonl:1"))
    assert first.media["img0.png"] == (data / "images" / "red_circle.png").read_bytes()
    videos = [c for c in cooked if any(k.startswith("vid") for k in c.media)]
    assert videos and all(v for c in videos for v in c.media.values())


def test_samples_equal_the_jsonl_providers(example_data):
    data, out, _, processor = example_data
    train, _, _ = get_dataset_provider("energon")(
        seq_length=SEQ, num_samples=(1, 0, 0), data_path=str(out), hf_processor_path=processor, **OPTIONS
    )
    cooked = conversations(out)
    by_source = {json.loads(c.text)["source"]: c for c in cooked}
    checked = 0
    for name in sorted(n for n in os.listdir(data) if n.endswith(".jsonl")):
        path = str(data / name)
        reference, _, _ = jsonl_datasets(SEQ, (1000, 0, 0), data_path=path, hf_processor_path=processor, **OPTIONS)
        lines = [i + 1 for i, line in enumerate(open(path)) if line.strip()]
        for row, line in enumerate(lines):
            mine = energon.conversation_sample(
                train.produce, by_source[f"{path}:{line}"], train.tokens, SEQ, train.patch_dim
            )
            theirs = reference[row]
            for field in FIELDS:
                assert torch.equal(mine[field], theirs[field]), (name, line, field)
            checked += 1
    assert checked == len(cooked)


def test_iterator_yields_collated_micro_batches_through_the_encoder(example_data):
    _, out, counts, processor = example_data
    train, valid, test = energon.build_datasets(
        SEQ, (1, 1, 1), data_path=str(out), hf_processor_path=processor, **OPTIONS
    )
    assert valid is None and test is None  # no val / test shards
    from examples.multimodal_dev.data.loader import build_iterator

    batches = build_iterator(
        train,
        0,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
        collate_fn=lambda samples: {"n": len(samples), "ids": [s["input_ids"] for s in samples], "stats": {}},
    )
    seen = [next(batches) for _ in range(counts["train"])]  # the train split repeats past one pass
    assert all(b["n"] == 2 and "skipped" not in b["stats"] for b in seen)


def test_two_data_parallel_ranks_see_disjoint_shares_covering_the_data(example_data):
    _, out, counts, _ = example_data
    keys = [[c.__key__ for c in conversations(out, rank=r, world=2)] for r in (0, 1)]
    assert keys[0] and keys[1] and not set(keys[0]) & set(keys[1])
    assert len(set(keys[0]) | set(keys[1])) == counts["train"] == len(keys[0]) + len(keys[1])


def test_valid_fraction_holds_out_the_jsonl_rule(example_data, tmp_path):
    data, _, _, _ = example_data
    counts = jsonl_to_energon.convert(
        str(data / "messages.jsonl"), str(tmp_path / "out"), valid_fraction=0.25, log=lambda line: None
    )
    held = {json.loads(c.text)["source"].rsplit(":", 1)[1] for c in conversations(tmp_path / "out", "val")}
    lines = [i + 1 for i, line in enumerate(open(data / "messages.jsonl")) if line.strip()]
    assert held == {str(lines[i]) for i in range(len(lines)) if (i + 1) // 4 > i // 4}
    assert counts["val"] == len(held) and counts["train"] == len(lines) - len(held)
    assert energon.available_splits(str(tmp_path / "out")) == {"train", "val"}


@pytest.mark.parametrize(
    "fault, message",
    [
        ("missing_input", "no such file or directory"),
        ("not_jsonl", "is not a .jsonl file"),
        ("bad_json", "bad.jsonl:2: bad_json"),
        ("missing_image", "bad.jsonl:1: missing_image"),
        ("no_assistant", "bad.jsonl:1: no_assistant_turn"),
        ("out_exists", "exists; give a new folder"),
        ("bad_shard_size", "--shard-size 0"),
        ("host_file", "bad.jsonl:1: media_outside_root: '/etc/hostname' lies outside"),
        ("not_an_image", "bad.jsonl:1: bad_image: cannot read image 'notes.png'"),
    ],
)
def test_converter_refuses_bad_input_in_one_line(tmp_path, capsys, fault, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    lines = {
        "bad_json": [json.dumps(good), "{not json"],
        "missing_image": [
            json.dumps(
                {
                    **good,
                    "images": ["nowhere.png"],
                    "messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}],
                }
            )
        ],
        "host_file": [
            json.dumps(
                {
                    **good,
                    "images": ["/etc/hostname"],
                    "messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}],
                }
            )
        ],
        "not_an_image": [
            json.dumps(
                {
                    **good,
                    "images": ["notes.png"],
                    "messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}],
                }
            )
        ],
        "no_assistant": [json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
    }.get(fault, [json.dumps(good)])
    (tmp_path / "notes.png").write_text("a text file named as an image")
    source = tmp_path / ("bad.txt" if fault == "not_jsonl" else "bad.jsonl")
    if fault != "missing_input":
        source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    if fault == "out_exists":
        out.mkdir()
    argv = [str(source), str(out)] + (["--shard-size", "0"] if fault == "bad_shard_size" else [])
    assert jsonl_to_energon.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert os.listdir(out) == [] if fault == "out_exists" else not out.exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_a_host_file_is_packed_only_when_allowed_and_only_if_it_decodes(tmp_path, capsys):
    image = tmp_path / "elsewhere" / "red.png"
    image.parent.mkdir()
    image.write_bytes(png_bytes((16, 16), (255, 0, 0)))
    record = {"messages": [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}]}
    source = tmp_path / "data" / "a.jsonl"
    source.parent.mkdir()
    source.write_text(json.dumps({**record, "images": [str(image)]}) + "\n")
    assert jsonl_to_energon.main([str(source), str(tmp_path / "refused")]) == 2
    assert "media_outside_root" in capsys.readouterr().err
    assert jsonl_to_energon.main([str(source), str(tmp_path / "out"), "--allow-media-anywhere"]) == 0
    assert conversations(tmp_path / "out")[0].media["img0.png"] == image.read_bytes()
    # named inside the folder, a symlink to it: where it leads is outside, so it is refused too
    os.symlink(image, source.parent / "red.png")
    source.write_text(json.dumps({**record, "images": ["red.png"]}) + "\n")
    assert jsonl_to_energon.main([str(source), str(tmp_path / "linked")]) == 2
    assert f"media_outside_root: 'red.png' is a symlink to '{image}'" in capsys.readouterr().err


def test_a_shard_sample_reads_media_only_from_its_own_members(example_data, tmp_path):
    """However a shard's record names an image (the ``path`` key, a top-level ``images`` list), it
    must be one of the sample's members: a host path in a shard is a skip, never opened."""
    _, out, _, processor = example_data
    train, _, _ = get_dataset_provider("energon")(
        seq_length=SEQ, num_samples=(1, 0, 0), data_path=str(out), hf_processor_path=processor, **OPTIONS
    )
    host = tmp_path / "host.png"
    host.write_bytes(png_bytes((16, 16), (0, 0, 255)))
    answer = {"role": "assistant", "content": "x"}
    records = [
        {"messages": [{"role": "user", "content": [{"type": "image", "path": str(host)}]}, answer]},
        {"messages": [{"role": "user", "content": "<image>hi"}, answer], "images": [str(host)]},
    ]
    for i, record in enumerate(records):
        conversation = energon.cook_conversation(
            {
                "__key__": f"k{i}",
                "__restore_key__": (),
                "json": json.dumps({**record, "source": f"planted:{i}"}).encode(),
            }
        )
        with pytest.raises(
            BadSample,
            match=rf"missing_image: planted:{i} \(energon sample k{i}\): no member "
            f"'{host}' in the shard sample",
        ):
            energon.conversation_sample(train.produce, conversation, train.tokens, SEQ, train.patch_dim)


def test_skip_bad_leaves_bad_records_out_and_counts_them(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (tmp_path / "a.jsonl").write_text(f"{json.dumps(good)}\n{{oops\n{json.dumps(good)}\n")
    counts = jsonl_to_energon.convert(
        str(tmp_path / "a.jsonl"), str(tmp_path / "out"), skip_bad=True, log=lambda line: None
    )
    assert counts["train"] == 2 and counts["skipped"] == {"bad_json": 1}


def test_energon_path_refusals(tmp_path):
    with pytest.raises(DataError, match="not a prepared energon dataset"):
        energon.check_energon_path(str(tmp_path))
    with pytest.raises(DataError, match="no such file"):
        energon.check_energon_path(str(tmp_path / "nope"))


def test_a_metadataset_blends_datasets_by_weight(example_data, tmp_path):
    """An energon metadataset YAML (``DATA_PATH=blend.yaml``) blending two converted files 3:1: the
    training stream draws from both at about that ratio (energon samples by weight)."""
    data, _, _, _ = example_data
    for name in ("messages", "sharegpt"):
        jsonl_to_energon.convert(str(data / f"{name}.jsonl"), str(tmp_path / name), log=lambda line: None)
    blend = tmp_path / "blend.yaml"
    blend.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 3\n        path: messages\n      - weight: 1\n        path: sharegpt\n"
    )
    assert energon.check_energon_path(str(blend)) == str(blend)
    assert energon.available_splits(str(blend)) == {"train"}
    split = energon.EnergonSplit(
        str(blend),
        "train",
        None,
        None,
        SEQ,
        1,
        0,
        energon.DEFAULT_SHUFFLE_BUFFER,
        energon.DEFAULT_MAX_SAMPLES_PER_SEQUENCE,
        "energon[train]",
    )
    from examples.multimodal_dev.data.loader import build_iterator

    batches = build_iterator(split, 0, 4, 0, 1, None)
    drawn = [json.loads(c.text)["source"] for _ in range(100) for c in next(batches)]
    share = sum("messages.jsonl" in s for s in drawn) / len(drawn)
    print(f"metadataset 3:1 blend: {share:.3f} of 400 conversations from the weight-3 dataset")
    assert {"messages.jsonl", "sharegpt.jsonl"} == {os.path.basename(s.rsplit(":", 1)[0]) for s in drawn}
    assert 0.68 < share < 0.82, share


def test_an_energon_dataset_with_nothing_usable_stops_in_one_line(example_data, monkeypatch, caplog):
    """Every sample skipped: the run stops after ``MAX_SKIPS_IN_A_ROW`` in a row with the count per
    reason (it looped forever, a line a sample), and each reason's skip line is printed only the
    first few times; a usable sample between two runs of skips starts the count again."""
    from megatron.energon import SkipSample

    from examples.multimodal_dev.data import skipping
    from examples.multimodal_dev.data.loader import build_iterator

    _, out, _, processor = example_data
    monkeypatch.setattr(skipping, "MAX_SKIPS_IN_A_ROW", 6)
    train, _, _ = energon.build_datasets(SEQ, (1, 0, 0), data_path=str(out), hf_processor_path=processor, **OPTIONS)
    encoder = energon.ConversationEncoder(train.produce, train.tokens, SEQ, train.patch_dim, name="energon[train]")
    good = conversations(out)[0]
    bad = energon.cook_conversation(
        {
            "__key__": "k",
            "__restore_key__": (),
            "json": json.dumps({**json.loads(good.text), "images": ["x.png"]}).encode(),
        }
    )
    for conversation in [bad] * 5 + [good] + [bad] * 5:
        if conversation is good:
            encoder.encode_sample(good)
            continue
        with pytest.raises(SkipSample):
            encoder.encode_sample(conversation)
    with pytest.raises(DataError, match=r"^6 samples in a row of energon\[train\] were skipped \(\w+=6\)"):
        encoder.encode_sample(bad)
    lines = [r.getMessage() for r in caplog.records if "skipped a conversation" in r.getMessage()]
    assert len(lines) == skipping.LINES_PER_REASON and "skips are counted, not printed" in lines[-1], lines
    assert sum(encoder.skip_counts.values()) == 11

    # through energon's loader, as a run reads it: one line, not an endless loop
    def unusable(*args):
        raise BadSample("missing_image", "no member 'x.png' in the shard sample")

    monkeypatch.setattr(energon, "conversation_sample", unusable)
    batches = build_iterator(train, 0, micro_batch_size=1, dp_rank=0, dp_size=1, collate_fn=lambda s: s)
    with pytest.raises(DataError, match=r"6 samples in a row of energon\[train\] were skipped \(missing_image=6\)"):
        next(batches)

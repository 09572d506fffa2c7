"""energon's loader position in a checkpoint (data/energon_state.py, checkpoint/loader_state.py):
a split saved after some micro-batches and restored in a fresh loader yields the micro-batches the
saved one would have yielded next, with and without loader workers; the state file is JSON that
names no code (a planted class is refused, not imported), and a state that cannot be used
(other settings, damaged, missing) restarts the stream with a line saying why."""

import json

import pytest

from examples.multimodal_dev.checkpoint import loader_state
from examples.multimodal_dev.data import energon, energon_state
from examples.multimodal_dev.data.loader import build_iterator

MBS = 2


def _split(out, seed=0):
    """The training split of the example shards, conversations unencoded (keys are enough here)."""
    return energon.EnergonSplit(
        str(out),
        "train",
        None,
        None,
        4096,
        1,
        seed,
        energon.DEFAULT_SHUFFLE_BUFFER,
        energon.DEFAULT_MAX_SAMPLES_PER_SEQUENCE,
        "energon[train]",
    )


def _keys(batches, n):
    return [[c.__key__ for c in next(batches)] for _ in range(n)]


def _settings(split, workers, dp_rank=0, dp_size=1):
    return split.stream_settings(MBS, dp_rank, dp_size, workers)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_restored_loader_continues_where_the_saved_one_stopped(example_data, tmp_path, workers):
    _, out, _, _ = example_data
    saved = _split(out)
    batches = build_iterator(saved, 0, MBS, 0, 1, None, num_workers=workers)
    before = _keys(batches, 5)
    checkpoint_dir = tmp_path / "iter_0000005"
    checkpoint_dir.mkdir()
    assert loader_state.write_state(str(checkpoint_dir), 0, saved.save_state())
    after = _keys(batches, 8)  # past one pass over the 26 conversations: the repeat is continued too

    resumed = _split(out)
    line = _resume(resumed, checkpoint_dir, _settings(resumed, workers))
    assert line == f"data loader: DP rank 0 continues from {loader_state.state_path(str(checkpoint_dir), 0)}"
    assert _keys(build_iterator(resumed, 5 * MBS, MBS, 0, 1, None, num_workers=workers), 8) == after
    if not workers:  # the check can fail: a fresh stream starts with the saved run's first micro-batches
        assert _keys(build_iterator(_split(out), 5 * MBS, MBS, 0, 1, None), 5) == before


def _resume(split, checkpoint_dir, settings):
    """loader_state.resume on ``checkpoint_dir`` (an ``iter_0000005`` under a load directory)."""
    load_dir = checkpoint_dir.parent
    return loader_state.resume(split, str(load_dir), int(checkpoint_dir.name[len("iter_") :]), 5 * MBS, settings)


@pytest.fixture
def saved_state(example_data, tmp_path):
    """An iteration directory holding DP rank 0's state after 3 micro-batches (no workers)."""
    _, out, _, _ = example_data
    split = _split(out)
    _keys(build_iterator(split, 0, MBS, 0, 1, None), 3)
    checkpoint_dir = tmp_path / "iter_0000005"
    checkpoint_dir.mkdir()
    loader_state.write_state(str(checkpoint_dir), 0, split.save_state())
    return out, checkpoint_dir


def test_the_state_file_is_tagged_json(saved_state):
    _, checkpoint_dir = saved_state
    text = open(loader_state.state_path(str(checkpoint_dir), 0)).read()
    stored = json.loads(text)
    assert set(stored) == {"settings", "loader", "sha256"}
    state = energon_state.loads(stored["loader"])
    assert type(state).__name__ == "SavableDataLoaderState" and state.micro_batch_size == MBS
    assert energon_state.dumps(state) == stored["loader"]  # reads back to the same value


@pytest.mark.parametrize(
    "change, why",
    [
        ("settings", "it was saved with other settings (dp_size 1 -> 2)"),
        ("edited", "does not match the checksum"),
        ("planted class", "'posix.system' is not an energon state class"),
        ("missing", "does not exist"),
        ("nested file", "is not a loader state: RecursionError"),
        ("nested state", "not an energon loader state: RecursionError"),
    ],
)
def test_an_unusable_state_restarts_the_stream_saying_why(saved_state, change, why):
    out, checkpoint_dir = saved_state
    path = loader_state.state_path(str(checkpoint_dir), 0)
    stored = json.load(open(path))
    settings = _settings(_split(out), 0)
    if change == "settings":
        settings["dp_size"] = 2
    elif change == "edited":
        stored["settings"]["seed"] = 7
        json.dump(stored, open(path, "w"))
    elif change == "planted class":  # a valid checksum over a state that names other code
        stored.pop("sha256")
        stored["loader"] = json.dumps({"$dataclass": "posix.system", "fields": {"command": "touch /tmp/owned"}})
        loader_state.write_state(str(checkpoint_dir), 0, stored)
    elif change == "nested file":  # brackets nested past Python's JSON reader
        open(path, "w").write("[" * 100_000 + "]" * 100_000)
    elif change == "nested state":  # the same inside a file whose checksum is right
        stored.pop("sha256")
        stored["loader"] = "[" * 100_000 + "]" * 100_000
        loader_state.write_state(str(checkpoint_dir), 0, stored)
    else:
        (checkpoint_dir / loader_state.STATE_DIR / "dp00000.json").unlink()
    split = _split(out)
    line = _resume(split, checkpoint_dir, settings)
    assert line.startswith("data loader: DP rank 0 restarts its stream from the beginning (") and why in line, line
    assert split._restore is None


@pytest.mark.parametrize("workers", [0, 1])
def test_a_state_with_positions_the_data_lacks_restarts_the_stream(example_data, workers, caplog):
    """Positions edited past the data and the checksum recomputed: the state reads, energon's first
    draw fails (IndexError, in a worker or here), and the stream starts again from its beginning."""
    import re

    _, out, _, _ = example_data
    saved = _split(out)
    batches = build_iterator(saved, 0, MBS, 0, 1, None, num_workers=workers)
    _keys(batches, 3)
    state = saved.save_state()
    state["loader"] = re.sub(r'("index": )\d+', r"\g<1>1000000000", state["loader"])
    resumed = _split(out)
    resumed.restore_state(state)
    fresh = _keys(build_iterator(_split(out), 0, MBS, 0, 1, None, num_workers=workers), 4)
    assert _keys(build_iterator(resumed, 3 * MBS, MBS, 0, 1, None, num_workers=workers), 4) == fresh
    assert "the saved loader state does not fit this dataset (IndexError" in caplog.text


def test_token_budget_rows_fill_the_budget_and_resume_exactly(example_data, tmp_path):
    """PACKING=tokens with energon: every micro-batch one row of at most ROW tokens (conversations
    padded to 4), several conversations a row, and a restored loader continues the rows (its
    packing buffer included) exactly."""
    from examples.multimodal_dev.data.energon import build_datasets

    _, out, _, processor = example_data
    row, options = (
        1024,
        dict(
            min_pixels=32 * 32,
            max_pixels=128 * 128,
            video_min_pixels=32 * 32,
            video_max_pixels=64 * 64,
            energon_packing_buffer_size=8,
        ),
    )

    def split():
        train, _, _ = build_datasets(4096, (1, 0, 0), data_path=str(out), hf_processor_path=processor, **options)
        train.pack_rows(row, 4)
        return train

    def rows(batches, n):
        return [next(batches)["rows"] for _ in range(n)]

    collate = lambda samples: {"rows": [tuple(s["input_ids"].tolist()) for s in samples], "stats": {}}  # noqa: E731
    saved = split()
    batches = build_iterator(saved, 0, 1, 0, 1, collate)
    before = rows(batches, 3)
    checkpoint_dir = tmp_path / "iter_0000003"
    checkpoint_dir.mkdir()
    loader_state.write_state(str(checkpoint_dir), 0, saved.save_state())
    after = rows(batches, 4)
    lengths = [[-(-len(ids) // 4) * 4 for ids in r] for r in before + after]
    print("padded conversation lengths per row:", lengths)
    assert all(sum(r) <= row or len(r) == 1 for r in lengths) and max(map(len, lengths)) > 1

    resumed = split()
    line = loader_state.resume(resumed, str(tmp_path), 3, 3, resumed.stream_settings(1, 0, 1, 0))
    assert "continues from" in line, line
    assert rows(build_iterator(resumed, 3, 1, 0, 1, collate), 4) == after


def test_building_and_drawing_leave_the_global_generator_alone(example_data):
    """megatron restores torch's generator before a resumed run builds its iterators; a draw there
    (torch's loader seeding its workers) would make the resumed run's dropout differ."""
    import torch

    torch.manual_seed(1234)
    before = torch.get_rng_state()
    _keys(build_iterator(_split(example_data[1]), 0, MBS, 0, 1, None), 2)
    assert torch.equal(torch.get_rng_state(), before)


def test_unknown_state_types_are_refused_when_saving():
    with pytest.raises(energon_state.StateFormatError, match=r"state\[0\]: a builtins.set"):
        energon_state.dumps([{1, 2}])
    with pytest.raises(energon_state.StateFormatError, match="unknown tag"):
        energon_state.loads(json.dumps({"$pickle": "gASVAAAAAAAAAAB9lC4="}))


def test_energon_workers_die_with_a_rank_killed_with_sigkill(example_data):
    from processes import assert_workers_die_with_rank

    _, out, _, _ = example_data
    assert_workers_die_with_rank(f"""
import time
from examples.multimodal_dev.data.loader import build_iterator
from tests.unit.test_energon_resume import _split
batches = build_iterator(_split({str(out)!r}), 0, 2, 0, 1, None, num_workers=2)
next(batches)
time.sleep(600)
""")

"""A checkpoint directory cannot run code: torch.distributed.checkpoint's two unpickling sites
(the ``.metadata`` index and non-tensor entries) refuse any global that is not checkpoint data,
while real checkpoints (tensors, megatron's args Namespace, numpy RNG state) still load."""

import os
import pickle
from argparse import Namespace
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from examples.multimodal_dev.checkpoint import safety as checkpoint_safety
from examples.multimodal_dev.megatron_changes import apply


class _Plant:
    """Unpickling this runs ``os.system`` (it would create ``path``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _save(directory, state):
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def _load(directory, state):
    apply("checkpoints-are-data")
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state


def test_real_checkpoint_content_still_loads(tmp_path):
    rng = np.random.RandomState(0).get_state()
    _save(tmp_path, {"weight": torch.arange(6.0), "args": Namespace(num_layers=4, lr=1e-3), "rng": rng})
    state = _load(tmp_path, {"weight": torch.zeros(6), "args": None, "rng": None})
    assert torch.equal(state["weight"], torch.arange(6.0)) and state["args"].num_layers == 4
    assert np.array_equal(state["rng"][1], rng[1])


def test_rerun_state_after_a_nan_loads_as_data(tmp_path):
    """megatron's rerun state machine re-saves the last checkpoint after a NaN with its state: a
    Call of a Caller (message, rank) and a diagnostic enum. That checkpoint must stay loadable."""
    from megatron.core.rerun_state_machine import Call, Caller, RerunDiagnostic

    call = Call(caller=Caller(message="found NaN in local grad norm", rank=0), sequence=3)
    state = {
        "failed_validation_call": call,
        "error_injector_checkpoint": {"injected": RerunDiagnostic.CORRECT_RESULT},
        "initial_result": torch.tensor(float("nan")),
    }
    _save(tmp_path, {"rerun_state_machine": state})
    template = {
        "failed_validation_call": None,
        "error_injector_checkpoint": {"injected": None},
        "initial_result": torch.zeros(()),
    }
    loaded = _load(tmp_path, {"rerun_state_machine": template})["rerun_state_machine"]
    assert loaded["failed_validation_call"] == call and isinstance(loaded["failed_validation_call"].caller, Caller)
    assert loaded["error_injector_checkpoint"]["injected"] is RerunDiagnostic.CORRECT_RESULT


def test_planted_metadata_is_refused(tmp_path):
    _save(tmp_path, {"weight": torch.ones(2)})
    marker = tmp_path / "ran"
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Plant(marker), f)
    with pytest.raises(BaseException) as err:  # DCP wraps reader errors in its CheckpointException (a BaseException)
        _load(tmp_path, {"weight": torch.zeros(2)})
    assert checkpoint_safety.refusal(err.value).startswith("checkpoint refused: ")
    assert checkpoint_safety.refusal(err.value) == (
        f"checkpoint refused: {tmp_path / '.metadata'}: it names 'posix.system', which is not checkpoint data "
        "(a checkpoint must never run code)"
    )
    assert not marker.exists()


def test_planted_entry_is_refused(tmp_path):
    marker = tmp_path / "ran"
    _save(tmp_path, {"weight": torch.ones(2), "extra": _Plant(marker)})
    assert not marker.exists()
    with pytest.raises(BaseException) as err:
        _load(tmp_path, {"weight": torch.zeros(2), "extra": None})
    assert "checkpoint entry 'extra': it names 'posix.system'" in checkpoint_safety.refusal(err.value)
    assert not marker.exists()


def test_an_entry_overwritten_on_disk_is_named_not_taken_for_code(tmp_path):
    """4 KiB overwritten over a pickled entry in a ``.distcp``: torch's data-only reader fails; the
    line says the file cannot be read, not that it holds code, and never torch's advice to load it
    with weights_only=False."""
    _save(tmp_path, {"weight": torch.ones(2), "args": Namespace(padding="x" * 8000)})
    (shard,) = tmp_path.glob("*.distcp")
    with open(shard, "r+b") as f:
        f.write(os.urandom(4096))
    with pytest.raises(BaseException) as err:
        _load(tmp_path, {"weight": torch.zeros(2), "args": None})
    line = checkpoint_safety.refusal(err.value)
    assert line.startswith("checkpoint refused: checkpoint entry 'args': not readable as checkpoint data (")
    assert line.endswith("(a damaged or foreign file: restore it, or load another checkpoint)") and "\n" not in line


@pytest.mark.parametrize("torch_save", [True, False], ids=["torch.save", "pickle"])
def test_torch_loads_failure_is_one_line_without_its_advice(tmp_path, torch_save):
    """``load_failure``: a planted global is named; a raw pickle torch cannot read says why."""
    marker, path = tmp_path / "ran", tmp_path / "common.pt"
    if torch_save:
        torch.save({"args": _Plant(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"args": _Plant(marker)}, protocol=4))
    with pytest.raises(pickle.UnpicklingError) as err:
        torch.load(path, weights_only=True)
    line = str(checkpoint_safety.load_failure(str(path), err.value))
    assert "weights_only" not in line and "\n" not in line and line.startswith(f"checkpoint refused: {path}: ")
    if torch_save:
        assert line == f"checkpoint refused: {path}: it names 'posix.system', which is not checkpoint data " + (
            "(a checkpoint must never run code)"
        )
    assert checkpoint_safety.refusal(RuntimeError(f"wrapped: {line}\nmore")) == line
    assert not marker.exists()


def test_damaged_tracker_file_is_named(tmp_path):
    checkpoint_safety.check_tracker(str(tmp_path))  # none yet: a fresh run
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    checkpoint_safety.check_tracker(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("\x00garbage")
    with pytest.raises(
        ValueError,
        match=r"--load .*latest_checkpointed_iteration.txt holds '\\x00garbage', "
        r"not an iteration number",
    ):
        checkpoint_safety.check_tracker(str(tmp_path))


def test_a_checkpoint_of_another_shape_is_named_before_loading(tmp_path, mcore):
    """A dense checkpoint loaded by an MoE run gave a KeyError listing every tensor; the stored args
    are compared first and the differing ones named."""
    from hf_checkpoints import write_hf_checkpoint

    from examples.multimodal_dev.checkpoint.hf_import import import_hf
    from examples.multimodal_dev.checkpoint.run_shape import check_checkpoint_matches
    from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant

    write_hf_checkpoint(tmp_path / "hf", get_variant("tiny", moe=False), dtype=torch.float32)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    check_checkpoint_matches(str(tmp_path / "ckpt"), get_variant("tiny", moe=False))
    with pytest.raises(
        ValueError,
        match=r"\(iter_0000000\) was saved from another model: num_experts 0 \(checkpoint\) "
        r"vs 4 \(this run\)",
    ):
        check_checkpoint_matches(str(tmp_path / "ckpt"), get_variant("tiny", moe=True))
    with pytest.raises(ValueError, match="the run trains an MTP head"):
        check_checkpoint_matches(str(tmp_path / "ckpt"), get_variant("tiny", moe=False, mtp=True))
    # fields megatron's flags do not carry: compared through the shape the checkpoint was imported from
    tiny = get_variant("tiny", moe=False)
    deeper = replace(tiny, vision=replace(tiny.vision, depth=tiny.vision.depth + 1))
    with pytest.raises(
        ValueError,
        match=rf"another model: vision.depth {tiny.vision.depth} \(checkpoint\) vs "
        rf"{tiny.vision.depth + 1} \(this run\)",
    ):
        check_checkpoint_matches(str(tmp_path / "ckpt"), deeper)
    heads = replace(tiny, text=replace(tiny.text, linear_num_value_heads=2 * tiny.text.linear_num_value_heads))
    with pytest.raises(ValueError, match=r"text.linear_num_value_heads \d+ \(checkpoint\) vs \d+ \(this run\)"):
        check_checkpoint_matches(str(tmp_path / "ckpt"), heads)

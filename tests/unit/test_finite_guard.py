"""A save with NaN or inf weights is refused, naming the tensor and the checkpoint that stays the
latest; a save with finite weights goes through untouched (the save hooks, as the training loop
calls them)."""

import pytest
import torch

from examples.multimodal_dev.checkpoint import finite_guard, save_hooks


class Args:
    save = None


def _chunks():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), torch.nn.Linear(2, 2)]


def test_finite_weights_are_saved():
    saved = []
    guarded = save_hooks.with_save_hooks(
        lambda it, model, *a, **k: saved.append((it, a, k)) or "done", get_args=lambda: Args
    )
    assert guarded(3, _chunks(), "optimizer", checkpointing_context={}) == "done"
    assert saved == [(3, ("optimizer",), {"checkpointing_context": {}})]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_weight_stops_the_save(tmp_path, bad):
    chunks = _chunks()
    with torch.no_grad():
        chunks[1].bias[1] = bad
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    Args.save = str(tmp_path)
    saved = []
    with pytest.raises(
        SystemExit,
        match=r"iteration 5 has NaN or inf weights \(1 tensor\(s\) on this rank, e\.g\. "
        r"bias\); not saved: iteration 4 stays the latest checkpoint",
    ):
        save_hooks.with_save_hooks(lambda *a, **k: saved.append(a), get_args=lambda: Args)(5, chunks)
    assert saved == []
    assert finite_guard.nonfinite_parameters(chunks) == ["bias"]
    assert finite_guard.nonfinite_parameters(_chunks()) == []

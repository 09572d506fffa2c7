"""The base of an adapters-only LoRA checkpoint is checked as any checkpoint loaded is (docs/lora.md,
"Training and checkpoints"), by each reader of it: a resume (``record_base``, which the training
script's checks run), generating and serving (``load_for_generation``) and ``export-peft``.

- A base damaged on disk (4 KiB overwritten inside a weight) is refused by its checksums.
- Another base at the recorded path (one element of the largest weight changed, as a re-import of a
  newer revision would be) is refused by the fingerprint, which covers every byte.
- A moved base is found again by ``--lora-base`` alone: the model's config comes from the adapters
  checkpoint (or, for one saved before it recorded it, from the base's folder), not from a recorded
  ``--hf-config-path`` that moved with the base.

A tiny dense model in fp32, saved in-process as a LoRA run saves (the adapters alone): seconds.
"""

import contextlib
import copy
import json
import os
import shutil
from argparse import Namespace

import pytest
import torch

from examples.multimodal_dev.checkpoint.adapters_from_base import record_base
from examples.multimodal_dev.checkpoint.adapters_only import HF_CONFIG_RECORDED, sampled_fingerprint
from examples.multimodal_dev.checkpoint.files import save_model_checkpoint, stored_args
from examples.multimodal_dev.checkpoint.hf_conversion import HF_CONFIG, checkpoint_shape
from examples.multimodal_dev.generation.loading import Layout, load_for_generation
from examples.multimodal_dev.lora import apply as lora
from examples.multimodal_dev.lora.targets import DEFAULT_TARGETS
from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.models.megatron_args import one_process_checkpoint_args
from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.tools.convert_checkpoint import main

RANK, ALPHA = 4, 8.0


class _AdaptersOnly:
    """The model's state as a LoRA run's save writes it (``adapters_only.without_frozen_base``): every
    tensor whose storage is a frozen parameter's left out."""

    def __init__(self, model):
        self.model = model

    def sharded_state_dict(self):
        frozen = {p.untyped_storage().data_ptr() for p in self.model.parameters() if not p.requires_grad}
        state = self.model.sharded_state_dict()
        data = {k: getattr(v, "data", None) for k, v in state.items()}
        return {
            k: v
            for k, v in state.items()
            if not (isinstance(data[k], torch.Tensor) and data[k].untyped_storage().data_ptr() in frozen)
        }


def _run_args(shape, save, hf_config, **extra):
    """The args a training run saves with its checkpoints (those the checks and the tools read)."""
    fields = dict(model_variant="tiny", variant_moe="auto", hf_processor_path=None)
    return one_process_checkpoint_args(shape, str(save), str(hf_config), **fields, **extra)


def _import(root, shape, model, then=None):
    """A base as ``convert_checkpoint import`` leaves it at ``root``: hf_config.json beside iteration 0
    (then moved to ``then``: an import at the same path, later replaced)."""
    os.makedirs(root)
    with open(root / HF_CONFIG, "w") as f:
        json.dump(model_of(shape).shape_to_hf(shape), f)
    save_model_checkpoint(_run_args(shape, root, root / HF_CONFIG), 0, model)
    if then is not None:
        os.rename(root, then)


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory, mcore):
    """(root: base/ (an import), other/ (the same with one weight element changed), same/ (the same
    weights imported again), lora/ (the adapters,
    saved as a LoRA run from base/ saves them), old/ (the same adapters with the fingerprint and args
    of a save before the full fingerprint), the adapted model's state)."""
    root = tmp_path_factory.mktemp("lora_base")
    shape = get_variant("tiny")
    model = build_model(shape).eval()
    largest = max(model.parameters(), key=torch.Tensor.numel)
    with torch.no_grad():
        was = largest.view(-1)[largest.numel() // 2].item()
        largest.view(-1)[largest.numel() // 2] = was + 1.0  # a newer revision's weights: one element apart
        _import(root / "base", shape, model, then=root / "other")
        largest.view(-1)[largest.numel() // 2] = was
    _import(root / "base", shape, model, then=root / "same")  # the same weights imported again
    _import(root / "base", shape, model)
    lora.apply(model, RANK, ALPHA, 0.0, DEFAULT_TARGETS, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    lora_args = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(DEFAULT_TARGETS), lora_dropout=0.0)
    args = _run_args(shape, root / "lora", root / "base" / HF_CONFIG, **lora_args)
    args.load, args.pretrained_checkpoint, args.lora_base_path = str(root / "base"), None, None
    record_base(args)  # as the training script's checks do: the base named, fingerprinted
    save_model_checkpoint(args, 1, _AdaptersOnly(model))
    old = copy.copy(args)
    old.save, old.lora_base_fingerprint = str(root / "old"), sampled_fingerprint(args.lora_base)
    vars(old).pop(HF_CONFIG_RECORDED, None)  # saved before the config was kept with the adapters
    save_model_checkpoint(old, 1, _AdaptersOnly(model))
    return root, {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def _resume(path, moved=None):
    """What a resume of the LoRA checkpoint at ``path`` checks of its base (``checked_args``)."""
    record_base(Namespace(lora_rank=RANK, load=str(path), pretrained_checkpoint=None, lora_base_path=moved))


def _export_peft(path, out, *extra):
    return main(["export-peft", "--megatron-path", str(path), "--peft-path", str(out), *extra])


def _each_reader_refuses(root, tmp_path, capsys, message):
    """A resume, generating / serving and export-peft each stop in one line naming ``message``."""
    with pytest.raises(ValueError) as resumed:
        _resume(root / "lora")
    assert message in str(resumed.value), resumed.value
    with pytest.raises(ValueError) as generated:
        load_for_generation(str(root / "lora"), None, None, Layout())
    assert message in str(generated.value), generated.value
    capsys.readouterr()
    assert _export_peft(root / "lora", tmp_path / "peft") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


@contextlib.contextmanager
def _in_place_of(folder, replacement):
    """``replacement``'s copy where ``folder`` is, ``folder`` put back afterwards."""
    aside = f"{folder}.aside"
    os.rename(folder, aside)
    try:
        shutil.copytree(replacement, folder)
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(aside, folder)


def _largest_tensor_bytes(directory):
    """(shard file, offset) of the middle of the largest tensor's bytes in ``directory``."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(directory)).read_metadata().storage_data.values()
    info = max(storage, key=lambda i: i.length)
    return directory / info.relative_path, info.offset + info.length // 2


def test_the_adapters_load_on_their_base(lora_ckpt, tmp_path):
    root, state = lora_ckpt
    model, *_ = load_for_generation(str(root / "lora"), None, None, Layout())
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items()), [
        k for k, v in state.items() if not torch.equal(loaded[k], v)
    ][:3]
    assert _export_peft(root / "lora", tmp_path / "peft") == 0
    assert stored_args(str(root / "lora" / "iter_0000001")).lora_base_fingerprint.startswith("crc32:")


def test_a_damaged_base_is_refused_by_its_checksums(lora_ckpt, tmp_path, capsys):
    """4 KiB overwritten inside the base's largest weight (a failing disk, a broken copy): loaded
    directly, the base is refused by its checksums; as the adapters' base, the same."""
    root, _ = lora_ckpt
    directory = root / "base" / "iter_0000000"
    shard, offset = _largest_tensor_bytes(directory)
    with open(shard, "r+b") as f:
        f.seek(offset)
        saved = f.read(4096)
        f.seek(offset)
        f.write(bytes(255 - b for b in saved))
    try:
        _each_reader_refuses(root, tmp_path, capsys, f"their base {directory} is damaged: {shard} is not the file")
    finally:
        with open(shard, "r+b") as f:
            f.seek(offset)
            f.write(saved)


def test_another_base_at_the_recorded_path_is_refused(lora_ckpt, tmp_path, capsys):
    """The base replaced by an import of the same model with one element of its largest weight
    changed: the same names, shapes and smallest tensors, other bytes."""
    root, _ = lora_ckpt
    directory = root / "base" / "iter_0000000"
    with _in_place_of(root / "base", root / "other"):
        _each_reader_refuses(
            root, tmp_path, capsys, f"their base {directory} is not the checkpoint they were trained on"
        )


def test_the_same_weights_imported_again_are_the_same_base(lora_ckpt, tmp_path, capsys):
    """A re-import of the same Hugging Face weights at the same path: only DCP's index differs (a new
    save id), and every reader takes it."""
    root, _ = lora_ckpt
    with _in_place_of(root / "base", root / "same"):
        _resume(root / "lora")
        assert _export_peft(root / "lora", tmp_path / "peft") == 0, capsys.readouterr().err


def test_a_moved_base_is_found_by_lora_base_alone(lora_ckpt, tmp_path, capsys):
    """The base's folder moved, its hf_config.json (the run's --hf-config-path) with it: --lora-base
    (LORA_BASE) alone finds it again, for a checkpoint that keeps its config and for one saved before
    it did (the config read from the base's folder)."""
    root, _ = lora_ckpt
    moved = tmp_path / "moved"
    os.rename(root / "base", moved)
    try:
        assert not os.path.exists(stored_args(str(root / "lora" / "iter_0000001")).hf_config_path)
        for name in ("lora", "old"):
            assert _export_peft(root / name, tmp_path / f"peft_{name}", "--lora-base", str(moved)) == 0, (
                name,
                capsys.readouterr().err,
            )
            _resume(root / name, str(moved))
        # the checks generating and serving make before any rank starts, which name no base
        assert checkpoint_shape(str(root / "lora"))[0] == get_variant("tiny")
        model, *_ = load_for_generation(str(root / "lora"), None, str(moved), Layout())
        assert model is not None
    finally:
        os.rename(moved, root / "base")


def test_an_older_checkpoint_is_checked_by_its_fingerprint_and_the_checksums(lora_ckpt, tmp_path, capsys):
    """Saved before the full fingerprint: it still loads on its base; a damaged base is refused by
    the base's checksums all the same."""
    root, _ = lora_ckpt
    assert not stored_args(str(root / "old" / "iter_0000001")).lora_base_fingerprint.startswith("crc32:")
    assert _export_peft(root / "old", tmp_path / "peft") == 0
    _resume(root / "old")

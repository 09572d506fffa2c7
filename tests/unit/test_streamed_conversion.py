"""The checkpoint tools hold a bounded part of the model, and write what the whole-model tools wrote.

- safetensors shards written tensor by tensor are byte for byte ``safetensors.save_file``'s;
- the HF source serves experts in either layout, and names what a set of names leaves unread;
- a streamed import stores every tensor bitwise as a model held whole and saved by megatron-core's
  ``dist_checkpointing.save`` does, with the same index; its files are cut at ``FILE_BYTES``;
- a streamed export's files are byte for byte those of the whole-model export (the model loaded at
  TP = 1, every rule run on it, shards written by ``save_file``), while no read takes more than
  ``READ_BYTES`` beyond one tensor;
- verify holds one decoder layer of each model at a time, beside the vision tower and embedding.
"""

import json
import os
import random
import re

import pytest
import torch
from hf_checkpoints import write_hf_checkpoint
from safetensors.torch import save_file

from examples.multimodal_dev.checkpoint import hf_export, streamed_save
from examples.multimodal_dev.checkpoint.hf_conversion import conversion_model, load_megatron_with_lora
from examples.multimodal_dev.checkpoint.hf_export import export_hf
from examples.multimodal_dev.checkpoint.hf_import import import_hf
from examples.multimodal_dev.checkpoint.hf_safetensors import HFTensorSource
from examples.multimodal_dev.checkpoint.safetensors_writer import _CODES, Planned, write_shard
from examples.multimodal_dev.checkpoint.streamed_load import CheckpointTensors
from examples.multimodal_dev.models import model_of
from examples.multimodal_dev.models.megatron_args import one_process_checkpoint_args
from examples.multimodal_dev.models.qwen35_vl.configuration import from_hf_config, get_variant
from examples.multimodal_dev.tools.convert_checkpoint import main


@pytest.fixture(scope="module", params=["dense", "moe"])
def hf_checkpoint(request, tmp_path_factory, mcore):
    moe = request.param == "moe"
    path = tmp_path_factory.mktemp(f"streamed_{request.param}")
    write_hf_checkpoint(path, get_variant("tiny", moe=moe, mtp=True), experts_per_expert=moe)
    return request.param, str(path)


def test_shards_written_tensor_by_tensor_are_save_files_bytes(tmp_path):
    rng = random.Random(0)
    for trial in range(20):
        tensors = {}
        for i in range(rng.randint(1, 10)):
            dtype = rng.choice(list(_CODES))
            shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
            name = rng.choice(["a", "model.x", "layers.1.", "layers.10", "Z"]) + str(i)
            tensors[name] = (torch.randn(shape) * 10).to(dtype)
        save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
        planned = [Planned(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
        write_shard(str(tmp_path / "ours.safetensors"), planned, lambda p: [tensors[p.name]])
        ref, ours = (tmp_path / "ref.safetensors").read_bytes(), (tmp_path / "ours.safetensors").read_bytes()
        assert ours == ref, (trial, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})


def test_the_source_serves_experts_in_either_layout(tmp_path):
    gate_up, down = torch.randn(3, 4, 5).bfloat16(), torch.randn(3, 5, 2).bfloat16()
    packed, hub = tmp_path / "packed", tmp_path / "hub"
    for d in (packed, hub):
        d.mkdir()
    save_file({"m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}, packed / "model.safetensors")
    per_expert = {}
    for e in range(3):
        per_expert[f"m.experts.{e}.gate_proj.weight"], per_expert[f"m.experts.{e}.up_proj.weight"] = gate_up[e].chunk(2)
        per_expert[f"m.experts.{e}.down_proj.weight"] = down[e]
    save_file({k: v.contiguous() for k, v in per_expert.items()}, hub / "model.safetensors")
    for folder in (packed, hub):
        source = HFTensorSource(str(folder))
        assert torch.equal(source.get("m.experts.gate_up_proj"), gate_up)
        assert torch.equal(source.get("m.experts.down_proj"), down)
        for name, tensor in per_expert.items():
            assert torch.equal(source.get(name), tensor), name
            assert source.meta(name).shape == tensor.shape
        assert torch.equal(
            source.get("m.experts.1.up_proj.weight", torch.float32), per_expert["m.experts.1.up_proj.weight"].float()
        )
    source = HFTensorSource(str(packed))
    some = [n for n in per_expert if ".2." not in n]
    assert source.unconsumed(some) == ["m.experts.down_proj", "m.experts.gate_up_proj"]  # expert 2 left unread
    assert source.unconsumed(per_expert) == []


def _whole_model_import(hf_path: str, out: str, shape):
    """What the import wrote before it streamed: the model held in memory with the HF tensors in their
    dtypes, saved by megatron-core's own dist_checkpointing.save."""
    from examples.multimodal_dev.checkpoint.files import save_model_checkpoint

    source = HFTensorSource(hf_path)
    model = conversion_model(shape)
    params = dict(model.named_parameters())
    for rule in model_of(shape).hf_mapping_rules(shape):
        for name, tensor in zip(rule.megatron, rule.to_megatron([source.get(n) for n in rule.hf])):
            params[name].data = tensor.contiguous()
    config = os.path.join(out, "hf_config.json")
    save_model_checkpoint(one_process_checkpoint_args(shape, out, os.path.abspath(config)), 0, model)


def _stored(directory: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader, load

    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if hasattr(m, "properties")}
    load(state, checkpoint_id=directory, no_dist=True)
    return {k: (metadata[k], t) for k, t in state.items()}


def test_a_streamed_import_stores_what_the_whole_model_saved(hf_checkpoint, tmp_path, monkeypatch):
    kind, hf_path = hf_checkpoint
    shape = from_hf_config(hf_path)
    _whole_model_import(hf_path, str(tmp_path / "whole"), shape)
    monkeypatch.setattr(streamed_save, "FILE_BYTES", 1 << 20)  # several files, as a large model's
    import_hf(hf_path, str(tmp_path / "streamed"))
    whole, streamed = (_stored(str(tmp_path / d / "iter_0000000")) for d in ("whole", "streamed"))
    assert streamed.keys() == whole.keys()
    for key, (meta, tensor) in whole.items():
        assert streamed[key][0] == meta, key  # shape, dtype, chunks: the same index
        assert torch.equal(streamed[key][1], tensor), key
    files = [n for n in os.listdir(tmp_path / "streamed" / "iter_0000000") if n.endswith(".distcp")]
    print(f"{kind}: {len(whole)} tensors stored bitwise as the whole-model save, in {len(files)} files")
    assert len(files) > 2


def _whole_model_export(megatron_path: str, out, max_shard_bytes: int) -> list[str]:
    """The export before it streamed: the model loaded whole (fp32), every rule run on it, each tensor
    cast to its stored dtype, experts split per expert, shards cut in order and written by save_file."""
    model, shape, _, dtypes, _ = load_megatron_with_lora(megatron_path)
    state = model_of(shape).hf_model_state(model)
    shards, size = [{}], 0
    for rule in model_of(shape).hf_mapping_rules(shape, per_expert=True):
        for name, tensor in zip(rule.hf, rule.to_hf([state[n] for n in rule.megatron])):
            tensor = tensor.to(dtypes[rule.megatron[0]]).contiguous()
            if shards[-1] and size + tensor.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += tensor.nbytes
    os.makedirs(out)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
    return names


def test_a_streamed_export_writes_the_whole_model_exports_bytes(hf_checkpoint, tmp_path, monkeypatch):
    kind, hf_path = hf_checkpoint
    import_hf(hf_path, str(tmp_path / "mg"))
    names = _whole_model_export(str(tmp_path / "mg"), tmp_path / "whole", 1 << 20)
    largest = max(4 * p.numel() for p in conversion_model(from_hf_config(hf_path)).parameters())
    reads, real_read = [], CheckpointTensors.read

    def counted(self, wanted, dtype=None):
        reads.append(self.nbytes(wanted, dtype))
        return real_read(self, wanted, dtype)

    monkeypatch.setattr(CheckpointTensors, "read", counted)
    monkeypatch.setattr(hf_export, "READ_BYTES", 1 << 16)
    export_hf(str(tmp_path / "mg"), str(tmp_path / "streamed"), max_shard_bytes=1 << 20)
    written = sorted(n for n in os.listdir(tmp_path / "streamed") if n.endswith(".safetensors"))
    assert written == names and len(names) > 2
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    print(f"{kind}: {len(names)} shards byte for byte; {len(reads)} reads, the largest {max(reads)} bytes")
    assert len(reads) > 20 and max(reads) <= max(1 << 16, largest)


def test_verify_holds_a_layer_at_a_time(hf_checkpoint, tmp_path, monkeypatch, capsys):
    from examples.multimodal_dev.checkpoint.streamed_forward import StreamedWeights

    kind, hf_path = hf_checkpoint
    import_hf(hf_path, str(tmp_path / "mg"))
    held, real_put = [], StreamedWeights._put

    def put(self, unit):
        real_put(self, unit)

        def in_memory(names):  # the bytes of the weights that are in, not on the meta device
            params = [self.model.get_parameter(n) for n in names]
            return sum(p.numel() * p.element_size() for p in params if not p.is_meta)

        resident = [n for u in self.resident for n in self.of_unit[u]]
        beyond = in_memory([n for n, _ in self.model.named_parameters() if n not in set(resident)])
        held.append((unit, beyond, in_memory(self.of_unit[unit])))

    monkeypatch.setattr(StreamedWeights, "_put", put)
    assert main(["verify", "--hf-path", hf_path, "--megatron-path", str(tmp_path / "mg")]) == 0
    assert re.search(r"verify: .* PASS", capsys.readouterr().out)
    # beside the resident units, only the unit that runs: each layer's weights go before the next come
    streamed = [(unit, beyond, size) for unit, beyond, size in held if ".layers." in unit]
    assert streamed and all(beyond == size for _, beyond, size in streamed), streamed
    layers = {unit for unit, _, _ in streamed}
    assert len(streamed) == 2 * len(layers)  # every layer of both models, once per built-in batch


def test_a_checkpoint_saved_by_save_pretrained_imports_without_an_mtp_head(tmp_path, mcore, capsys):
    """transformers' Qwen3.5 has no MTP module: save_pretrained writes no mtp.* while config.json
    still counts one layer. The import says so in one line and describes the model without it."""
    from hf_reference import build_hf_model

    shape = get_variant("tiny", moe=False, mtp=True)
    hf = build_hf_model(shape).to(torch.bfloat16)
    hf.config.dtype = torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert json.load(open(tmp_path / "hf" / "config.json"))["text_config"]["mtp_num_hidden_layers"] == 1
    mg, out = str(tmp_path / "mg"), str(tmp_path / "out")
    assert main(["import", "--hf-path", str(tmp_path / "hf"), "--megatron-path", mg]) == 0
    said = capsys.readouterr().out
    assert said.count("holds no MTP head") == 1 and "imported without it" in said, said
    assert json.load(open(os.path.join(mg, "hf_config.json")))["text_config"]["mtp_num_hidden_layers"] == 0
    assert not any(".mtp." in k for k in _stored(os.path.join(mg, "iter_0000000")))
    assert main(["verify", "--hf-path", str(tmp_path / "hf"), "--megatron-path", mg]) == 0
    assert main(["export", "--megatron-path", mg, "--hf-path", out]) == 0
    back = HFTensorSource(out)
    assert back.names == HFTensorSource(str(tmp_path / "hf")).names
    # a head present in part is another checkpoint's mistake: refused as before (test_convert_checkpoint)

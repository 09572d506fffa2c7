"""A downloaded energon dataset is data: YAML that asks energon to import, call or load code is
refused in one line naming the file and key before energon reads it, and energon's own resolver
refuses it too when a file reaches energon unchecked. Each planted file would run ``touch
MARKER`` through energon's typed converter; the tests check the marker never appears."""

import shutil

import pytest

from examples.multimodal_dev.data import energon
from examples.multimodal_dev.data.energon_configs import MAX_DEPTH, check_dataset
from examples.multimodal_dev.data.sample import DataError

CRUDE = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"


def system_call(marker, indent=""):
    return f'{indent}__module__: os\n{indent}__function__: system\n{indent}command: "touch {marker}"\n'


def planted(example_data, tmp_path, dataset_yaml: str):
    """A copy of the example shards whose dataset.yaml is ``dataset_yaml``."""
    _, out, _, _ = example_data
    folder = tmp_path / "shards"
    shutil.copytree(out, folder)
    (folder / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml)
    return folder


def attacks(marker):
    return {
        "subflavors": CRUDE + "subflavors:\n  x:\n" + system_call(marker, "    "),
        "part_filter": CRUDE + "part_filter:\n" + system_call(marker, "  "),
        "root_function": system_call(marker),
        "sample_loader": CRUDE + "sample_loader: loader.py:sample_loader\npart_filter: [json]\n",
        "other_class": "__module__: megatron.energon\n__class__: CaptioningWebdataset\n"
        "subflavors:\n  x:\n" + system_call(marker, "    "),
    }


@pytest.mark.parametrize(
    "attack, where",
    [
        ("subflavors", "subflavors.x names os.system"),
        ("part_filter", "part_filter names os.system"),
        ("root_function", "the root names os.system"),
        ("sample_loader", "sample_loader runs a Python file"),
        ("other_class", "the root names megatron.energon.CaptioningWebdataset"),
    ],
)
def test_dataset_yaml_naming_code_is_refused_before_energon_reads_it(example_data, tmp_path, attack, where):
    marker = tmp_path / "MARKER"
    folder = planted(example_data, tmp_path, attacks(marker)[attack])
    (folder / ".nv-meta" / "loader.py").write_text(f"open({str(marker)!r}, 'w')\n")
    with pytest.raises(DataError) as refused:
        energon.check_energon_path(str(folder))
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "dataset.yaml" in message and where in message, message
    assert not marker.exists()


@pytest.mark.parametrize("attack", ["subflavors", "part_filter", "root_function", "other_class"])
def test_energons_resolver_refuses_code_the_walk_never_saw(example_data, tmp_path, attack):
    """The second guard alone: the planted dataset handed straight to energon's loader (a
    ``sample_loader`` needs a class outside the allowed ones, which the resolver refuses first; its
    Python-file loader is refused in the next test)."""
    marker = tmp_path / "MARKER"
    folder = planted(example_data, tmp_path, attacks(marker)[attack])
    (folder / ".nv-meta" / "loader.py").write_text(f"open({str(marker)!r}, 'w')\n")
    config = energon.worker_config(0, 1, 0)
    with pytest.raises(DataError, match="a dataset's YAML is data"):
        dataset = energon.open_dataset(str(folder), "train", config, energon.ConversationEncoder(), None, True)
        next(iter(energon.get_loader(dataset, worker_config=config)))
    assert not marker.exists()


def test_energons_python_file_loader_is_refused(tmp_path):
    from megatron.energon.module_loader import ModuleLoader

    from examples.multimodal_dev.megatron_changes import apply

    marker = tmp_path / "MARKER"
    (tmp_path / "loader.py").write_text(f"open({str(marker)!r}, 'w')\ndef sample_loader(raw):\n    return raw\n")
    apply("energon-refuses-code")
    with pytest.raises(DataError, match="asks to run the Python file .*loader.py"):
        ModuleLoader().get_function("loader.py:sample_loader", relative_path=tmp_path)
    assert not marker.exists()


def test_a_metadataset_is_checked_with_every_dataset_it_names(example_data, tmp_path):
    marker = tmp_path / "MARKER"
    good = tmp_path / "good"
    shutil.copytree(example_data[1], good)
    bad = planted(example_data, tmp_path, attacks(marker)["subflavors"])
    blend = tmp_path / "blend.yaml"
    entries = "      - weight: 1\n        path: good\n"
    blend.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n" + entries
    )
    check_dataset(str(blend))  # the allowed form passes
    blend.write_text(blend.read_text() + f"      - weight: 1\n        path: {bad.name}\n")
    with pytest.raises(DataError, match=r"shards/.nv-meta/dataset.yaml: subflavors.x names os.system"):
        energon.check_energon_path(str(blend))
    blend.write_text(
        blend.read_text().replace(
            "    blend:\n",
            "    blend:\n      - weight: 1\n"
            "        path: good\n        subflavors:\n"
            "          y:\n" + system_call(marker, "            "),
            1,
        )
    )
    with pytest.raises(DataError, match=r"blend.yaml: splits.train.blend\[0\].subflavors.y names os.system"):
        energon.check_energon_path(str(blend))
    assert not marker.exists()


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "        path: good\n        split_config: ../../../etc/split.yaml\n",
            "split_config '../../../etc/split.yaml' must be a file name",
        ),
        ("        path: good\n        aux:\n          f: filesystem:///etc\n", "aux reads files outside the dataset"),
        ("        path: nowhere\n", "it names 'nowhere', which does not exist"),
    ],
)
def test_metadataset_entries_that_reach_outside_are_refused(example_data, tmp_path, entry, message):
    shutil.copytree(example_data[1], tmp_path / "good")
    blend = tmp_path / "blend.yaml"
    blend.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 1\n" + entry
    )
    with pytest.raises(DataError, match=message):
        energon.check_energon_path(str(blend))


def test_a_deeply_nested_or_unreadable_config_is_one_line(example_data, tmp_path):
    deep = (
        CRUDE
        + "subflavors:\n"
        + "".join(f"{'  ' * (i + 1)}k{i}:\n" for i in range(MAX_DEPTH + 2))
        + "  " * (MAX_DEPTH + 3)
        + "v: 1\n"
    )
    with pytest.raises(DataError, match=f"nests deeper than {MAX_DEPTH} levels"):
        energon.check_energon_path(str(planted(example_data, tmp_path / "a", deep)))
    with pytest.raises(DataError, match="dataset.yaml: not readable YAML/JSON"):
        energon.check_energon_path(str(planted(example_data, tmp_path / "b", "a: [1, 2\nb: {")))


@pytest.mark.parametrize(
    "file, text, says",
    [
        ("split.yaml", "split_parts: 5\n", "split.yaml: split_parts must be a mapping, got int"),
        ("split.yaml", "- a\n- b\n", "split.yaml: the file must be a mapping, got list"),
        (
            "split.yaml",
            "split_parts:\n  train:\n  - nope-000000.tar\nexclude: []\n",
            "energon cannot read this dataset's metadata (KeyError: 'nope-000000.tar')",
        ),
        (
            ".info.json",
            '{"shard_counts": {"train-000000.tar": 4}}',
            "energon cannot read this dataset's metadata (KeyError: 'train-000001.tar')",
        ),
        (".info.json", '{"shard_counts": 5}', "energon cannot read this dataset's metadata (JsonValueError: "),
        ("dataset.yaml", CRUDE + "foo: 1\n", "unexpected keyword argument 'foo'"),
    ],
)
def test_tampered_metadata_is_one_line_naming_the_dataset(example_data, tmp_path, file, text, says):
    folder = planted(example_data, tmp_path, CRUDE)
    (folder / ".nv-meta" / file).write_text(text)
    with pytest.raises(DataError) as refused:
        energon.check_energon_path(str(folder))
        energon.available_splits(str(folder))
        config = energon.worker_config(0, 1, 0)
        energon.open_dataset(str(folder), "train", config, energon.ConversationEncoder(), None, True)
    assert says in str(refused.value) and "\n" not in str(refused.value), refused.value


def _blend(path, *targets):
    path.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        + "".join(f"      - weight: 1\n        path: {t}\n" for t in targets)
    )
    return path


def test_a_metadataset_that_includes_itself_is_one_line(example_data, tmp_path):
    """energon follows the cycle until RecursionError; a dataset blended twice is no cycle."""
    shutil.copytree(example_data[1], tmp_path / "good")
    check_dataset(str(_blend(tmp_path / "twice.yaml", "good", "good")))
    _blend(tmp_path / "self.yaml", "good", "self.yaml")
    with pytest.raises(DataError, match=r"self.yaml: includes itself \(.*self.yaml -> .*self.yaml\)$"):
        energon.check_energon_path(str(tmp_path / "self.yaml"))
    _blend(tmp_path / "a.yaml", "b.yaml")
    _blend(tmp_path / "b.yaml", "good", "a.yaml")
    with pytest.raises(DataError, match=r"includes itself \(.*a.yaml -> .*b.yaml -> .*a.yaml\)$"):
        energon.check_energon_path(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize(
    "target, says",
    [
        ("/etc", "it names '/etc', which is not a prepared energon dataset \\(no .nv-meta/dataset.yaml\\)"),
        ("/etc/hostname", "it names '/etc/hostname', which is not a metadataset .yaml"),
    ],
)
def test_a_metadataset_naming_a_host_path_is_one_line(example_data, tmp_path, target, says):
    """``path: /etc`` ended in energon's ``FileNotFoundError: /etc``."""
    import os

    if not os.path.exists(target):
        pytest.skip(f"{target} is not on this host")
    with pytest.raises(DataError, match=says):
        energon.check_energon_path(str(_blend(tmp_path / "blend.yaml", target)))


def test_a_yaml_alias_bomb_stays_small(example_data, tmp_path):
    """Nine levels of nine aliases would be 9^9 nodes expanded; energon's YAML reader keeps an alias as
    its text, so the walk (and energon) see a few dozen strings."""
    from examples.multimodal_dev.data.energon_configs import read_config

    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    folder = planted(example_data, tmp_path, CRUDE + "subflavors:\n" + "".join(f"  {line}\n" for line in lines))
    energon.check_energon_path(str(folder))  # nothing in it names code; expanded, it would not end
    tree = read_config(str(folder / ".nv-meta" / "dataset.yaml"))
    assert tree["subflavors"]["a8"] == ["*a7"] * 9

"""An energon dataset's YAML is data: nothing in it may import, call or load code.

energon reads a dataset's ``.nv-meta/dataset.yaml`` (and a metadataset ``.yaml``) with a typed
converter that imports any ``__module__`` and instantiates its ``__class__`` or calls its
``__function__``, at any depth of the tree: ``subflavors: {x: {__module__: os, __function__:
system, command: ...}}`` runs a shell command. It also runs ``sample_loader`` / ``part_filter``
strings as Python files of the dataset's folder, and ``aux`` entries read files anywhere on the
host. A dataset someone hands over is data, so two guards stand between it and energon:

- ``check_dataset(path)``, before energon opens anything: every YAML and JSON file energon reads
  for ``path`` (a prepared folder's ``.nv-meta``; a metadataset, and recursively every dataset and
  metadataset it names) is parsed with energon's own YAML reader and walked. An object may be
  named only at the top of a file and only as one of ``ALLOWED_CLASSES`` of ``megatron.energon``;
  ``__function__`` and ``CODE_KEYS`` are refused; ``dataset_config`` / ``split_config`` must be
  plain file names. A refusal is a ``DataError`` naming the file and the key.
- two rows of ``megatron_changes`` (group ``energon-refuses-code``, applied by ``energon.py``
  before it opens a dataset): energon's object resolver refuses every object outside
  ``ALLOWED_CLASSES`` and its Python-file loader refuses every file, so whatever a file the walk
  did not foresee names still cannot run.
"""

from __future__ import annotations

import json
import os

from .sample import DataError

ENERGON_MODULE = "megatron.energon"
# What this project's energon provider reads: crude conversation shards (``tools/jsonl_to_energon``)
# and metadatasets blending them.
ALLOWED_CLASSES = frozenset({"CrudeWebdataset", "Metadataset", "MetadatasetV2"})
OBJECT_KEYS = ("__module__", "__class__", "__function__")
CODE_KEYS = {
    "sample_loader": "runs a Python file of the dataset",
    "aux": "reads files outside the dataset",
    "joiner": "names code that joins samples",
}
CONFIG_NAME_KEYS = ("dataset_config", "split_config")
MAX_DEPTH = 32  # energon's own files nest 4 deep; a deeper tree is a planted one
META_FOLDER = ".nv-meta"


def check_dataset(path: str) -> None:
    """Walk every config file energon reads for ``path`` (a prepared folder or a metadataset .yaml);
    ``DataError`` naming the file and key for anything that could run code or read host files."""
    _check(os.path.abspath(path), (), set())


def _check(path: str, including: tuple[str, ...], done: set) -> None:
    """``including``: the metadatasets that led here (energon follows a cycle until Python's stack
    ends); ``done``: files checked already (a dataset blended twice is read once)."""
    real = os.path.realpath(path)
    if real in including:
        chain = " -> ".join((*including[including.index(real) :], real))
        raise DataError(f"energon metadataset {path}: includes itself ({chain})")
    if real in done:
        return
    done.add(real)
    if os.path.isdir(path):
        meta = os.path.join(path, META_FOLDER)
        for name in sorted(os.listdir(meta)) if os.path.isdir(meta) else ():
            if name.endswith((".yaml", ".yml", ".json")) and os.path.isfile(os.path.join(meta, name)):
                check_tree(read_config(os.path.join(meta, name)), os.path.join(meta, name))
        return
    tree = read_config(path)
    check_tree(tree, path)
    for reference in _dataset_paths(tree):
        target = reference if os.path.isabs(reference) else os.path.join(os.path.dirname(path), reference)
        if not os.path.exists(target):
            raise DataError(f"energon metadataset {path}: it names {reference!r}, which does not exist")
        # energon opens a folder as a prepared dataset and a file as a metadataset: anything else
        # (a host folder such as /etc) would end in its FileNotFoundError
        if os.path.isdir(target) and not os.path.isfile(os.path.join(target, META_FOLDER, "dataset.yaml")):
            raise DataError(
                f"energon metadataset {path}: it names {reference!r}, which is not a prepared energon dataset "
                f"(no {META_FOLDER}/dataset.yaml)"
            )
        if os.path.isfile(target) and not target.endswith((".yaml", ".yml")):
            raise DataError(f"energon metadataset {path}: it names {reference!r}, which is not a metadataset .yaml")
        _check(target, (*including, real), done)


def read_config(path: str):
    """The file as energon parses it (its own YAML reader; JSON for ``.json``)."""
    from megatron.energon.eyaml import load_yaml

    try:
        with open(path, "rb") as f:
            data = f.read()
        return json.loads(data) if path.endswith(".json") else load_yaml(data)
    except RecursionError:
        raise DataError(f"energon config {path}: nested deeper than Python can read") from None
    except Exception as err:  # ryml and json raise their own types for a malformed file
        raise DataError(f"energon config {path}: not readable YAML/JSON ({type(err).__name__}: {err})") from None


def check_tree(tree, file: str) -> None:
    """``DataError`` for the first key of ``tree`` (parsed from ``file``) that could name code."""
    _walk(tree, file, "", 0)


def _walk(node, file: str, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise DataError(f"energon config {file}: {where or 'the root'} nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, dict):
        if any(key in node for key in OBJECT_KEYS):
            _check_object(node, file, where, depth)
        for key, value in node.items():
            here = f"{where}.{key}" if where else str(key)
            _walk(value, file, here, depth + 1)  # first: an object named inside is the clearer message
            _check_key(key, value, file, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _walk(value, file, f"{where}[{i}]", depth + 1)


def _check_object(node: dict, file: str, where: str, depth: int) -> None:
    module, name = node.get("__module__"), node.get("__class__", node.get("__function__"))
    if depth == 0 and "__function__" not in node and allowed(module, name):
        return
    allowed_names = ", ".join(f"{ENERGON_MODULE}.{c}" for c in sorted(ALLOWED_CLASSES))
    raise DataError(
        f"energon config {file}: {where or 'the root'} names {module}.{name}; a dataset's YAML is data, "
        f"it may name only {allowed_names} at its top"
    )


def _check_key(key, value, file: str, where: str) -> None:
    if key in CODE_KEYS:
        raise DataError(f"energon config {file}: {where} {CODE_KEYS[key]}; a dataset's YAML is data, not code")
    if key == "part_filter" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise DataError(
            f"energon config {file}: {where} must be a list of member names (a string names a Python file to run)"
        )
    if key in CONFIG_NAME_KEYS and not (
        isinstance(value, str) and value == os.path.basename(value) and value not in ("", ".", "..")
    ):
        raise DataError(f"energon config {file}: {where} {value!r} must be a file name in the dataset's {META_FOLDER}")


def allowed(module, name) -> bool:
    return module == ENERGON_MODULE and name in ALLOWED_CLASSES


def _dataset_paths(node):
    """Every ``path`` a metadataset names (datasets and nested metadatasets; subflavors are the
    samples' data, not references)."""
    if isinstance(node, dict):
        if isinstance(node.get("path"), str):
            yield node["path"]
        for key, value in node.items():
            if key != "subflavors":
                yield from _dataset_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _dataset_paths(value)


def allowed_objects_only(resolve_object, run=None):
    """energon's object resolver, refusing every object outside ``ALLOWED_CLASSES`` (megatron_changes row)."""

    def guarded_resolve(self, module_name, object_name, *args, **kwargs):
        if not allowed(module_name, object_name):
            raise DataError(
                f"an energon config names {module_name}.{object_name}; a dataset's YAML is data, it may "
                f"name only {', '.join(sorted(ALLOWED_CLASSES))} of {ENERGON_MODULE}"
            )
        return resolve_object(self, module_name, object_name, *args, **kwargs)

    return guarded_resolve


def no_python_files(load_module, run=None):
    """energon's Python-file loader, refusing every file (megatron_changes row)."""

    def refuse_module(self, path):
        raise DataError(f"an energon config asks to run the Python file {path}; a dataset's YAML is data, not code")

    return refuse_module

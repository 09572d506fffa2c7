"""energon's loader state as JSON that cannot run code when read.

``SavableDataLoader.save_state_rank()`` returns nested dataclasses (``SavableDataLoaderState``,
its workers' checkpoints, random-generator states, shard positions) holding dicts, tuples,
bytes, numpy arrays and torch tensors. energon and Megatron-LM store it with ``torch.save``,
a pickle: loading one runs whatever the file names. Here every value is written as JSON with a
tag for the types JSON lacks, and a dataclass is rebuilt only from ``STATE_CLASSES``, looked up
by its tag: reading imports nothing and calls nothing that the file chooses. Arrays and tensors
come back as the dtypes of ``DTYPES`` only.

    {"$dataclass": "SliceState", "fields": {...}}   {"$tuple": [...]}   {"$bytes": "<base64>"}
    {"$dict": [[key, value], ...]}  (keys of any type; "$flex" for energon's FlexState)
    {"$ndarray": {"dtype": "uint32", "shape": [624], "data": "<base64>"}}   ("$tensor" likewise)

A type outside these (a newer energon with a new state class) is a ``StateFormatError`` at
save time, naming it, so the run says its stream will restart instead of writing a state it
could not read back.
"""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np
import torch


class StateFormatError(ValueError):
    """A state value this format does not hold, or a file that is not such a state."""


def _state_classes() -> dict:
    from megatron.energon.flavors.webdataset.sample_loader import SliceState
    from megatron.energon.rng import SystemRngState
    from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState

    return {
        cls.__name__: cls
        for cls in (SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState, SystemRngState, SliceState)
    }


STATE_CLASSES = _state_classes()
DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint32", "uint64", "float32", "float64", "bool")


def dumps(state) -> str:
    return json.dumps(_encode(state, "state"))


def loads(text: str):
    try:
        return _decode(json.loads(text), "state")
    except (KeyError, TypeError, AttributeError, ValueError, RecursionError) as err:
        if isinstance(err, StateFormatError):
            raise
        raise StateFormatError(f"not an energon loader state: {type(err).__name__}: {err}") from None


def _encode(value, where: str):
    from megatron.energon.state import FlexState

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        tag = "$flex" if type(value) is FlexState else "$dict"
        if type(value) not in (dict, FlexState):
            raise StateFormatError(f"{where}: a {type(value).__qualname__} (a dict subclass this format does not hold)")
        return {tag: [[_encode(k, where), _encode(v, f"{where}.{k}")] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and STATE_CLASSES.get(type(value).__name__) is type(value):
        return {
            "$dataclass": type(value).__name__,
            "fields": {f.name: _encode(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)},
        }
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        return {"$ndarray": _array(value, where)}
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise StateFormatError(f"{where}: a bfloat16 tensor")
        return {"$tensor": _array(value.detach().cpu().numpy(), where)}
    raise StateFormatError(
        f"{where}: a {type(value).__module__}.{type(value).__qualname__}, which this format does not hold"
    )


def _array(array: np.ndarray, where: str) -> dict:
    if array.dtype.name not in DTYPES:
        raise StateFormatError(f"{where}: an array of dtype {array.dtype.name}")
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "data": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
    }


def _decode(value, where: str):
    from megatron.energon.state import FlexState

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise StateFormatError(f"{where}: an untagged JSON object")
    if "$dataclass" in value:
        cls = STATE_CLASSES.get(value["$dataclass"])
        if cls is None:
            raise StateFormatError(f"{where}: {value['$dataclass']!r} is not an energon state class")
        return cls(**{name: _decode(v, f"{where}.{name}") for name, v in value["fields"].items()})
    ((tag, body),) = value.items()
    if tag == "$bytes":
        return base64.b64decode(body, validate=True)
    if tag == "$tuple":
        return tuple(_decode(v, where) for v in body)
    if tag in ("$dict", "$flex"):
        pairs = ((_hashable(_decode(k, where)), _decode(v, where)) for k, v in body)
        return FlexState(pairs) if tag == "$flex" else dict(pairs)
    if tag in ("$ndarray", "$tensor"):
        if body["dtype"] not in DTYPES:
            raise StateFormatError(f"{where}: an array of dtype {body['dtype']!r}")
        array = np.frombuffer(base64.b64decode(body["data"], validate=True), dtype=body["dtype"])
        array = array.reshape(body["shape"]).copy()
        return torch.from_numpy(array) if tag == "$tensor" else array
    raise StateFormatError(f"{where}: unknown tag {tag!r}")


def _hashable(key):
    if isinstance(key, (list, dict)):
        raise StateFormatError(f"a dict key of type {type(key).__name__}")
    return key

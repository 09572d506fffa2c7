"""Backend selection: Transformer Engine where CUDA is present and TE imports, local torch
modules everywhere else; an explicit --transformer-impl that the host cannot run is refused in
one line naming the flag."""

import importlib.abc
import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from examples.multimodal_dev.training import backend

# (CUDA available, transformer_engine importable) -> the default --transformer-impl
HOSTS = [(True, True, "transformer_engine"), (True, False, "local"), (False, True, "local"), (False, False, "local")]


@pytest.fixture
def host(monkeypatch, request):
    cuda, te = request.param
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(backend, "te_importable", lambda: te)
    return cuda, te


@pytest.mark.parametrize(
    "host,impl",
    [((c, t), impl) for c, t, impl in HOSTS],
    indirect=["host"],
    ids=[f"cuda={c}-te={t}" for c, t, _ in HOSTS],
)
def test_default_impl_and_engine_defaults(host, impl):
    assert backend.default_transformer_impl() == impl
    assert backend.engine_defaults() == {"dataloader_type": "external", "transformer_impl": impl}
    args = SimpleNamespace(transformer_impl=impl)
    assert backend.backend_of(args) == ("te" if impl == "transformer_engine" else "local")


def test_backend_of():
    assert backend.backend_of(SimpleNamespace(transformer_impl="transformer_engine")) == "te"
    assert backend.backend_of(SimpleNamespace(transformer_impl="local")) == "local"


class _BrokenTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A transformer_engine whose import fails the way a build for another CUDA does."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise OSError("libcudart.so.13: cannot open shared object file")


@pytest.fixture
def fresh_te_cache(monkeypatch):
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    backend.te_importable.cache_clear()
    yield
    backend.te_importable.cache_clear()


def test_te_importable_missing(fresh_te_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    assert backend.te_importable() is False


def test_te_importable_broken_build(fresh_te_cache, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])
    assert backend.te_importable() is False


def test_te_importable_present_and_cached(fresh_te_cache, monkeypatch):
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    assert backend.te_importable() is True
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    assert backend.te_importable() is True  # asked once per process
    backend.te_importable.cache_clear()
    assert backend.te_importable() is False

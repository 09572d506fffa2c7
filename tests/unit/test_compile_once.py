"""megatron-core's compiled helpers compile once a run (training/compile_once.py): packed rows of
new lengths in later steps compile no new graph. Counted with Dynamo's graphs handed to eager
execution instead of Inductor (what is compiled is the question, not how fast)."""

import collections

import pytest
import torch
from hf_reference import megatron_position_ids

from examples.multimodal_dev.models.qwen35_vl.configuration import get_variant
from examples.multimodal_dev.models.qwen35_vl.factory import build_model
from examples.multimodal_dev.training import compile_once

LENGTHS = (37, 53, 71)  # a packed row's length changes with every micro-batch


def _graphs_per_step(monkeypatch, any_length: bool) -> list[int]:
    import torch._inductor.compile_fx as inductor

    graphs = collections.Counter()

    def eager(gm, _example_inputs, **_kw):
        graphs["now"] += 1
        return gm.forward

    monkeypatch.setattr(inductor, "compile_fx", eager)
    shape = get_variant("tiny", moe=True, mtp=False)
    model = build_model(shape, moe_grouped_gemm=True, bias_activation_fusion=True)
    torch._dynamo.reset()
    per_step = []
    with torch._dynamo.config.patch(disable=False, assume_static_by_default=True):
        if any_length:
            compile_once.compile_for_any_length()
        for length in LENGTHS:
            before = graphs["now"]
            ids = torch.randint(10, 100, (1, length))
            model(ids, megatron_position_ids(shape, ids, torch.ones_like(ids), None), None).float().sum().backward()
            per_step.append(graphs["now"] - before)
    torch._dynamo.reset()  # the eager graphs are not left for other tests
    return per_step


@pytest.mark.parametrize("any_length", [False, True], ids=["dynamo's default", "compiled for any length"])
def test_later_steps_compile_nothing(mcore, monkeypatch, any_length):
    first, *later = _graphs_per_step(monkeypatch, any_length)
    assert first > 0
    if any_length:
        assert later == [0] * len(later), later
    else:  # the default recompiles every helper at the second length: what the setting removes
        assert later[0] >= first - 1 and later[1:] == [0] * (len(later) - 1), (first, later)


def test_compile_watch_tells_each_new_graph_once():
    """The log's torch.compile line: graphs compiled since the last line (a later recompile shows as one
    more), nothing when nothing compiled."""
    watch = compile_once.CompileWatch()
    watch.news()  # whatever this process compiled before
    f = torch.compile(lambda x: x.sin() + 1, backend="eager")
    with torch._dynamo.config.patch(disable=False, assume_static_by_default=True):
        f(torch.randn(3))
        first = watch.news()
        f(torch.randn(3))  # same shape: served by the graph compiled
        same = watch.news()
        f(torch.randn(5))  # a new length: compiled again, for dynamic shapes
        again = watch.news()
    torch._dynamo.reset()
    assert first.startswith(" torch.compile: ") and "graphs compiled (1 since the last line) in " in first
    assert same is None
    total = int(first.split()[1]) + 1
    assert again.startswith(f" torch.compile: {total} graphs compiled (1 since the last line)"), again

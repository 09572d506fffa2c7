"""megatron/cpu's device layer: megatron's CUDA assumptions answered by the CPU (device
arguments, ``.cuda()``, ``torch.cuda.*`` stubs, ``Tensor.type()``, AVG on gloo, the RNG
tracker), in every thread, and the distributed optimizer fixes' install checks."""

import inspect
import threading

import pytest
import torch

from megatron.cpu import device_compat, distrib_optimizer_fixes

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the device layer is installed only without CUDA")


def _cuda_calls() -> dict:
    """What megatron writes for CUDA tensors, each result with the values it must hold."""
    t = torch.arange(3, dtype=torch.float32)
    results = {
        'zeros(device="cuda")': (torch.zeros(2, device="cuda"), [0.0, 0.0]),
        "empty(device=0)": (torch.empty(1, device=0).fill_(7.0), [7.0]),
        'ones(device=torch.device("cuda", 0))': (torch.ones(2, device=torch.device("cuda", 0)), [1.0, 1.0]),
        "t.cuda()": (t.cuda() * 2, [0.0, 2.0, 4.0]),
        't.to("cuda:0")': (t.to("cuda:0") + 1, [1.0, 2.0, 3.0]),
        't.to(device="cuda", dtype=float64)': (t.to(device="cuda", dtype=torch.float64), [0.0, 1.0, 2.0]),
        "t.pin_memory()": (t.pin_memory(), [0.0, 1.0, 2.0]),
        "tensor(..., device=current_device())": (torch.tensor([5.0], device=torch.cuda.current_device()), [5.0]),
        "empty(pin_memory=True)": (torch.empty(2, pin_memory=True).fill_(3.0), [3.0, 3.0]),
    }
    assert t.cuda() is t and t.pin_memory() is t  # no copies on a host
    return results


def _check(results: dict) -> None:
    for call, (tensor, values) in results.items():
        assert tensor.device == CPU, call
        assert tensor.tolist() == values, call


def test_cuda_device_arguments_give_cpu_tensors(mcore):
    _check(_cuda_calls())
    assert torch.cuda.is_available() is False  # how the project tells the hosts apart


def test_threads_started_after_activation_run_under_the_mode(mcore):
    outcome = {}

    def work():
        try:
            outcome["results"] = _cuda_calls()
        except Exception as err:  # noqa: BLE001 - reported in the main thread
            outcome["error"] = err

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    _check(outcome["results"])


def test_tensor_type_names_cuda_types_and_still_converts(mcore):
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2, dtype=torch.int64).type() == "torch.cuda.LongTensor"
    converted = torch.tensor([1.5, 2.5]).type(torch.float64)
    assert converted.dtype == torch.float64 and converted.tolist() == [1.5, 2.5]
    by_name = torch.tensor([1.5]).type("torch.cuda.DoubleTensor")  # a CUDA name converts on the host
    assert by_name.dtype == torch.float64 and by_name.device == CPU


def test_cuda_stubs_are_one_function_per_name(mcore):
    functions = [fn for fn in device_compat._CUDA_FUNCTIONS.values() if inspect.isfunction(fn)]
    assert len(functions) >= 20
    assert len({id(fn) for fn in functions}) == len(functions)
    for name, fn in device_compat._CUDA_FUNCTIONS.items():
        assert getattr(torch.cuda, name) is fn, name
    # dynamo's own check: its table of torch objects has one rule per object
    from torch._dynamo import trace_rules

    table = trace_rules.get_torch_obj_rule_map.__wrapped__()
    assert table[torch.cuda.current_device] is not None


def test_cuda_stub_answers(mcore):
    assert torch.cuda.current_device() == CPU and torch.cuda.device_count() == 1
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_reserved() == 0
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(torch.cuda.Stream()):
        event = torch.cuda.Event()
        event.record()
    assert event.query() is True
    if hasattr(torch, "accelerator"):
        assert torch.accelerator.current_accelerator() is None


def test_avg_all_reduce_on_gloo(mcore):
    group = torch.distributed.group.WORLD
    assert torch.distributed.get_backend(group) == "gloo"
    value = torch.tensor([3.0, -1.5])
    assert torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG, group=group) is None
    assert value.tolist() == [3.0, -1.5]
    work = torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG, async_op=True)
    assert work.wait() and value.tolist() == [3.0, -1.5]
    summed = torch.tensor([2.0])
    torch.distributed.all_reduce(summed)  # other ops are gloo's own
    assert summed.tolist() == [2.0]
    assert torch.distributed.all_reduce.__name__ == "average_capable_all_reduce"


def test_groups_asked_for_on_nccl_are_made_on_gloo(mcore):
    """megatron-core's bridge communicators write ``backend='nccl'`` in; here those groups are gloo
    groups, by keyword or position, directly or through ``new_subgroups_by_enumeration``."""
    dist = torch.distributed
    subgroup, _ = dist.new_subgroups_by_enumeration([[0]], backend="nccl")
    by_position = dist.new_group([0], None, "nccl")
    for group in (subgroup, by_position, dist.new_group([0], backend="nccl")):
        assert dist.get_backend(group) == "gloo"
        value = torch.tensor([2.0])
        dist.all_reduce(value, group=group)
        assert value.tolist() == [2.0]


def test_avg_is_a_sum_divided_by_the_group_size(monkeypatch):
    """The arithmetic of the AVG path for a group of 2, with the other rank holding [1, 5]."""
    ops = []

    def two_rank_all_reduce(tensor, op=None, group=None, async_op=False):
        ops.append(op)
        tensor.add_(torch.tensor([1.0, 5.0]))

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    all_reduce = device_compat._average_on_gloo(two_rank_all_reduce)
    value = torch.tensor([3.0, -1.0])
    all_reduce(value, op=torch.distributed.ReduceOp.AVG)
    assert value.tolist() == [2.0, 2.0] and ops == [torch.distributed.ReduceOp.SUM]


def test_rng_tracker_forks_the_cpu_generator(mcore):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def draws(seed):
        tracker = CudaRNGStatesTracker()
        tracker.add("stream", seed)
        with tracker.fork("stream"):
            first = torch.rand(4)
        with tracker.fork("stream"):
            second = torch.rand(4)  # the fork's state moved on
        return first, second

    torch.manual_seed(0)
    outside = torch.rand(4)
    torch.manual_seed(0)
    a_first, a_second = draws(42)
    after = torch.rand(4)
    b_first, b_second = draws(42)
    assert torch.equal(a_first, b_first) and torch.equal(a_second, b_second)
    assert not torch.equal(a_first, a_second)
    torch.manual_seed(42)
    assert torch.equal(a_first, torch.rand(4))  # the forked generator is the CPU one, seeded 42
    assert torch.equal(after, outside)  # the fork restored the generator it found
    c_first, _ = draws(43)
    assert not torch.equal(a_first, c_first)


def test_distrib_optimizer_fixes_wrap_megatrons_methods_once(mcore):
    from megatron.core.optimizer import distrib_optimizer as do

    from examples.multimodal_dev.megatron_changes import apply

    assert not do.HAVE_APEX_OR_TE
    apply("torch-adam-distributed-optimizer")
    patched = (
        do.DistributedOptimizer.state_dict,
        do.DistributedOptimizer.load_state_dict,
        do.DistributedOptimizer._set_main_param_and_optimizer_states,
    )
    # functools.wraps keeps the names; the code is the fix's, wrapping megatron-core's method once
    assert all(fn.__code__.co_filename == distrib_optimizer_fixes.__file__ for fn in patched)
    assert all(fn.__wrapped__.__code__.co_filename == do.__file__ for fn in patched)
    apply("torch-adam-distributed-optimizer")
    again = (
        do.DistributedOptimizer.state_dict,
        do.DistributedOptimizer.load_state_dict,
        do.DistributedOptimizer._set_main_param_and_optimizer_states,
    )
    assert again == patched  # not wrapped twice


def test_an_optimizer_with_no_parameter_on_the_rank_saves_and_loads_its_groups(mcore):
    """megatron builds an empty distributed optimizer where a rank holds none of a kind of parameter
    (the expert optimizer of a rank that holds only the vision tower): torch Adam has no step to read
    there, and megatron's own state_dict asserts one. Its groups are written without a step, as the
    fused path writes them, and a load has no state to fill."""
    from types import SimpleNamespace

    from megatron.core.optimizer import distrib_optimizer as do

    from examples.multimodal_dev.megatron_changes import apply

    apply("torch-adam-distributed-optimizer")
    inits = []
    empty = SimpleNamespace(
        optimizer=torch.optim.Adam([{"params": [], "wd_mult": 1.0}], lr=0.5),
        grad_scaler=None,
        _init_optimizer_states_with_dummy_values=lambda: inits.append(1),
    )
    saved = do.DistributedOptimizer.state_dict(empty)
    assert inits == [1]  # a state was asked for first, as for any fresh optimizer
    assert [{k: g[k] for k in ("wd_mult", "lr")} for g in saved["optimizer"]["param_groups"]] == [
        {"wd_mult": 1.0, "lr": 0.5}
    ]
    assert all("params" not in g and "step" not in g for g in saved["optimizer"]["param_groups"])
    assert do.DistributedOptimizer.load_state_dict(empty, saved) is saved and not empty.optimizer.state


def test_expect_names_a_changed_signature():
    def load_state_dict(self, state_dict, strict):
        pass

    distrib_optimizer_fixes._expect(load_state_dict, ("self", "state_dict"))  # a longer signature is fine

    def renamed(self, checkpoint):
        pass

    with pytest.raises(
        RuntimeError,
        match=r"<locals>\.renamed\('self', 'checkpoint'\) changed "
        r"\(expected \('self', 'state_dict'\)\)",
    ):
        distrib_optimizer_fixes._expect(renamed, ("self", "state_dict"))
    with pytest.raises(RuntimeError, match="test_expect_names_a_changed_signature.<locals>.load_state_dict"):
        distrib_optimizer_fixes._expect(load_state_dict, ("self", "model_param", "tensors"))

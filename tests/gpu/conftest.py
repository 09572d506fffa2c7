"""Fixtures of the GPU checks: a ``record`` bound to the running test, megatron-core initialised for
one process on the GPU, and rows for skips and failures the tests did not record themselves
(so the table says why a check has no numbers). Nothing here imports torch at collection time."""

import gpu_results
import pytest


def _check_name(item) -> str:
    return getattr(item.module, "CHECK", item.module.__name__.removeprefix("test_").replace("_", " "))


@pytest.fixture
def record(request):
    """record(case, status, metrics=None, note="", details=None): one row of this test's check."""

    def _record(case, status, metrics=None, note="", details=None):
        request.node.user_properties.append(("gpu_row_status", status))
        return gpu_results.record(_check_name(request.node), case, status, metrics, note, details)

    return _record


@pytest.fixture(scope="session")
def megatron_gpu():
    """megatron-core's parallel state for one process on cuda:0 (NCCL; gloo if NCCL will not start), or
    in a rehearsal on the CPU (gpu_results.rehearsal). GatedDeltaNet gets FLA's kernels where FLA
    imports, else the project's torch kernels."""
    import tempfile

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron.cpu

    if not torch.cuda.is_available():  # a rehearsal: the CPU's single process, its device layer active
        from megatron.cpu.single_process import init_single_process

        init_single_process()
        torch.manual_seed(1234)
        return torch.distributed.get_backend()
    torch.cuda.set_device(0)
    if not torch.distributed.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="gpu_checks_store_", delete=False).name
        try:
            torch.distributed.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
        except Exception:  # noqa: BLE001 - gloo also runs world size 1 with CUDA tensors
            store = tempfile.NamedTemporaryFile(prefix="gpu_checks_store_", delete=False).name
            torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if megatron.cpu.fla_unusable_reason():
        megatron.cpu.register_torch_gdn_kernels(megatron.cpu.torch_gdn_kernel_names())
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    return torch.distributed.get_backend()


_reported = set()  # (check, status, note): a fixture's skip or error is one row, not one per test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not gpu_results.rows_path() or "gpu" not in item.keywords:
        return
    statuses = [v for k, v in item.user_properties if k == "gpu_row_status"]
    if report.skipped and not statuses:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        row = (_check_name(item), "skip", reason.removeprefix("Skipped: "))
    elif report.failed and "fail" not in statuses:
        text = str(report.longreprtext).splitlines()
        lines = [ln[2:].strip() for ln in text if ln.startswith("E ")] or text[-1:]
        row = (_check_name(item), "fail", f"{report.when}: " + " / ".join(lines[-3:])[:400])
    else:
        return
    if row not in _reported:
        _reported.add(row)
        gpu_results.record(row[0], item.originalname if report.when == "setup" else item.name, row[1], note=row[2])

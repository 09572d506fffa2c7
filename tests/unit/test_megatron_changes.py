"""The table of changes to megatron (``examples/multimodal_dev/megatron_changes``) is what a run
installs: in a fresh interpreter, every function, method and module that megatron-core,
megatron.training, megatron-energon and torch.distributed.checkpoint hold is recorded, the device
layer and every row are applied, and the attributes that changed are exactly the table's targets.
Applying again changes nothing; a moved target or another megatron-core version is said in one line;
docs/megatron_changes.md is the table's output."""

import json
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from examples.multimodal_dev import megatron_changes
from examples.multimodal_dev.megatron_changes import __main__ as table_doc
from examples.multimodal_dev.megatron_changes import applier as changes
from examples.multimodal_dev.megatron_changes.table import (
    CHANGES,
    DEVICE_LAYER_CPU,
    DEVICE_LAYER_GDN,
    GROUPS,
    ON_USE,
    OWN_CALL,
    Change,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCOPES = ("megatron.core", "megatron.training", "megatron.energon", "torch.distributed.checkpoint")


def _behaviour() -> dict:
    """'module:attribute' and 'module:Class.attribute' -> the object, for every function, method,
    class and module the scoped modules hold (their data values are not behaviour)."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not (module and name.startswith(SCOPES)):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) or isinstance(value, types.ModuleType):
                found[f"{name}:{attr}"] = value
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod)):
                        found[f"{name}:{attr}.{key}"] = member
    return found


def report() -> None:
    """Run in a fresh interpreter: what applying the device layer and every row changed."""
    import megatron.cpu
    from examples.multimodal_dev.training.throughput import StepFlops

    for change in CHANGES:
        changes.load(change.target.partition(":")[0] + ":")  # every target's module, before the snapshot
    before = _behaviour()
    on_cpu = megatron.cpu.activate()
    megatron_changes.install(SimpleNamespace(metrics_file=None), StepFlops())
    for group in GROUPS:
        if any(c.group == group and c.applies == ON_USE for c in CHANGES):
            megatron_changes.apply(group, SimpleNamespace(groups=None))
    after = _behaviour()
    megatron_changes.install(SimpleNamespace(metrics_file=None), StepFlops())
    for group in GROUPS:
        if any(c.group == group and c.applies == ON_USE for c in CHANGES):
            megatron_changes.apply(group, SimpleNamespace(groups=None))
    again = _behaviour()
    # a module imported meanwhile (a submodule the conditions import) is new, not a change
    known = {k.partition(":")[0] for k in before}
    new_module = {k for k in after.keys() - before.keys() if isinstance(after[k], types.ModuleType)}
    changed = sorted(
        k
        for k in before.keys() | after.keys() - new_module
        if before.get(k) is not after.get(k) and k.partition(":")[0] in known
    )
    # what the table says applies on this host: its own rows by their conditions, the device layer's
    # where megatron.cpu took over (a CPU host; its torch GDN kernels unless FLA's were kept)
    device_layer = {DEVICE_LAYER_CPU: on_cpu, DEVICE_LAYER_GDN: on_cpu and not megatron.cpu._fla_kept}
    expected = [
        c.target
        for c in CHANGES
        if (device_layer.get(c.applies, False) if c.by_device_layer else c.applies == ON_USE or changes._applies(c))
    ]
    print(
        json.dumps(
            {
                "changed": changed,
                "changed_again": sorted(k for k in after if after[k] is not again.get(k)),
                "applied": len(megatron_changes.applied()),
                "expected": sorted(set(expected)),
                "expected_rows": sum(
                    not c.by_device_layer and (c.applies == ON_USE or changes._applies(c)) for c in CHANGES
                ),
            }
        )
    )


@pytest.fixture(scope="module")
def installed() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MEGATRON_CPU_FLA", "TRITON_INTERPRET")}
    out = subprocess.run(
        [sys.executable, "-c", "from tests.unit.test_megatron_changes import report; report()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_a_run_installs_is_the_table(installed):
    """The attributes that changed are exactly the targets of the rows whose conditions hold on this host
    (on a CPU host without Apex / TE, from the wheel: every row)."""
    targets, changed = set(installed["expected"]), set(installed["changed"])
    assert not changed - targets, f"changed by the project but not in the table: {sorted(changed - targets)}"
    assert not targets - changed, f"in the table but not changed: {sorted(targets - changed)}"
    assert installed["applied"] == installed["expected_rows"]


def test_applying_again_changes_nothing(installed):
    assert installed["changed_again"] == []


def test_every_replacement_exists():
    for change in CHANGES:
        assert callable(changes.load(change.replacement)), change.replacement
        assert change.why and change.group in GROUPS


def test_a_target_megatron_no_longer_has_stops_in_one_line():
    gone = Change(
        "optimizer-formats",
        "megatron.core.optimizer.optimizer:ChainedOptimizer.no_such_method",
        "examples.multimodal_dev.checkpoint.optimizer_format:regrouped",
        "a test",
    )
    with pytest.raises(
        megatron_changes.MegatronChangeError,
        match=r"^megatron.core.optimizer.optimizer:"
        r"ChainedOptimizer.no_such_method: not in this megatron-core / torch; the change "
        r"'optimizer-formats' was written for megatron-core 0.19.2 and needs re-porting$",
    ):
        changes._apply_row(gone, None)


def test_rows_applied_by_their_own_call_are_checked_by_a_run_not_applied(monkeypatch):
    """A value set by its own call (Dynamo's setting, the writer's queue): ``apply`` refuses its group
    naming the call, a run stops where its target is gone, and the call sets what its row names."""
    own = [c for c in CHANGES if c.applies == OWN_CALL]
    assert {c.group for c in own} == {"compile-for-any-length", "writer-queue-by-fork"}
    with pytest.raises(
        megatron_changes.MegatronChangeError,
        match=r"^'writer-queue-by-fork' is applied by its own call "
        r"\(examples.multimodal_dev.checkpoint.write_queue:install\), not here$",
    ):
        megatron_changes.apply("writer-queue-by-fork")
    gone = Change(
        "compile-for-any-length", "torch._dynamo.config:no_such_setting", own[0].replacement, "a test", OWN_CALL
    )
    monkeypatch.setattr(changes, "CHANGES", (gone,))
    with pytest.raises(megatron_changes.MegatronChangeError, match=r"^torch._dynamo.config:no_such_setting: not in"):
        megatron_changes.install(SimpleNamespace(metrics_file=None))
    (compile_row,) = [c for c in own if c.group == "compile-for-any-length"]
    owner, name = changes._owner(compile_row)
    with torch._dynamo.config.patch(assume_static_by_default=True):  # undone after
        changes.load(compile_row.replacement)()
        assert getattr(owner, name) is False


def test_another_megatron_core_is_warned_about_once(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(changes, "_warned", [])
    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    line = changes.check_version()
    assert line.startswith(
        "megatron-core 0.20.0: this project's changes to it were written for 0.19.2; re-verify "
        "checkpoints-are-data, torch-adam-distributed-optimizer, "
    )
    assert "cpu-host" not in line  # the device layer's own rows are its to check
    assert changes.check_version() is None


def test_the_written_for_release_is_not_warned_about_whatever_checkout_holds_it(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(changes, "_warned", [])
    monkeypatch.setattr(package_info, "__version__", "0.19.2+b879eba")  # a .venv inside a git checkout
    assert changes.check_version() is None


def test_unknown_and_device_layer_groups_are_refused():
    with pytest.raises(KeyError, match="no change group 'nope'; the table has checkpoints-are-data, "):
        megatron_changes.apply("nope")
    with pytest.raises(megatron_changes.MegatronChangeError, match="'cpu-host' is applied by megatron.cpu"):
        megatron_changes.apply("cpu-host")


def test_the_doc_page_is_the_tables_output():
    with open(os.path.join(ROOT, "docs", "megatron_changes.md")) as f:
        assert f.read() == table_doc.markdown(), (
            "run: python -m examples.multimodal_dev.megatron_changes > docs/megatron_changes.md"
        )


def test_gdn_modules_torch_compares_one_tensor_with_itself_without_reading_it():
    from examples.multimodal_dev.benchmarks.op_counter import StepTally
    from examples.multimodal_dev.models.common.gated_delta_net_fp32_decay import torch_comparing_by_identity

    gdn_torch = torch_comparing_by_identity(torch)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    tally = StepTally()
    with tally.counting():
        assert gdn_torch.equal(cu, cu)
    assert not tally.ops and not tally.syncs
    assert gdn_torch.equal(cu, cu.clone()) and not gdn_torch.equal(cu, torch.tensor([0, 3, 8], dtype=torch.int32))
    assert gdn_torch.cat is torch.cat and gdn_torch.Tensor is torch.Tensor and gdn_torch.cuda is torch.cuda

"""GatedDeltaNet's kernels on a host without CUDA: ``megatron.cpu.activate()`` binds the torch kernels
even where flash-linear-attention (FLA) imports (its Triton kernels die there at their first call,
"0 active drivers"), keeps FLA's only for ``MEGATRON_CPU_FLA=1`` with ``TRITON_INTERPRET=1``, and
refuses that switch in one line where it cannot be met. ``activate()`` runs in a process of its own,
with a stand-in ``fla`` package importable (the three names megatron-core imports)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="activate() acts only without CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_FLA = {
    "fla/__init__.py": "",
    "fla/modules/__init__.py": "",
    "fla/modules/convolution.py": "def causal_conv1d(*args, **kwargs):\n    raise RuntimeError('0 active drivers')\n",
    "fla/modules/l2norm.py": "def l2norm(*args, **kwargs):\n    raise RuntimeError('0 active drivers')\n",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": (
        "def chunk_gated_delta_rule(*args, **kwargs):\n    raise RuntimeError('0 active drivers')\n"
    ),
}
PROBE = """
import json
import megatron.cpu
try:
    megatron.cpu.activate()
except RuntimeError as err:
    print(json.dumps({"refused": str(err)}))
    raise SystemExit(0)
from megatron.core.ssm.gated_delta_net import common, gdn
print(json.dumps({"modules": sorted({f.__module__ for f in (gdn.causal_conv1d, gdn.chunk_gated_delta_rule,
                                                            common.causal_conv1d, common.l2norm)}),
                  "line": megatron.cpu.gdn_kernels_line()}))
"""


def _activate(tmp_path, fla: bool, **env) -> dict:
    if fla:
        for name, text in FAKE_FLA.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
    full_env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_CPU_FLA", "TRITON_INTERPRET")}
    full_env["PYTHONPATH"] = os.pathsep.join(([str(tmp_path)] if fla else []) + [ROOT])
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env={**full_env, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_kernels_even_where_fla_imports(tmp_path):
    got = _activate(tmp_path, fla=True)
    assert got["modules"] == ["megatron.cpu.gdn_kernels"], got
    assert got["line"].startswith("Gated DeltaNet runs on the torch kernels of megatron.cpu"), got


def test_fla_kept_when_asked_under_the_interpreter(tmp_path):
    got = _activate(tmp_path, fla=True, MEGATRON_CPU_FLA="1", TRITON_INTERPRET="1")
    assert got["modules"] == ["fla.modules.convolution", "fla.modules.l2norm", "fla.ops.gated_delta_rule"], got
    assert got["line"] == (
        "Gated DeltaNet runs on flash-linear-attention's kernels under Triton's interpreter (MEGATRON_CPU_FLA=1)"
    ), got


@pytest.mark.parametrize(
    "env,fla,keep",
    [
        ({}, True, False),
        ({"TRITON_INTERPRET": "1"}, True, False),
        ({"MEGATRON_CPU_FLA": "0"}, True, False),
        ({"MEGATRON_CPU_FLA": "1", "TRITON_INTERPRET": "1"}, True, True),
        ({"MEGATRON_CPU_FLA": "1"}, True, "MEGATRON_CPU_FLA=1 needs TRITON_INTERPRET=1 on a host without CUDA"),
        (
            {"MEGATRON_CPU_FLA": "1", "TRITON_INTERPRET": "1"},
            False,
            "MEGATRON_CPU_FLA=1 but flash-linear-attention does not import",
        ),
        ({"MEGATRON_CPU_FLA": "yes"}, True, "MEGATRON_CPU_FLA='yes': expected 1"),
    ],
    ids=["unset", "interpreter alone", "switch 0", "asked", "no interpreter", "no fla", "bad value"],
)
def test_the_switch(monkeypatch, env, fla, keep):
    """The decision activate() takes (what it binds for it is the two tests above): keep FLA's
    kernels, bind the torch kernels, or refuse in one line naming what is missing."""
    import megatron.cpu

    for name in ("MEGATRON_CPU_FLA", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(megatron.cpu, "fla_available", lambda: fla)
    if isinstance(keep, bool):
        assert megatron.cpu.keep_fla_on_cpu() is keep
    else:
        with pytest.raises(RuntimeError, match=keep.replace("(", r"\(")):
            megatron.cpu.keep_fla_on_cpu()


@pytest.mark.parametrize(
    "capability,triton_version,tilelang,refused",
    [
        ((9, 0), "3.6.0", False, True),
        ((9, 0), "3.4.0", False, True),
        ((9, 0), "3.7.0+git1234", False, True),
        ((9, 0), "3.7.1", False, False),
        ((9, 0), "3.3.1", False, False),
        ((8, 0), "3.6.0", False, False),
        ((10, 0), "3.6.0", False, False),
        ((9, 0), "3.6.0", True, False),
        ((8, 0), "3.6.0", False, "no fla"),
    ],
    ids=[
        "hopper 3.6",
        "hopper 3.4",
        "hopper 3.7.0 build",
        "hopper 3.7.1",
        "hopper 3.3",
        "ampere",
        "blackwell",
        "hopper with tilelang",
        "fla does not import",
    ],
)
def test_fla_refused_where_triton_miscompiles_its_backward(monkeypatch, capability, triton_version, tilelang, refused):
    """On a GPU, FLA's kernels train where FLA imports, unless Triton 3.4.0 up to 3.7.1 meets a Hopper GPU
    without FLA's TileLang backend (FLA issue #640: wrong gradients; FLA 0.6 raises at the first backward)."""
    import types

    import megatron.cpu

    monkeypatch.setattr(megatron.cpu, "fla_available", lambda: refused != "no fla")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
    monkeypatch.setattr(megatron.cpu, "_fla_tilelang_usable", lambda: tilelang)
    reason = megatron.cpu.fla_unusable_reason()
    on_torch = megatron.cpu.torch_gdn_kernel_names()
    if refused == "no fla":
        assert reason.startswith("flash-linear-attention does not import"), reason
        assert on_torch == megatron.cpu.GDN_KERNELS
    elif refused:
        assert f"Triton {triton_version} on a Hopper GPU" in reason and "#640" in reason, reason
        # the bug is in the gated chunk rule's backward: FLA's conv1d and l2norm stay
        assert on_torch == ("chunk_gated_delta_rule",)
    else:
        assert reason is None and on_torch == (), reason


def test_only_the_named_kernels_are_bound(monkeypatch):
    """Where only the gated chunk rule is refused, FLA's conv1d and l2norm stay bound."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    import megatron.cpu
    from megatron.cpu import gdn_kernels

    sentinel = object()
    for module in (common, gdn):
        for name in megatron.cpu.GDN_KERNELS:
            monkeypatch.setattr(module, name, sentinel, raising=False)
    megatron.cpu.register_torch_gdn_kernels(("chunk_gated_delta_rule",))
    for module in (common, gdn):
        assert module.chunk_gated_delta_rule is gdn_kernels.chunk_gated_delta_rule
        assert module.causal_conv1d is sentinel and module.l2norm is sentinel
    with pytest.raises(ValueError, match="no torch GatedDeltaNet kernel named"):
        megatron.cpu.register_torch_gdn_kernels(("conv2d",))


def test_the_fla_check_tells_a_right_gated_rule_from_a_wrong_one():
    """``megatron.cpu.fla_gated_check`` on this host, the torch kernel standing in for FLA's: run in bf16
    against itself in fp32 it agrees; with beta scaled inside (a wrong db, and an output off with it),
    the check names what is wrong."""
    from megatron.cpu import fla_gated_check, gdn_kernels

    right = fla_gated_check.compare(gdn_kernels.chunk_gated_delta_rule, 32, 32, device="cpu")
    assert set(right) == {"out", *fla_gated_check.GRADS}
    assert fla_gated_check.verdict(right)[0], right

    def wrong_beta(q, k, v, g, beta, **kw):
        return gdn_kernels.chunk_gated_delta_rule(q, k, v, g, beta * 1.25, **kw)

    agrees, why = fla_gated_check.verdict(fla_gated_check.compare(wrong_beta, 32, 32, device="cpu"))
    assert not agrees and "beta" in why.split("(")[0] and "bar 0.02" in why, why


@pytest.mark.parametrize("agrees", [True, False], ids=["FLA agrees", "FLA differs"])
def test_a_hopper_run_keeps_fla_where_its_gated_rule_agrees(monkeypatch, agrees):
    """Triton in FLA #640's range on Hopper: the run checks FLA's gated rule at the model's head dims,
    keeps it (guard lifted) where it agrees, and binds the torch rule alone where it does not; one
    line says which and why."""
    from types import SimpleNamespace

    import megatron.cpu
    from examples.multimodal_dev.training import gdn_kernel_choice
    from megatron.cpu import fla_gated_check

    reason = "Triton 3.6.0 on a Hopper GPU compiles FLA's gated chunk backward wrongly (FLA issue #640)"
    monkeypatch.setattr(megatron.cpu, "fla_unusable_reason", lambda: reason)
    monkeypatch.setattr(megatron.cpu, "torch_gdn_kernel_names", lambda: ("chunk_gated_delta_rule",))
    asked, lifted, bound, said = [], [], [], []
    monkeypatch.setattr(
        fla_gated_check, "fla_gated_rule_agrees", lambda k, v: asked.append((k, v)) or (agrees, "the verdict")
    )
    monkeypatch.setattr(fla_gated_check, "lift_guard", lambda: lifted.append(True))
    monkeypatch.setattr(megatron.cpu, "register_torch_gdn_kernels", bound.append)
    monkeypatch.setattr(gdn_kernel_choice, "say", said.append)
    text = SimpleNamespace(linear_key_head_dim=128, linear_value_head_dim=96)
    monkeypatch.setattr(gdn_kernel_choice, "resolve_shape", lambda args: SimpleNamespace(text=text))
    gdn_kernel_choice.choose_gdn_kernels(SimpleNamespace())
    assert asked == [(128, 96)] and len(said) == 1 and "K=128 V=96" in said[0] and "the verdict" in said[0]
    if agrees:
        assert lifted and not bound and said[0].startswith("Gated DeltaNet runs flash-linear-attention's kernels")
    else:
        assert not lifted and bound == [("chunk_gated_delta_rule",)] and "#640" in said[0]

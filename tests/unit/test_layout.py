"""The package's layers (README, "Layout"): every import of every module, including the ones inside
functions, runs down the stack, and no two modules import each other, directly or round a circle.

    entry         pretrain_multimodal.py and what it hands megatron: arguments.py, checked_args.py,
                  model_provider.py, dataset_provider.py, forward_step.py
    launcher/     run_qwen35_vl.sh's launcher: the run as one typed RunConfig, checked, then torchrun;
                  the training script rebuilds that RunConfig from its flags and runs the same checks
    training/     engine glue: backend, throughput, run checks
    generation/   cached decoding and generate, the model at a generating command's layout
    serving/      the chat-completions endpoint: requests, the decoding loop, the HTTP app
    vision_ranks/ the vision tower's own layout, and its own ranks' process groups
    planner/      the layout planner: per-rank memory and step time of launch layouts, pipeline splits
    checkpoint/   formats and safety, HF <-> Megatron conversion
    data/         providers, collate, packing
    lora/         LoRA adapters on megatron-core's linears, their targets
    models/       registry, model code, MRoPE, FLOPs
    megatron_changes/  the table of changes to megatron: imports nothing of the project (names by path)
    evaluation/   scoring generated answers (text and JSON metrics): imports nothing of the project
    console.py    the training script's one-line messages: imports nothing of the project
    progress.py   long work's progress line (the checkpoint tools): imports nothing of the project
    megatron/cpu  the device layer
    tools/, benchmarks/   commands: they import the layers; nothing imports them
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "examples.multimodal_dev"
# lowest first; a module may import its own layer and the layers before it
LAYERS = (
    "megatron.cpu",
    f"{PACKAGE}.console",
    f"{PACKAGE}.progress",
    f"{PACKAGE}.lifetime",
    f"{PACKAGE}.megatron_changes",
    f"{PACKAGE}.evaluation",
    f"{PACKAGE}.models",
    f"{PACKAGE}.lora",
    f"{PACKAGE}.data",
    f"{PACKAGE}.checkpoint",
    f"{PACKAGE}.planner",
    f"{PACKAGE}.vision_ranks",
    f"{PACKAGE}.generation",
    f"{PACKAGE}.serving",
    f"{PACKAGE}.training",
    f"{PACKAGE}.post_training",
    f"{PACKAGE}.launcher",
    f"{PACKAGE}.entry",
    f"{PACKAGE}.commands",
)
ENTRY = {
    f"{PACKAGE}.{name}"
    for name in (
        "pretrain_multimodal",
        "arguments",
        "checked_args",
        "model_provider",
        "dataset_provider",
        "forward_step",
    )
}
COMMANDS = (f"{PACKAGE}.tools", f"{PACKAGE}.benchmarks")


def _modules() -> dict[str, str]:
    found = {}
    for top in ("examples/multimodal_dev", "megatron/cpu"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    if module in ENTRY or module == PACKAGE:
        return LAYERS.index(f"{PACKAGE}.entry")
    if module.startswith(COMMANDS):
        return LAYERS.index(f"{PACKAGE}.commands")
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    raise AssertionError(f"{module} belongs to no layer; add it to LAYERS")


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its body."""
    path = MODULES[module]
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:  # the longest prefix that is a module of ours ("from .x import fn" -> x)
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def upward_imports(graph) -> list[str]:
    return [
        f"{m} imports {dep}" for m, deps in sorted(graph.items()) for dep in sorted(deps) if layer_of(dep) > layer_of(m)
    ]


def circles(graph) -> list[str]:
    state, found = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                found.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_every_import_runs_down_the_layers():
    assert not upward_imports(GRAPH), "imports from a lower layer to a higher one:\n  " + "\n  ".join(
        upward_imports(GRAPH)
    )


def test_no_module_imports_back_round_a_circle():
    assert not circles(GRAPH), "modules importing each other:\n  " + "\n  ".join(circles(GRAPH))


def test_the_checks_catch_a_planted_violation():
    """The two checks can fail: one violation of each kind planted into a copy of the graph."""
    graph = {m: set(deps) for m, deps in GRAPH.items()}
    graph[f"{PACKAGE}.data.collate"].add(f"{PACKAGE}.checkpoint.files")
    graph[f"{PACKAGE}.models.qwen35_vl.mrope"].add(f"{PACKAGE}.models.qwen35_vl.model")
    assert upward_imports(graph) == [f"{PACKAGE}.data.collate imports {PACKAGE}.checkpoint.files"]
    model, mrope = f"{PACKAGE}.models.qwen35_vl.model", f"{PACKAGE}.models.qwen35_vl.mrope"
    assert [set(c.split(" -> ")) for c in circles(graph)] == [{model, mrope}]


HELPERS = (".timing", ".op_counter")


def test_tools_hold_only_commands():
    """tools/ is for commands users run: each module there runs as ``python -m`` and nothing in the
    package imports it (benchmarks/ likewise)."""
    for module, path in MODULES.items():
        # the benchmarks' two helpers: timing (alternating medians) and op_counter (ops and syncs a step)
        if module.startswith(COMMANDS) and not path.endswith("__init__.py") and not module.endswith(HELPERS):
            assert 'if __name__ == "__main__":' in open(path).read(), f"{module} is not a command"
    importers = [
        f"{m} imports {dep}"
        for m, deps in GRAPH.items()
        if not m.startswith(COMMANDS)
        for dep in deps
        if dep.startswith(COMMANDS)
    ]
    assert not importers, importers


# The planner is this architecture's cost model (it counts Gated DeltaNet and gated-attention layers,
# builds the model on the meta device and walks its Hugging Face name table), so it reads the model's
# own modules; every other layer serves any registered model and reaches it through its entry.
MODEL_PACKAGES = (f"{PACKAGE}.models.qwen35_vl",)
READS_THE_MODEL_ITSELF = (f"{PACKAGE}.models", f"{PACKAGE}.planner")


def model_package_imports(graph) -> list[str]:
    return [
        f"{m} imports {dep}"
        for m, deps in sorted(graph.items())
        if not m.startswith(READS_THE_MODEL_ITSELF)
        for dep in sorted(deps)
        if dep.startswith(MODEL_PACKAGES)
    ]


def test_other_layers_reach_the_model_through_the_registry():
    """Outside ``models/`` (and the planner), a model's package is reached through its
    ``MODEL_REGISTRY`` entry's seams, never imported: the registry is the seam, not a facade."""
    assert not model_package_imports(GRAPH), "imports of a model's package:\n  " + "\n  ".join(
        model_package_imports(GRAPH)
    )
    planted = {m: set(deps) for m, deps in GRAPH.items()}
    planted[f"{PACKAGE}.data.collate"].add(f"{PACKAGE}.models.qwen35_vl.mrope")
    assert model_package_imports(planted) == [f"{PACKAGE}.data.collate imports {PACKAGE}.models.qwen35_vl.mrope"]

"""MODEL_REGISTRY: model architecture name -> the seams the other layers reach a model through.

The data path, checkpoints, generation, the training glue and the commands never import a model's
package: they ask its entry (``model_of(shape)``, or ``get_model_entry(args.model_arch)``) for
the seam they need, and ``tests/unit/test_layout.py`` holds them to it. A new model is an entry
here plus its folder, filling every seam of ``SEAMS``.

Seams are dotted paths imported on first use, so listing or validating names (the launcher, the
planner's tables) does not import megatron-core or the model code.
"""

from __future__ import annotations

from examples.multimodal_dev.megatron_changes.applier import load

DEFAULT_ARCH = "qwen35_vl"  # --model-arch's default

# seam -> what it is: the contract every entry fills
SEAMS = {
    # shapes
    "variants": "{variant name: shape} of the released sizes",
    "shape_fn": "(variant name, moe=None, mtp=None) -> shape; an unknown name is a KeyError listing the valid ones",
    "shape_from_hf": "Hugging Face config (dict, object or config.json path) -> shape",
    "shape_to_hf": "shape -> Hugging Face config dict",
    # building
    "configs_fn": "(megatron args, shape, backend, flags given) -> (decoder, vision) TransformerConfigs",
    "build_fn": "(shape, backend=..., configs=..., pre_process=..., ...) -> the model of one pipeline stage",
    "parallel_problems": "(shape, tp, cp, ep, ...) -> the layouts this shape cannot be split by, one line each",
    "validate_parallel": "(shape, tp, cp, ep, ...) -> None, or ValueError naming the first problem",
    # the data path
    "packed_position_ids": "a packed (THD) row's MRoPE position ids from its tokens, grids and cu_seqlens",
    "padded_position_ids": "a left/right padded batch's MRoPE position ids (generation, verification)",
    "run_grids": "the vision grids of each run of vision tokens, in token order (video frames split)",
    "split_video_frames": "video grids [N, 3] -> one grid a frame (the temporal patches as segments)",
    "micro_batch_flops": "(shape, sample lengths, grids) -> FlopsBreakdown of a micro-batch's forward",
    "vision_flops": "(vision shape, out hidden, grids) -> the vision tower's forward FLOPs",
    "flops_breakdown": "the FlopsBreakdown type micro_batch_flops returns",
    # checkpoints
    "hf_mapping_rules": "shape -> the rules between Megatron and Hugging Face tensor names",
    "hf_model_state": "model -> its state dict in Megatron names, as the rules read it",
    "hf_fp32_suffixes": "Hugging Face tensor names kept in fp32 whatever the checkpoint's dtype",
    "load_hf_state": "(model, Hugging Face state dict, shape) -> None: the model filled in place",
}


class ModelEntry:
    """One architecture's seams (``SEAMS``), each imported on first use: ``entry.micro_batch_flops(...)``."""

    def __init__(self, package: str, **seams: str):
        missing, unknown = sorted(SEAMS.keys() - seams.keys()), sorted(seams.keys() - SEAMS.keys())
        if missing or unknown:
            raise TypeError(f"model entry {package}: missing seams {missing}, unknown seams {unknown}")
        self.package, self._paths, self._loaded = package, seams, {}

    def __getattr__(self, seam: str):
        paths = self.__dict__.get("_paths", {})
        if seam not in paths:
            raise AttributeError(f"a model entry has no seam {seam!r}; the seams are {', '.join(SEAMS)}")
        if seam not in self._loaded:
            module_name, _, name = paths[seam].rpartition(".")
            self._loaded[seam] = load(f"{__name__}{self.package}.{module_name}:{name}")
        return self._loaded[seam]


MODEL_REGISTRY: dict[str, ModelEntry] = {
    "qwen35_vl": ModelEntry(
        ".qwen35_vl",
        variants="configuration.VARIANTS",
        shape_fn="configuration.get_variant",
        shape_from_hf="configuration.from_hf_config",
        shape_to_hf="configuration.to_hf_config_dict",
        configs_fn="configuration.configs_from_args",
        build_fn="factory.build_model",
        parallel_problems="parallel.parallel_problems",
        validate_parallel="parallel.validate_parallel",
        packed_position_ids="mrope.packed_position_ids",
        padded_position_ids="mrope.padded_batch_position_ids",
        run_grids="mrope.run_grids",
        split_video_frames="mrope.split_video_frames",
        micro_batch_flops="flops.micro_batch_flops",
        vision_flops="flops.vision_flops",
        flops_breakdown="flops.FlopsBreakdown",
        hf_mapping_rules="hf_mapping.mapping_rules",
        hf_model_state="hf_mapping.model_state",
        hf_fp32_suffixes="hf_mapping.FP32_HF_SUFFIXES",
        load_hf_state="hf_mapping.load_hf_into_model",
    ),
}


def get_model_entry(name: str) -> ModelEntry:
    if name not in MODEL_REGISTRY:
        raise KeyError(f"unknown --model-arch {name!r}; valid: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[name]


def default_model() -> ModelEntry:
    """The entry of ``DEFAULT_ARCH``: the model of the run script and of the commands that take a
    variant name (``--model-variant``, ``MODEL_VARIANT``)."""
    return get_model_entry(DEFAULT_ARCH)


def model_of(shape) -> ModelEntry:
    """The entry of the architecture ``shape`` describes (each shape type names its ``arch``)."""
    return get_model_entry(type(shape).arch)

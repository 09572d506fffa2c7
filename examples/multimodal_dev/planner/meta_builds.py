"""Any rank of any launch layout built on the meta device, in this process: what that GPU holds
(parameters, bytes of weights, gradients and optimizer state) and the sharded checkpoint keys it
writes, without a GPU and without storage (397B parameters would not fit in host memory).

How a rank is built, as megatron.training's ``get_model`` builds it on that GPU:

- torch's fake process group (``FakeStore``, backend ``"fake"``) stands for the world of
  ``layout.gpus`` ranks, seen from rank ``rank``; megatron-core's ``initialize_model_parallel``
  makes every group of that rank (its gloo groups are off: gloo cannot run over a fake store);
- one model chunk per virtual stage (one without VP), ``pre_process`` / ``post_process`` set as
  ``get_model`` sets them, built under ``torch.device("meta")`` with ``use_cpu_initialization``
  and no initialisation. megatron-core places a few tensors on ``torch.cuda.current_device()``
  explicitly (Gated DeltaNet's ``conv1d``, ``A_log``, ``dt_bias``), which the device context does
  not override and which the CPU device layer turns into host tensors; ``_OnMeta`` sends every
  explicit device to meta as well, and ``rank_build`` refuses a build with any tensor off meta;
- megatron-core's groups are destroyed after each rank, so ranks are built one after another.

Memory per rank (``rank_memory``), as megatron's DDP and distributed optimizer keep it for a
bf16 run: weights in their dtype (bf16; ``A_log`` / ``dt_bias`` stay fp32); gradients in a
full-size fp32 buffer (megatron turns on ``--accumulate-allreduce-grads-in-fp32`` with bf16, and
the distributed optimizer reduce-scatters into that buffer, it does not shrink it); optimizer
state sharded over the parameter's data-parallel group: fp32 main parameters (none for fp32
parameters, which are their own main copy) plus Adam's ``exp_avg`` and ``exp_avg_sq`` (fp32), over
DP x CP for dense parameters and over expert DP = GPUs / (EP x ETP x PP) for experts
(``param.allreduce`` False, megatron's own test). Not counted: activations, and the alignment
padding of megatron's buffers (each parameter starts at a multiple of 64 elements, each bucket
ends at a multiple of DP: under 2,000 parameters a rank at the recommended layouts, so under 1 MB).

    layout = Layout.recommended("397b_a17b")
    build = rank_build(VARIANTS["397b_a17b"], layout, rank=224)  # the last stage's first rank
    rank_memory(build, layout)  # RankMemory(params=..., weight_bytes=..., grad_bytes=..., ...)
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..models import model_of
from ..models.qwen35_vl.configuration import Qwen35VLShape
from .launch_layout import Layout

GIB = 2**30


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    dtype: torch.dtype
    expert: bool  # reduced and sharded over expert DP
    trainable: bool = True  # False: frozen (LoRA's base), no gradient or optimizer state


@dataclass
class Chunk:
    """One model chunk (virtual stage) of a rank: its parameters and checkpoint shards (no data)."""

    vp_stage: int | None
    pre_process: bool
    post_process: bool
    params: list[Param]
    shards: list  # megatron ShardedTensors without data


@dataclass
class RankBuild:
    rank: int
    coords: dict  # this rank's megatron coordinates: pp, tp, cp, dp, ep, etp, edp
    chunks: list[Chunk] = field(default_factory=list)
    models: list[torch.nn.Module] = field(default_factory=list, repr=False, compare=False)  # kept where asked

    @property
    def params(self) -> list[Param]:
        return [p for c in self.chunks for p in c.params]


@dataclass(frozen=True)
class RankMemory:
    params: int
    expert_params: int
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


class _OnMeta(TorchFunctionMode):
    """Every explicit ``device=`` of a torch call becomes meta (the device context covers the rest)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("device") is not None:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_world(layout: Layout, rank: int, seed: int = 1234):
    """torch.distributed and megatron-core's groups of ``rank`` in a world of ``layout.gpus``
    fake ranks; yields the rank's coordinates. No default group may exist already."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < layout.gpus:
        raise ValueError(f"rank {rank}: the layout has {layout.gpus} GPUs")
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process; meta builds need "
            "their own fake world (destroy the process group first)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.gpus)
    try:
        ps.initialize_model_parallel(
            layout.tp,
            layout.pp,
            layout.vp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            create_gloo_process_groups=False,
        )
        model_parallel_cuda_manual_seed(seed)
        coords = dict(
            pp=ps.get_pipeline_model_parallel_rank(),
            tp=ps.get_tensor_model_parallel_rank(),
            cp=ps.get_context_parallel_rank(),
            dp=ps.get_data_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_rank(),
            edp=ps.get_expert_data_parallel_rank(),
        )
        assert coords == coords_of(layout, rank), (rank, coords, coords_of(layout, rank))
        yield coords
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _shards(model, rank: int, chunk: int) -> list:
    """The chunk's checkpoint ShardedTensors (factories applied, e.g. the split GDN in_proj), data dropped."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    try:
        state = model.sharded_state_dict()
    except AssertionError as err:  # megatron-core's own consistency checks of a stage's checkpoint keys
        where = traceback.extract_tb(err.__traceback__)[-1]
        raise RuntimeError(
            f"rank {rank} chunk {chunk}: megatron-core's sharded_state_dict asserts in "
            f"{where.name} ({os.path.basename(where.filename)}:{where.lineno}): {where.line}"
        ) from err
    apply_factories(state)
    return [t.without_data() for t in nested_values(state) if isinstance(t, ShardedTensor)]


def rank_build(
    shape: Qwen35VLShape,
    layout: Layout,
    rank: int,
    backend: str = "local",
    shards: bool = True,
    keep_models: bool = False,
    lora=None,
) -> RankBuild:
    """Build every model chunk of ``rank`` on meta (bf16); returns its parameters and, with
    ``shards``, its checkpoint shards (and the modules themselves in ``models`` when ``keep_models``).
    ``lora`` (``lora.targets.LoraSettings``): the chunks get adapters as a LoRA run's do."""
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    import megatron.cpu

    from ..lora.apply import apply as lora_apply

    layout.check(shape)
    megatron.cpu.activate()  # megatron's CUDA calls during the build (RNG tracker, devices) answered on a CPU host
    settings: dict[str, Any] = dict(layout.settings(), use_cpu_initialization=True, perform_initialization=False)
    with fake_world(layout, rank) as coords:
        build = RankBuild(rank, coords)
        models = []
        for v in range(layout.vp or 1):
            stage = v if layout.vp else None
            pre = coords["pp"] == 0 and (stage is None or is_vp_first_stage(stage, layout.vp))
            post = coords["pp"] == layout.pp - 1 and (stage is None or is_vp_last_stage(stage, layout.vp))
            with torch.device("meta"), _OnMeta():
                model = model_of(shape).build_fn(
                    shape,
                    backend,
                    params_dtype=torch.bfloat16,
                    pre_process=pre,
                    post_process=post,
                    vp_stage=stage,
                    **settings,
                )
            if lora is not None:
                lora_apply(model, lora.rank, float(lora.rank), 0.0, lora.targets, seed=0)
            off_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
            if off_meta:
                raise RuntimeError(f"rank {rank} chunk {v}: tensors not on the meta device: {off_meta[:8]}")
            params = [
                Param(n, p.numel(), p.dtype, not getattr(p, "allreduce", True), p.requires_grad)
                for n, p in model.named_parameters()
            ]
            build.chunks.append(Chunk(stage, pre, post, params, _shards(model, rank, v) if shards else []))
            models.append(model)
    if keep_models:
        build.models = models
    return build


def rank_memory(build: RankBuild, layout: Layout) -> RankMemory:
    """Bytes the rank keeps for weights, fp32 gradients and the distributed optimizer's state."""
    weights = grads = 0
    optimizer = 0.0
    for p in build.params:
        weights += p.numel * p.dtype.itemsize
        if not p.trainable:
            continue
        grads += p.numel * 4
        state = 8 + (0 if p.dtype == torch.float32 else 4)  # exp_avg + exp_avg_sq (+ fp32 main copy)
        optimizer += p.numel * state / (layout.expert_dp if p.expert else layout.dense_shards)
    params = build.params
    return RankMemory(sum(p.numel for p in params), sum(p.numel for p in params if p.expert), weights, grads, optimizer)


def coords_of(layout: Layout, rank: int) -> dict:
    """``rank``'s coordinates in megatron's default order (tp-cp-ep-dp-pp): the dense grid counts
    TP fastest, then CP, DP, PP; the expert grid ETP, then EP, expert DP, PP. ``rank_build``
    checks them against the groups ``initialize_model_parallel`` made."""
    tp, r = rank % layout.tp, rank // layout.tp
    cp, r = r % layout.cp, r // layout.cp
    dp, pp = r % layout.dp, r // layout.dp
    etp, r = rank % layout.etp, rank // layout.etp
    ep, edp = r % layout.ep, (r // layout.ep) % layout.expert_dp
    return dict(pp=pp, tp=tp, cp=cp, dp=dp, ep=ep, etp=etp, edp=edp)


def representative_ranks(layout: Layout) -> dict[str, int]:
    """{label: rank}: the first rank of the first, a middle and the last pipeline stage (each
    with all its virtual stages), and for EP > 1 the first stage's rank of the last
    expert-parallel coordinate."""
    if layout.pp == 1:
        picks = {"every stage": 0}
    else:
        stages = {"first stage": 0, "middle stage": layout.pp // 2, "last stage": layout.pp - 1}
        if layout.pp == 2:
            del stages["middle stage"]
        picks = {label: p * layout.stage_gpus for label, p in stages.items()}
    if layout.ep > 1:
        picks[f"first stage, EP rank {layout.ep - 1}"] = layout.etp * (layout.ep - 1)
    return picks


def main_replica_ranks(layout: Layout) -> list[int]:
    """Ranks that hold every tensor shard's main replica: those of data-parallel rank 0 (dense
    shards) and of expert data-parallel rank 0 (expert shards). Every other rank holds a copy of
    one of theirs, so building these covers every distinct model-parallel rank."""
    ranks = []
    for rank in range(layout.gpus):
        c = coords_of(layout, rank)
        if (c["dp"] == 0 and c["cp"] == 0) or c["edp"] == 0:
            ranks.append(rank)
    return ranks


def sampled_ranks(layout: Layout, full_stages) -> list[int]:
    """The main-replica ranks of the pipeline stages ``full_stages``; of every other stage, its
    first tensor-parallel group and its last rank (the far end of the expert coordinates)."""
    full = set(full_stages)
    ranks = set(r for r in main_replica_ranks(layout) if r // layout.stage_gpus in full)
    for p in set(range(layout.pp)) - full:
        first = p * layout.stage_gpus
        ranks |= set(range(first, first + layout.tp)) | {first + layout.stage_gpus - 1}
    return sorted(ranks)

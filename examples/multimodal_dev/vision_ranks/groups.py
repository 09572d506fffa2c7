"""The vision tower on ranks of its own (``--vision-nproc k``): process groups, megatron's globals
and the hooks megatron.training needs to run two modules on two process grids in one world.

Ranks ``0..k-1`` hold only the tower (grid [VISION_TP, 1, VISION_DP, 1]); ranks ``k..N-1`` hold only
the language model (grid [TP, CP, DP, PP] at offset k, plus its expert view). Both grids are
megatron-core ``HyperCommGrid``s, and megatron-core's ``MultiModulePipelineCommunicator`` hands a
micro-batch's features from the tower to the language model's first stage and their gradient back.
Handed a ``MultiModuleProcessGroupCollection``, megatron.training picks the non-interleaved pipeline
schedule, where the tower is one stage more: it runs ahead of the language model by the schedule's
warm-up, as a pipeline stage does.

megatron.training and megatron-core read ``parallel_state``'s getters in many places (the model's
layers, DDP, the optimizer, checkpoints). Each rank fills those globals with its own module's
groups before anything is built, so every getter answers for the module the rank holds. What is
world-wide is said where it happens:

* the grad norm and clipping: the distributed optimizer's grad-statistics group is the world, so
  each rank adds its shards' squares once (TP duplicates dropped by its module's own TP rank);
* per-token loss: the token count lives on the language model's last stage; every rank divides its
  gradients by the world's count (``finalize_model_grads``);
* the FLOPs meter: the tower's ranks join its all-reduce and add nothing (dataset_provider.py);
* checkpoints: each module's ranks write their own shards of the ordinary layout's keys, the
  tower's RNG states under ``vision.rng_state`` (``stage.VisionStage.rng_state_key_prefix``), and the
  common state is the language model's (``language_common``).

Data parallelism: the tower's DP is a multiple or a divisor of the language model's.

* fan-in (m vision replicas a language replica): megatron-core's bridge hands language replica i
  the features of vision replicas ``i*m .. i*m+m-1`` joined in that order, and its gradient back in
  m equal parts. Each of those m replicas reads replica i's micro-batches and encodes a share of
  their images and videos, dealt by vision FLOPs (``vision_context_parallel.shares_of``, which the
  language side computes again from the grids to put the features in batch order), padded to the
  largest share.
* fan-out (a vision replica for r language replicas): vision replica j reads a micro-batch of each
  of replicas ``j*r .. j*r+r-1`` (splits of its own for each), encodes them and sends them joined,
  with the rows of each (``forward_step.vision_features``); the bridge splits them by those sizes
  and joins the gradients coming back in the same order.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from examples.multimodal_dev.console import say
from examples.multimodal_dev.megatron_changes import apply as apply_changes

VISION, LANGUAGE = "vision", "language"
_DIMS = ["tp", "cp", "dp", "pp"]
_EXPERT_DIMS = ["expt_tp", "ep", "expt_dp", "pp"]
_LAYOUT: "SeparateRanks | None" = None


def active() -> "SeparateRanks | None":
    """This run's layout, or None when the tower is on the language model's ranks."""
    return _LAYOUT


@dataclass
class SeparateRanks:
    role: str  # VISION or LANGUAGE: the module this rank holds
    groups: object  # ProcessGroupCollection of that module
    pg_collection: object  # the MultiModuleProcessGroupCollection megatron.training is handed
    communicator: object  # MultiModulePipelineCommunicator
    first_language: int  # the world rank of the language model's first rank (the tower's ranks come before)
    fan_in: int = 1  # vision replicas per language replica
    fan_out: int = 1  # language replicas per vision replica (on the tower's ranks: the micro-batches it reads at once)
    data_rank: int = 0  # the (first) language data-parallel rank whose micro-batches this rank reads
    data_size: int = 1  # the language model's data-parallel size

    @property
    def share(self) -> int:
        """Which of the ``fan_in`` shares of a micro-batch's items this vision replica encodes."""
        return self.groups.dp.rank() % self.fan_in if self.on_vision else 0

    @property
    def on_vision(self) -> bool:
        return self.role == VISION


@contextlib.contextmanager
def language_world(given):
    """megatron's argument checks size data parallelism, the micro-batch count and the batch from
    WORLD_SIZE: under ``--vision-nproc k`` the language model's ranks are WORLD_SIZE - k. (Once
    torch.distributed starts, megatron takes the world size from it again.)"""
    k, world = getattr(given, "vision_nproc", 0), os.environ.get("WORLD_SIZE")
    if not k or world is None:
        yield
        return
    os.environ["WORLD_SIZE"] = str(int(world) - k)
    try:
        yield
    finally:
        os.environ["WORLD_SIZE"] = world


def _grid_groups(grid, expert_shape=None):
    """Every group megatron reads of one module's grid (collective: every rank, in one order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    g = ProcessGroupCollection()
    g.tp, g.cp, g.dp, g.pp = (grid.create_pg(d) for d in ("tp", "cp", "dp", "pp"))
    g.mp, g.tp_cp = grid.create_pg(["tp", "pp"]), grid.create_pg(["tp", "cp"])
    g.dp_cp, g.tp_dp_cp, g.tp_dp = (
        grid.create_pg(["dp", "cp"]),
        grid.create_pg(["tp", "cp", "dp"]),
        grid.create_pg(["tp", "dp"]),
    )
    if expert_shape is None:  # the tower has no experts: its expert groups are its dense ones
        g.ep, g.expt_tp, g.tp_ep, g.tp_ep_pp, g.expt_dp = g.cp, g.tp, g.tp, g.mp, g.dp
    else:
        grid.register_view("expert", expert_shape, _EXPERT_DIMS, shared_dims=["pp"])
        g.expt_tp, g.ep, g.expt_dp = (grid.create_pg(d, view="expert") for d in ("expt_tp", "ep", "expt_dp"))
        g.tp_ep = grid.create_pg(["expt_tp", "ep"], view="expert")
        g.tp_ep_pp = grid.create_pg(["expt_tp", "ep", "pp"], view="expert")
    g.intra_dp_cp, g.intra_expt_dp = g.dp_cp, g.expt_dp
    g.dp_cp_gtp_remat, g.expt_dp_gtp_remat = g.dp_cp, g.expt_dp  # no fallback to the getters in checkpoints
    g.intra_dist_opt = dist.group.WORLD  # the grad norm is the world's (module docstring)
    return g


def _gloo_twins(grid, expert_shape=None) -> dict:
    """megatron's gloo copies of the data-parallel groups (the distributed optimizer's checkpoint
    reads them), from a gloo grid of the same shape: made on every host alike, collectively."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    twin = HyperCommGrid(grid.shape, grid.dim_names, rank_offset=grid.rank_offset, backend="gloo")
    out = {"dp": twin.create_pg("dp"), "dp_cp": twin.create_pg(["dp", "cp"])}
    if expert_shape is None:
        out["expt_dp"] = out["dp"]
    else:
        twin.register_view("expert", expert_shape, _EXPERT_DIMS, shared_dims=["pp"])
        out["expt_dp"] = twin.create_pg("expt_dp", view="expert")
    return out


def _embedding_groups(grid, groups) -> None:
    """Tied / MTP-shared word embeddings: the first and last stage of each language pipeline."""
    mine, pos, rank = None, None, dist.get_rank()  # None where this rank is not a member, as megatron's
    for ranks in grid.get_rank_enum("pp"):
        embd, position = sorted({ranks[0], ranks[-1]}), [ranks[0]]
        made = dist.new_group(embd), dist.new_group(position)
        mine = made[0] if rank in embd else mine
        pos = made[1] if rank in position else pos
    groups.embd, groups.pos_embd = mine, pos


def _ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def fill_parallel_state(g, gloo: dict) -> None:
    """parallel_state's globals from this rank's module groups ``g`` (and their ``gloo`` twins):
    every getter megatron reads then answers for that module. Left None: the GTP weight-remat
    groups, hierarchical CP, virtual pipeline and the ``_MPU_*`` overrides (their readers accept None)."""
    from megatron.core import parallel_state as ps

    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    ps._TENSOR_MODEL_PARALLEL_GROUP, ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = g.tp, _ranks(g.tp)
    ps._MODEL_PARALLEL_GROUP, ps._MODEL_PARALLEL_GLOBAL_RANKS = g.mp, _ranks(g.mp)
    ps._CONTEXT_PARALLEL_GROUP, ps._CONTEXT_PARALLEL_GLOBAL_RANKS = g.cp, _ranks(g.cp)
    ps._PIPELINE_MODEL_PARALLEL_GROUP, ps._PIPELINE_GLOBAL_RANKS = g.pp, _ranks(g.pp)
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = g.tp_cp
    ps._DATA_PARALLEL_GROUP = ps._DATA_PARALLEL_GROUP_WITH_GTP_REMAT = g.dp
    ps._DATA_PARALLEL_GLOBAL_RANKS = _ranks(g.dp)
    ps._DATA_PARALLEL_GROUP_WITH_CP = ps._DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT = g.dp_cp
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = _ranks(g.dp_cp)
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = g.intra_dp_cp
    ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT = g.intra_dp_cp
    ps._TENSOR_AND_DATA_PARALLEL_GROUP, ps._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = g.tp_dp, g.tp_dp_cp
    ps._EMBEDDING_GROUP, ps._EMBEDDING_GLOBAL_RANKS = g.embd, _ranks(g.embd)
    ps._POSITION_EMBEDDING_GROUP, ps._POSITION_EMBEDDING_GLOBAL_RANKS = g.pos_embd, _ranks(g.pos_embd)
    ps._EXPERT_MODEL_PARALLEL_GROUP, ps._EXPERT_MODEL_PARALLEL_RANKS = g.ep, _ranks(g.ep)
    ps._EXPERT_TENSOR_PARALLEL_GROUP = g.expt_tp
    ps._EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = g.tp_ep
    ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = g.tp_ep_pp
    ps._EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP = g.tp_ep_pp
    ps._EXPERT_DATA_PARALLEL_GROUP = ps._EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT = g.expt_dp
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = g.intra_expt_dp
    ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT = g.intra_expt_dp
    ps._INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = g.intra_dist_opt
    ps._DATA_PARALLEL_GROUP_GLOO = gloo["dp"]
    ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = gloo["dp_cp"]
    ps._EXPERT_DATA_PARALLEL_GROUP_GLOO = ps._INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO = gloo["expt_dp"]


def _pipeline_config(args):
    """What megatron-core's communicators read of a config: the dtype of the tensors they move, and
    shapes exchanged per micro-batch (packed rows and image counts vary)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return ModelParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        variable_seq_lengths=True,
    )


def setup(args) -> SeparateRanks:
    """Start torch.distributed, make both grids' groups, fill parallel_state and seed: before
    ``pretrain`` (which then skips its own model-parallel set-up)."""
    global _LAYOUT
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    _start_world(args)
    k, world = args.vision_nproc, dist.get_world_size()
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    dp = (world - k) // (tp * cp * pp)
    vtp = args.vision_tensor_parallel_size or tp
    etp, ep = args.expert_tensor_parallel_size or tp, args.expert_model_parallel_size
    vision_grid = HyperCommGrid([vtp, 1, k // vtp, 1], _DIMS, rank_offset=0)
    language_grid = HyperCommGrid([tp, cp, dp, pp], _DIMS, rank_offset=k)
    expert_shape = [etp, ep, tp * cp * dp // (etp * ep), pp]
    vision, language = _grid_groups(vision_grid), _grid_groups(language_grid, expert_shape)
    gloo = {VISION: _gloo_twins(vision_grid), LANGUAGE: _gloo_twins(language_grid, expert_shape)}
    _embedding_groups(language_grid, language)
    vision.embd = vision.pos_embd = None
    role = VISION if dist.get_rank() < k else LANGUAGE
    groups = vision if role == VISION else language
    fill_parallel_state(groups, gloo[role])
    communicator = _communicator(args, vision_grid, language_grid)
    pg_collection = MultiModuleProcessGroupCollection({role: groups}, LANGUAGE if role == LANGUAGE else None)
    _seed(args, groups)
    vdp = k // vtp
    fan_in, fan_out = max(vdp // dp, 1), max(dp // vdp, 1)
    data_rank = groups.dp.rank() // fan_in * fan_out if role == VISION else groups.dp.rank()
    _LAYOUT = SeparateRanks(
        role, groups, pg_collection, communicator, k, fan_in, fan_out if role == VISION else 1, data_rank, dp
    )
    apply_changes("vision-ranks", _LAYOUT)  # get_model and the checkpoint's common state
    if role == VISION:  # the language replica's first rank writes the stream both read
        from examples.multimodal_dev.checkpoint import loader_state

        loader_state.reads_only()
        args.no_load_rng = args.no_load_rng or not _tower_rng_resumes(args, vtp)
    return _LAYOUT


def _start_world(args) -> None:
    """torch.distributed over the whole world, unless already started: args.world_size counts only
    the language model's ranks, so the size comes from the environment."""
    from datetime import timedelta

    if not dist.is_initialized():
        dist.init_process_group(
            backend=args.distributed_backend,
            world_size=int(os.environ["WORLD_SIZE"]),
            rank=int(os.environ["RANK"]),
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )


def _communicator(args, vision_grid, language_grid):
    """megatron-core's bridge that hands the tower's features to the language model's first stage."""
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator

    return MultiModulePipelineCommunicator(
        {VISION: vision_grid, LANGUAGE: language_grid},
        {VISION: [LANGUAGE], LANGUAGE: []},
        _pipeline_config(args),
        dim_mapping={"s": 0, "b": 1, "h": 2},
        module_output_ndim={VISION: 2},
    )


def _seed(args, groups) -> None:
    """megatron's random seeds and RNG trackers, over this rank's module groups."""
    from megatron.training.initialize import _set_random_seed

    _set_random_seed(
        args.seed,
        args.data_parallel_random_init,
        args.te_rng_tracker,
        args.inference_rng_tracker,
        use_cudagraphable_rng=args.cuda_graph_impl != "none",
        pp_group=groups.pp,
        dp_group=groups.dp,
        tp_group=groups.tp,
        ep_group=groups.ep,
        etp_group=groups.expt_tp,
    )


def _tower_rng_resumes(args, vtp: int) -> bool:
    """Whether ``--load`` holds the tower's random states for this layout of its ranks: a checkpoint
    written with the same VISION_NPROC and VISION_TP. One of the ordinary layout has none (the tower
    was part of the language model's ranks) and one of another split stores them in another shape;
    from those the tower's ranks start from the seed, as megatron does at another TP or PP, and the
    language model's ranks resume theirs."""
    from examples.multimodal_dev.checkpoint.files import checkpoint_directory, latest_iteration, stored_args

    if not args.load or args.finetune or latest_iteration(args.load) is None:
        return True
    stored = stored_args(checkpoint_directory(args.load))
    if stored is None:
        return True
    saved = (
        getattr(stored, "vision_nproc", 0) or 0,
        getattr(stored, "vision_tensor_parallel_size", None) or stored.tensor_model_parallel_size,
    )
    if saved == (args.vision_nproc, vtp):
        return True
    where = f"VISION_NPROC={saved[0]} VISION_TP={saved[1]}" if saved[0] else "the ordinary layout"
    say(
        f"--load {args.load} was written with {where}: the vision tower's ranks "
        f"(VISION_NPROC={args.vision_nproc} VISION_TP={vtp}) start their random state from the seed"
    )
    return False


def module_get_model(get_model, layout: SeparateRanks):
    """megatron.training's get_model reads ``pg_collection.pp`` off the collection it is handed: give
    it this rank's module groups (the schedule keeps the multi-module collection). A megatron_changes
    row, applied by ``setup``."""

    @functools.wraps(get_model)
    def module_get_model(model_provider_func, model_type, wrap_with_ddp=True, config=None, pg_collection=None):
        return get_model(model_provider_func, model_type, wrap_with_ddp, config, layout.groups)

    return module_get_model


def with_language_common(generate_state_dict, layout: SeparateRanks):
    """A saved checkpoint's common state is the language model's (``language_common``). A
    megatron_changes row, applied by ``setup``."""

    @functools.wraps(generate_state_dict)
    def with_language_common(*args, **kwargs):
        state = generate_state_dict(*args, **kwargs)
        # a save passes the iteration; a load's template has none, and its common state comes from the file
        return language_common(state, layout) if kwargs.get("iteration") is not None else state

    return with_language_common


def language_common(state: dict, layout: SeparateRanks) -> dict:
    """A checkpoint's state with the language model's common part on every rank (collective).

    dist_checkpointing keeps what is not sharded (the arguments, the iteration, the scheduler, the
    optimizer's param groups) once, from world rank 0, which holds the tower here. The tower's
    param groups are a subset of the language model's (the same settings; no expert groups), and
    megatron's optimizer matches groups by their settings on load, so the language model's common
    part serves both modules, in this layout and in the ordinary one. The first language rank
    sends it; each vision rank keeps its own sharded tensors and objects under it."""
    from megatron.core.dist_checkpointing.dict_utils import merge
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    sharded, common = extract_sharded_base(state)
    sent = [common if dist.get_rank() == layout.first_language else None]
    dist.broadcast_object_list(sent, src=layout.first_language)
    return merge(sent[0], sharded) if layout.on_vision else state


def finalize_model_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron-core's gradient finalisation on this rank's module groups, then the per-token
    scaling by the world's token count: the tower's ranks count no tokens themselves. The count is
    the language model's last stage's, once per data-parallel replica (its TP rank 0)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads as finalize

    layout = active()
    finalize(model, None, pg_collection=layout.groups, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    g = layout.groups
    counts = layout.role == LANGUAGE and g.pp.rank() == g.pp.size() - 1 and g.tp.rank() == 0
    total = (num_tokens if counts else torch.zeros_like(num_tokens)).to(torch.float32)
    dist.all_reduce(total)
    scaling = 1.0 / total.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)

"""The table: every attribute of megatron-core, megatron.training, megatron-energon,
torch.distributed.checkpoint and torch's Dynamo this project replaces or sets, what replaces it, why,
and when.

One row per replaced attribute, in the order they are applied (rows of one target wrap each other
in that order: the later row is outermost). ``target`` and ``replacement`` are ``module:attribute``;
a replacement is a factory ``make(original, run) -> new`` (``run``: the run's args and meter, or
what the group's caller hands ``apply``), except in the device layer's rows, which
``megatron.cpu`` applies itself and which name the function that is put in place, and in the rows
applied by their own call, which name the function that makes the change.

``applies`` says when:
    every run                 ``install(args, ...)`` applies it to every training run
    without Apex or TE        ... when megatron-core has no fused Adam (torch's Adam)
    megatron-core wheel       ... when the wheel's prebuilt dataset helpers import
    on use                    the module that needs it calls ``apply(group)`` (named in ``why``)
    by its own call           the function named sets a value, not a function to wrap (a queue
                              made again when its manager is gone, a setting read before megatron
                              is imported), called where ``why`` says; ``install`` checks that its
                              target exists
    megatron.cpu: ...         the device layer applies it (a CPU host; torch GDN kernels)

Not in the table, because they change no behaviour of megatron: the process groups the vision
tower's own ranks set as megatron's ``parallel_state`` globals (``vision_ranks/groups.py``: state megatron
reads, like ``initialize_model_parallel`` sets), and the device layer's stubs of ``torch.cuda``
(``megatron/cpu/device_compat.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

WRITTEN_FOR = "0.19.2"  # the megatron-core every row was written against and tested with

EVERY_RUN, NO_FUSED_ADAM, WHEEL, ON_USE = "every run", "without Apex or TE", "megatron-core wheel", "on use"
OWN_CALL = "by its own call"
DEVICE_LAYER_CPU, DEVICE_LAYER_GDN = "megatron.cpu: CPU host", "megatron.cpu: no FLA kernels"


@dataclass(frozen=True)
class Change:
    group: str
    target: str
    replacement: str
    why: str
    applies: str = EVERY_RUN
    options: tuple = ()  # keyword arguments of the factory, as (name, value) pairs
    upstream: str = ""  # the upstream issue or pull request, where one exists

    @property
    def by_device_layer(self) -> bool:
        return self.applies.startswith("megatron.cpu")


_P = "examples.multimodal_dev."
_DO = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer."
_OPT = "megatron.core.optimizer.optimizer:"
_CKPT = "megatron.training.checkpointing:"
_GDN = "megatron.core.ssm.gated_delta_net."


def _switch(cls: str, distributed: bool, half: bool) -> tuple[Change, ...]:
    opts = (("distributed", distributed), ("half", half))
    why = "a checkpoint of the other kind of optimizer (distributed <-> plain) resumes: its state is translated"
    return (
        Change(
            "optimizer-switch",
            f"{cls}.sharded_state_dict",
            f"{_P}checkpoint.optimizer_switch:switching_request",
            why,
            options=opts,
        ),
        Change(
            "optimizer-switch",
            f"{cls}.load_state_dict",
            f"{_P}checkpoint.optimizer_switch:switching_load",
            why,
            options=opts,
        ),
    )


def _torch_gdn(module: str) -> tuple[Change, ...]:
    why = (
        "megatron-core's GatedDeltaNet imports FLA's kernels by name; without FLA (a CPU host, FLA refused) "
        "the torch kernels take those names (and common.HAVE_FLA is set)"
    )
    return tuple(
        Change("torch-gdn-kernels", f"{_GDN}{module}:{name}", f"megatron.cpu.gdn_kernels:{name}", why, DEVICE_LAYER_GDN)
        for name in ("causal_conv1d", "chunk_gated_delta_rule", "l2norm")
    )


CHANGES: tuple[Change, ...] = (
    # A checkpoint directory is data: nothing in it may run code (checkpoint/safety.py).
    Change(
        "checkpoints-are-data",
        "torch.distributed.checkpoint.filesystem:pickle",
        f"{_P}checkpoint.safety:restricted_pickle",
        "DCP unpickles the .metadata index with plain pickle: only DCP's own classes, torch sizes and dtypes and "
        "builtin containers may be named (also applied on use by the checkpoint tools)",
    ),
    Change(
        "checkpoints-are-data",
        "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes",
        f"{_P}checkpoint.safety:weights_only_load_bytes",
        "DCP loads every non-tensor entry with torch.load(weights_only=False); weights_only=True with megatron's "
        "safe globals instead",
    ),
    # torch's Adam under the distributed optimizer (megatron/cpu/distrib_optimizer_fixes.py).
    Change(
        "torch-adam-distributed-optimizer",
        f"{_DO}state_dict",
        "megatron.cpu.distrib_optimizer_fixes:state_dict_with_state",
        "state_dict() asserts one Adam step, which a fresh torch Adam does not have yet",
        NO_FUSED_ADAM,
    ),
    Change(
        "torch-adam-distributed-optimizer",
        f"{_DO}load_state_dict",
        "megatron.cpu.distrib_optimizer_fixes:load_state_dict_keeping_step",
        "the parameter-state load overwrote the checkpoint's Adam step with 1 (wrong bias correction after a "
        "resume, silently)",
        NO_FUSED_ADAM,
    ),
    Change(
        "torch-adam-distributed-optimizer",
        f"{_DO}_set_main_param_and_optimizer_states",
        "megatron.cpu.distrib_optimizer_fixes:set_states_without_grad",
        "an in-place copy into an fp32 leaf that requires grad, which torch refuses outside no_grad",
        NO_FUSED_ADAM,
    ),
    # The optimizer step without a per-parameter loop on the host (training/optimizer_host_work.py).
    Change(
        "optimizer-host-work",
        "megatron.core.optimizer.clip_grads:l2_norm_impl",
        f"{_P}training.optimizer_host_work:foreach_l2_norm",
        "the grad norm's fallback took one norm per parameter and read each back to the host (a GPU sync per "
        "parameter); one foreach norm instead, left on the device",
        NO_FUSED_ADAM,
    ),
    Change(
        "optimizer-host-work",
        "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",
        f"{_P}training.optimizer_host_work:foreach_scale",
        "gradient clipping scaled one gradient at a time; one foreach multiply",
        NO_FUSED_ADAM,
    ),
    Change(
        "optimizer-host-work",
        f"{_OPT}multi_tensor_scale_impl",
        f"{_P}training.optimizer_host_work:foreach_scale",
        "the main-to-model parameter copy ran one copy per parameter; one foreach copy",
        NO_FUSED_ADAM,
    ),
    Change(
        "optimizer-host-work",
        "megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups",
        f"{_P}training.optimizer_host_work:fused_adam",
        "torch's AdamW loops over the parameters in Python on a CPU and takes eight passes over memory on a "
        "GPU (foreach), reading every step count on the host; its fused kernel on every host, so a CPU host "
        "runs (and counts) the GPU's step",
        NO_FUSED_ADAM,
    ),
    Change(
        "thd-rotary-in-one-pass",
        "megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_thd",
        f"{_P}models.common.rope_thd:rotary_thd",
        "the unfused THD rotary read cu_seqlens back to the host and rotated one sequence at a time (every "
        "vision block, every image frame); one device-side index and one rotation, the same result",
    ),
    Change(
        "gdn-segments-compared-once",
        f"{_GDN}gdn:torch",
        f"{_P}models.common.gated_delta_net_fp32_decay:torch_comparing_by_identity",
        "GatedDeltaNet asserts torch.equal(cu_seqlens_q, cu_seqlens_kv) in every layer, and CUDA's equal reads "
        "both back (a sync a layer; CPU's equal answers a tensor compared with itself at once): the module's "
        "torch answers that case as CPU's does, and compares other pairs as torch.equal",
    ),
    # A bf16 model with fp32 A_log / dt_bias (checkpoint/mixed_dtype_optimizer.py).
    Change(
        "mixed-dtype-optimizer",
        f"{_OPT}Float16OptimizerWithFloat16Params.sharded_state_dict",
        f"{_P}checkpoint.mixed_dtype_optimizer:every_parameter_as_half_around",
        "the plain optimizer's checkpoint lists parameters in the distributed optimizer's order",
    ),
    Change(
        "mixed-dtype-optimizer",
        f"{_OPT}Float16OptimizerWithFloat16Params.load_state_dict",
        f"{_P}checkpoint.mixed_dtype_optimizer:every_parameter_as_half_around",
        "... and reads them in that order",
    ),
    Change(
        "mixed-dtype-optimizer",
        f"{_DO}__init__",
        f"{_P}checkpoint.mixed_dtype_optimizer:ordered_index_map",
        "the distributed optimizer's group index map in the optimizer's own order, with fp32 parameters "
        "among bf16 ones",
    ),
    # Megatron-FSDP's checkpoints (checkpoint/fsdp_state.py).
    Change(
        "megatron-fsdp",
        f"{_DO}sharded_param_state_fsdp_dtensor",
        f"{_P}checkpoint.fsdp_state:every_parameter_has_state",
        "an fsdp_dtensor save hung: ranks whose shard of a parameter is empty hold no Adam state for it, "
        "and the save's per-tensor collectives then differ between ranks",
    ),
    Change(
        "megatron-fsdp",
        "megatron.training.training:load_checkpoint",
        f"{_P}checkpoint.fsdp_state:nothing_to_load_changes_nothing",
        "with no checkpoint to load, an fsdp_dtensor run's load still took an optimizer step on zero "
        "gradients (to shape Adam's state), so a fresh run with --load trained differently from one without",
    ),
    Change(
        "megatron-fsdp",
        "megatron.core.transformer.fsdp_dtensor_checkpoint:get_expert_index_from_key",
        f"{_P}checkpoint.fsdp_state:grouped_weights_name_no_expert",
        "an fsdp_dtensor save of grouped experts stopped: megatron reads an expert index off the end of "
        "every ...experts.linear_fc1.weight key, and ours hold all the experts in one 3-D weight",
    ),
    # Optimizer checkpoint formats (checkpoint/optimizer_format.py).
    Change(
        "optimizer-formats",
        f"{_DO}sharded_param_state_dp_reshardable",
        f"{_P}checkpoint.optimizer_format:zeroed_padding",
        "a dp_reshardable save wrote uninitialised padding bytes: no two saves of one state were equal",
    ),
    Change(
        "optimizer-formats",
        f"{_OPT}ChainedOptimizer.load_state_dict",
        f"{_P}checkpoint.optimizer_format:regrouped",
        "optimizer state saved at one EP resumes at another (one optimizer <-> a chain of two)",
    ),
    *_switch(_DO.rstrip("."), distributed=True, half=False),
    *_switch(f"{_OPT}FP32Optimizer", distributed=False, half=False),
    *_switch(f"{_OPT}Float16OptimizerWithFloat16Params", distributed=False, half=True),
    # Every DP rank's RNG state (checkpoint/rng_per_rank.py).
    Change(
        "per-rank-rng",
        f"{_CKPT}get_rng_state",
        f"{_P}checkpoint.rng_per_rank:every_rank_state",
        "megatron saves DP rank 0's RNG state alone: dropout at DP > 1 did not resume exactly",
    ),
    Change(
        "per-rank-rng",
        f"{_CKPT}_load_base_checkpoint",
        f"{_P}checkpoint.rng_per_rank:own_rank_first",
        "... and on load each DP rank takes its own entry",
    ),
    Change(
        "lora-from-base",
        f"{_CKPT}_load_base_checkpoint",
        f"{_P}checkpoint.adapters_from_base:base_without_adapters",
        "a model with LoRA adapters loads a checkpoint without any (the base it adapts) instead of stopping on "
        "the missing adapter keys; the adapters keep their start; a checkpoint of the adapters alone gets "
        "its base's tensors from that base; a weights-only start from a checkpoint without an MTP head "
        "starts the model's head afresh",
    ),
    Change(
        "lora-from-base",
        f"{_CKPT}generate_state_dict",
        f"{_P}checkpoint.adapters_only:without_frozen_base",
        "a LoRA run whose base is a checkpoint saves what trains, not the frozen base again at every save "
        "(~800 GB for 397b_a17b); loads read the base from where it is named",
    ),
    # Save-time work, one wrapper with its hooks in order (checkpoint/save_hooks.py).
    Change(
        "save-hooks",
        "megatron.training.training:save_checkpoint",
        f"{_P}checkpoint.save_hooks:with_save_hooks",
        "refuse non-finite weights; after the save, the token-budget plan's and the loader's state and the "
        "files' checksums; a full disk is one line and leaves the last complete checkpoint",
    ),
    Change(
        "save-hooks",
        "megatron.training.checkpointing:schedule_async_save",
        f"{_P}checkpoint.save_hooks:with_checksums_recorded",
        "an --async-save's files are complete only when megatron finalizes it: the checksums are recorded then",
    ),
    Change(
        "prebuilt-dataset-helpers",
        "megatron.core.datasets.utils:compile_helpers",
        f"{_P}training.backend:prebuilt_helpers",
        "start-up runs make in the installed wheel, which has no Makefile (sys.exit(1)); its helpers_cpp "
        "is built already",
        WHEEL,
    ),
    # The step's gradient checks read once (training/grad_check_reads.py).
    Change(
        "grad-checks-in-one-read",
        "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.check_grads",
        f"{_P}training.grad_check_reads:one_read_bucket_check",
        "DDP's NaN / Inf check read each bucket's grad norm twice (two syncs a bucket group and step, four "
        "at EP > 1); the group's norms are read once, and megatron's check runs where one is not finite",
    ),
    Change(
        "grad-checks-in-one-read",
        f"{_OPT}ChainedOptimizer.get_grad_norm",
        f"{_P}training.grad_check_reads:one_read_chained_norm",
        "at EP > 1 the dense and expert optimizers reduce over different groups, and megatron read each "
        "part's norm to the host to combine them; each part reduced on the device, the total read once",
    ),
    # Pipeline shapes between the hosts (training/host_collectives.py).
    Change(
        "pipeline-shapes-on-the-host",
        "megatron.core.pipeline_parallel.p2p_communication:P2PCommunicator._communicate_shapes",
        f"{_P}training.host_collectives:shapes_between_hosts",
        "packed rows change length every micro-batch, so stages exchange each activation's shape first; "
        "megatron sends it as a device tensor, reads it back and synchronizes the device (three syncs a "
        "micro-batch and direction): on a gloo pipeline group the same three integers go between the hosts "
        "(an NCCL run keeps megatron's exchange until gloo twins of its groups are made with them)",
    ),
    # Model TFLOP/s and MFU in megatron's log (training/throughput.py).
    Change(
        "step-flops-and-log",
        "megatron.training.training:num_floating_point_operations",
        f"{_P}training.throughput:counted_flops",
        "megatron prices a step with a GPT formula (no vision tower, no GDN); the model's own count instead",
    ),
    Change(
        "step-flops-and-log",
        "megatron.training.training:training_log",
        f"{_P}training.throughput:logged_step",
        "tokens/s, model TFLOP/s, MFU and the metrics file beside megatron's log line; at --log-interval 1 "
        "megatron's second line averaged the first two iterations (it keeps its sums after a first one)",
    ),
    Change(
        "step-flops-and-log",
        "megatron.core.transformer.multi_token_prediction:MTPLossLoggingHelper.track_mtp_metrics",
        f"{_P}training.throughput:captured_mtp_losses",
        "the MTP loss in the metrics file",
    ),
    Change(
        "generation-eval",
        "megatron.training.training:post_training_step_callbacks",
        f"{_P}training.gen_eval:evaluated_callbacks",
        "every --gen-eval-interval iterations, validation conversations answered by generation and scored",
    ),
    # Values set rather than functions wrapped: applied by their own call, where each says.
    Change(
        "compile-for-any-length",
        "torch._dynamo.config:assume_static_by_default",
        f"{_P}training.compile_once:compile_for_any_length",
        "megatron-core's torch.compile'd helpers (jit_fuser: GDN's gated norm, SwiGLU, bias-dropout-add) "
        "compiled for the first call's shapes, then again for dynamic ones at the next packed row's length "
        "(iterations 1 and 2 took 40 s and 21 s on an H200); False: compiled once, for any length. "
        "Process-wide (only megatron-core's helpers compile in a training run); set by "
        "pretrain_multimodal.py before megatron is imported",
        OWN_CALL,
    ),
    Change(
        "writer-queue-by-fork",
        "megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue",
        f"{_P}checkpoint.write_queue:install",
        "the torch_dist writer's results queue was made at a rank's first save by a spawned manager, a new "
        "interpreter importing torch, megatron-core and this example again (about 8 s of CPU a rank, all "
        "at once); megatron's own get_write_results_queue(mp_mode='fork') makes it at the run's start, "
        "before any thread (pretrain_multimodal.py where --save is given; checkpoint/files.py before a "
        "model-only save), and again where its manager is gone",
        OWN_CALL,
    ),
    Change(
        "mtp-under-cp",
        "megatron.core.transformer.multi_token_prediction:roll_tensor",
        f"{_P}models.common.mtp_context_parallel:group_consistent_count",
        "the MTP loss mask's token count under CP is the whole sequence's share, not the local chunk's "
        "(applied by models/qwen35_vl/model.py when the model has an MTP head)",
        ON_USE,
    ),
    Change(
        "energon-refuses-code",
        "megatron.energon.typed_converter:JsonParser._resolve_object",
        f"{_P}data.energon_configs:allowed_objects_only",
        "a dataset's YAML may name only energon's own sample and dataset classes (applied by data/energon.py)",
        ON_USE,
    ),
    Change(
        "energon-refuses-code",
        "megatron.energon.module_loader:ModuleLoader._load_module",
        f"{_P}data.energon_configs:no_python_files",
        "a dataset's YAML may not run a Python file",
        ON_USE,
    ),
    # The vision tower on ranks of its own (vision_ranks/).
    Change(
        "vision-ranks",
        "megatron.training.training:get_model",
        f"{_P}vision_ranks.groups:module_get_model",
        "get_model builds this rank's module on its own process groups (applied by vision_ranks/groups.py's setup "
        "under --vision-nproc)",
        ON_USE,
    ),
    Change(
        "vision-ranks",
        f"{_CKPT}generate_state_dict",
        f"{_P}vision_ranks.groups:with_language_common",
        "a checkpoint's common state is the language model's, on the tower's ranks too",
        ON_USE,
    ),
    # The device layer (megatron/cpu/): megatron.training on a host without CUDA.
    Change(
        "cpu-host",
        "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
        "megatron.cpu.device_compat:_rng_state",
        "the model-parallel RNG tracker forks the CPU generator",
        DEVICE_LAYER_CPU,
    ),
    Change(
        "cpu-host",
        "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
        "megatron.cpu.device_compat:_set_rng_state",
        "... and restores it",
        DEVICE_LAYER_CPU,
    ),
    Change(
        "cpu-host",
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel.__init__",
        "megatron.cpu.fsdp_compat:_on_host",
        "Megatron-FSDP puts its buffers on cuda:{current_device}",
        DEVICE_LAYER_CPU,
    ),
    Change(
        "cpu-host",
        "megatron.core.distributed.fsdp.mcore_fsdp_adapter:DeviceMesh",
        "megatron.cpu.fsdp_compat:_HostMesh",
        "... and builds its DTensor meshes on device_type cuda",
        DEVICE_LAYER_CPU,
    ),
    Change(
        "cpu-host",
        "megatron.training.arguments:get_device_arch_version",
        "megatron.cpu.training_compat:_device_arch_version",
        "validate_args asks the GPU's architecture when TP or CP > 1",
        DEVICE_LAYER_CPU,
    ),
    Change(
        "cpu-host",
        "megatron.training.training:initialize_megatron",
        "megatron.cpu.training_compat:_allow_no_cuda",
        "initialize_megatron asserts CUDA unless allow_no_cuda",
        DEVICE_LAYER_CPU,
    ),
    *_torch_gdn("common"),
    *_torch_gdn("gdn"),
)

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(c.group for c in CHANGES))

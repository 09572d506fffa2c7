"""Plan a cluster layout: every TP / CP / PP / VP / EP / ETP / FSDP / recompute a variant admits on a
number of GPUs, refused when a rank's memory is over (saying which part), the rest ranked by the
predicted time of a step (``layout_cost``).

Candidates (megatron-core's constraints, the run script's names):
  TP      powers of two up to a node, dividing the attention, GDN and vision heads
  CP      1, 2, 4, 8 (a rank keeps at least 2048 tokens of a row), dividing the GDN heads a TP rank has
  PP      divisors of GPUs / (TP x CP), at least one decoder layer a stage; for each, the even split
          and a balanced one: the first stage gives up layers for the vision tower's time, the
          last for the output layer's and the MTP head's (``PP_FIRST`` / ``PP_LAST``)
  VP      none, or 2 ... 8 chunks of every stage
  EP      divisors of the experts with EP x ETP x PP dividing the GPUs; ETP 1 or TP
  FSDP    when ``Request.fsdp`` asks (``--fsdp``; the run script's DRY_RUN with FSDP=1), each layout
          of one pipeline stage also under Megatron-FSDP, where it has something to shard (DP x CP or
          expert DP over 1) and at EP 1 for MoE (its grouped experts save at EP 1 only); not for a
          LoRA run or a chunked tower (``--vision-chunk-patches``), which it does not run with
  recompute  none or full (one layer a checkpoint)
The global batch must split into whole micro-batches: GBS rows = DP x MBS x micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from ..lora.targets import LoraSettings
from ..models import model_of
from ..models.qwen35_vl.configuration import Qwen35VLShape
from .launch_layout import Layout
from .layout_cost import GIB, Candidate, Hardware, StepTime, stage_memory, step_time
from .layout_mix import Mix
from .pipeline_layout import stage_layers

MIN_CP_TOKENS = 2048  # context parallelism is for long rows: below this a rank's GEMMs are too short to run at speed


@dataclass(frozen=True)
class Request:
    name: str
    shape: Qwen35VLShape
    gpus: int
    hardware: Hardware
    mix: Mix
    global_batch: int  # rows of ``mix.seq_len`` tokens a step
    micro_batch: int = 1  # rows a micro-batch
    efficiency: float = 0.5  # of peak FLOP/s, on the model's FLOPs
    reserve: float = 0.1  # of the GPU's memory kept back
    distributed_optimizer: bool = True
    recompute: tuple = (None, "full")
    lora: LoraSettings | None = None  # a LoRA run, the base frozen
    vision_chunk_patches: int = 0  # --vision-chunk-patches: the tower's activations one chunk at a time
    fsdp: bool = False  # also offer Megatron-FSDP layouts (opt-in: no GPU has measured them yet)

    @property
    def admits_fsdp(self) -> bool:
        """FSDP layouts are offered: asked for, and neither LoRA nor a chunked tower (training refuses both with it)."""
        return self.fsdp and not self.lora and not self.vision_chunk_patches

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_gib * GIB * (1 - self.reserve)


@dataclass
class Plan:
    candidate: Candidate
    micro_batches: int
    memory: list  # StageMemory per pipeline stage
    time: StepTime | None  # None when refused
    refused: str = ""

    @property
    def busiest(self):
        return max(self.memory, key=lambda m: m.total)

    @property
    def step(self) -> StepTime:
        """The step time of a plan that fits."""
        assert self.time is not None, f"a refused plan has no step time: {self.refused}"
        return self.time

    def tflops_per_gpu(self, request: Request) -> float:
        return self.step.parts["flops"] / self.step.total / request.gpus / 1e12


@dataclass
class Result:
    request: Request
    plans: list  # fitting, fastest first
    refused: dict = field(default_factory=dict)  # reason -> count
    examined: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=None)
def _valid(shape, tp: int, cp: int, ep: int) -> bool:
    try:
        model_of(shape).validate_parallel(shape, tp, cp, ep)
        return True
    except ValueError:
        return False


def balanced_split(shape, pp: int, vp: int | None, vision_layers: float, head_layers: float):
    """(first, last) that even out the stages' time, where the vision tower costs ``vision_layers``
    decoder layers and the output layer with the MTP head ``head_layers``; None when the even split
    is already as good or no valid uneven one exists."""
    n = shape.text.num_layers
    target = (n + vision_layers + head_layers) / pp
    want_first, want_last = round(target - vision_layers), round(target - head_layers)
    if pp == 1 or (want_first, want_last) == (n // pp, n // pp):
        return None
    if pp == 2:  # both stages given: they must add up, and megatron then refuses virtual stages
        first = min(max(want_first, 1), n - 1)
        return (first, n - first) if vp is None and first != n // 2 else None
    for df in (0, -1, 1, -2, 2):
        for dl in (0, -1, 1, -2, 2):
            first, last = want_first + df, want_last + dl
            if first < 1 or last < 1:
                continue
            try:
                stage_layers(n, pp, vp, first, last)
                return first, last
            except ValueError:
                continue
    return None


def candidates(request: Request):
    """Every layout ``request`` admits (Candidates), validity checked, fit not yet."""
    shape, gpus, t = request.shape, request.gpus, request.shape.text
    node = request.hardware.gpus_per_node
    row = request.mix.mean_row
    fb = model_of(shape).micro_batch_flops(shape, row.lengths, row.grids)
    per_layer = (fb.gdn + fb.attention + fb.mlp) / t.num_layers
    vision_layers, head_layers = fb.vision / per_layer, (fb.output + fb.mtp) / per_layer
    tps = [tp for tp in (1, 2, 4, 8, 16) if tp <= node and gpus % tp == 0]
    for tp in tps:
        for cp in (1, 2, 4, 8):
            if (
                gpus % (tp * cp)
                or (cp > 1 and request.mix.seq_len // cp < MIN_CP_TOKENS)
                or not _valid(shape, tp, cp, 1)
            ):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > t.num_layers:
                    break
                for vp in [None] + [v for v in range(2, 9) if pp > 1]:
                    splits: list[tuple[int | None, int | None]] = [(None, None)]
                    uneven = balanced_split(shape, pp, vp, vision_layers, head_layers)
                    if uneven:
                        splits.append(uneven)
                    for first, last in splits:
                        try:
                            stage_layers(t.num_layers, pp, vp, first, last)
                        except ValueError:
                            continue
                        for ep, etp in _expert_layouts(shape, gpus, tp, pp):
                            if not _valid(shape, tp, cp, ep):
                                continue
                            for lay in _with_fsdp(request, Layout(tp, pp, vp, cp, ep, etp, first, last, gpus)):
                                for rc in request.recompute:
                                    yield Candidate(lay, request.micro_batch, rc)


def _with_fsdp(request: Request, lay: Layout):
    """The layout, and the same under Megatron-FSDP where it runs (one stage; MoE at EP 1, where its
    grouped experts can save) and has something to shard: with DP x CP and expert DP both 1 it would
    hold more for nothing."""
    yield lay
    moe_ep = request.shape.text.is_moe and lay.ep > 1
    if request.admits_fsdp and lay.pp == 1 and not moe_ep and (lay.dense_shards > 1 or lay.expert_dp > 1):
        yield replace(lay, fsdp=True)


def _expert_layouts(shape, gpus: int, tp: int, pp: int):
    if not shape.text.is_moe:
        yield 1, tp
        return
    for etp in sorted({1, tp}):
        for ep in _divisors(shape.text.num_experts):
            if gpus % (ep * etp * pp) == 0:
                yield ep, etp


def evaluate(request: Request, cand: Candidate) -> Plan:
    lay = cand.layout
    per_step = lay.dp * cand.mbs
    if request.global_batch % per_step:
        return Plan(cand, 0, [], None, f"GBS {request.global_batch} is not a multiple of DP x MBS = {per_step}")
    m = request.global_batch // per_step
    rows = [request.mix.mean_row] * cand.mbs
    memory = stage_memory(
        request.shape, cand, rows, m, request.distributed_optimizer, request.lora, request.vision_chunk_patches
    )
    worst = max(memory, key=lambda s: s.total)
    if worst.total > request.usable_bytes:
        state = worst.weights + worst.grads + worst.optimizer
        part = "weights + gradients + optimizer" if state > request.usable_bytes else "activations"
        return Plan(cand, m, memory, None, f"over memory ({part})")
    imbalance = request.mix.imbalance(lay.dp, m * cand.mbs)
    time = step_time(
        request.shape,
        cand,
        rows,
        m,
        imbalance,
        request.hardware,
        request.efficiency,
        request.lora,
        request.vision_chunk_patches,
    )
    return Plan(cand, m, memory, time)


def plan(request: Request, keep: int = 5) -> Result:
    """The ``keep`` fastest layouts that fit, and how many were refused for what."""
    result = Result(request, [])
    fitting = []
    for cand in candidates(request):
        result.examined += 1
        p = evaluate(request, cand)
        if p.refused:
            reason = p.refused.split(" is not a multiple")[0] if p.refused.startswith("GBS") else p.refused
            result.refused[reason] = result.refused.get(reason, 0) + 1
        else:
            fitting.append(p)
    fitting.sort(key=lambda p: p.step.total)
    result.plans = fitting[:keep]
    return result

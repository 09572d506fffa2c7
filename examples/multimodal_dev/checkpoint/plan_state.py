"""Token-budget plans in checkpoints: a resumed run continues the plan where its checkpoint left
it, instead of replaying every step before it (``TokenBudgetPlan.state`` / ``restore``).

Replaying costs one ``describe()`` per conversation consumed so far, on every rank: about 6.5 ms
for a CORD-V2 conversation, so minutes to hours once a run is a few hundred thousand
conversations in. The state a step starts from is the stream position and the few conversations
carried over, so a checkpoint stores that:

    iter_XXXXXXX/token_budget_plan.json   written by global rank 0 once megatron's save returns

JSON, not pickle (a checkpoint directory is data), with the SHA-256 of its content: a file edited
by hand or damaged on disk (a moved cursor, a carried conversation changed or dropped) is replayed,
saying so, instead of training other rows. A checkpoint without the file (saved by a run
with sample-count packing, or cut off between megatron's save and this write), or one whose
settings or data differ from the resumed run's, is resumed by replaying: slower, same rows.
"""

from __future__ import annotations

import os

from .files import iteration_dir, read_checked_json, write_checked_json

PLAN_FILE = "token_budget_plan.json"

_plans: dict = {}  # "train": the plan behind this process's training iterator


def tracked() -> bool:
    return "train" in _plans


def track(plan) -> None:
    """The training iterator's plan; with virtual pipeline stages each stage has its own, all equal."""
    _plans.setdefault("train", plan)


def write_state(checkpoint_dir: str, plan, consumed_rows: int) -> bool:
    """Store what planning the next step starts from; False when the plan no longer holds it, or
    the checkpoint directory is not (yet) a local directory (an asynchronous save still writing,
    object storage): that checkpoint then resumes by replaying."""
    state = plan.state(consumed_rows // plan.rows_per_step)
    if state is None or not os.path.isdir(checkpoint_dir):
        return False
    write_checked_json(os.path.join(checkpoint_dir, PLAN_FILE), state)
    return True


def read_state(checkpoint_dir: str) -> dict | None:
    """The stored state, or None without the file; ValueError when its content is not what was written."""
    return read_checked_json(os.path.join(checkpoint_dir, PLAN_FILE))


def resume(plan, load_dir: str | None, iteration: int, consumed_rows: int) -> str | None:
    """Restore ``plan`` from the checkpoint a run resumed from; one line saying how it continues
    (None for a run that starts at step 0)."""
    step = consumed_rows // plan.rows_per_step
    if not step:
        return None
    checkpoint_dir = iteration_dir(load_dir or "", iteration)
    try:
        state = read_state(checkpoint_dir) if load_dir else None
        if state is None:
            why = f"{checkpoint_dir} has no {PLAN_FILE}"
        elif state.get("step") != step:
            why = f"{PLAN_FILE} is for step {state.get('step')}, the run resumes at step {step}"
        else:
            why = plan.restore(state)
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # a damaged file: replaying is still exact
        why = f"{PLAN_FILE} is not a plan state: {type(err).__name__}: {err}"
    if why is None:
        return f"token-budget plan: continues at step {step} from {os.path.join(checkpoint_dir, PLAN_FILE)}"
    return f"token-budget plan: replaying {step} steps from the start ({why})"


def write_after_save(iteration: int, args) -> None:
    """After a save (``save_hooks.py``): the training plan's state, written by global rank 0."""
    import torch

    plan = _plans.get("train")
    if plan is not None and args.save and torch.distributed.get_rank() == 0:
        write_state(iteration_dir(args.save, iteration), plan, args.consumed_train_samples)

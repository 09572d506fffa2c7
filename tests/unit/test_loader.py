"""The loader draws nothing from torch's global generator: megatron restores it from the checkpoint
before the iterators are built, so a draw there would make a resumed run's dropout differ."""

import os

import torch

from examples.multimodal_dev.data.loader import build_iterator


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.tensor([i])}


def _collate(samples):
    return {"x": torch.cat([s["x"] for s in samples]), "stats": {}}


def test_building_and_drawing_leave_the_global_generator_alone():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    train = build_iterator(_Rows(), 2, micro_batch_size=2, dp_rank=0, dp_size=1, collate_fn=_collate)
    valid = build_iterator(_Rows(), 0, micro_batch_size=2, dp_rank=0, dp_size=1, collate_fn=_collate, cyclic=True)
    assert next(train)["x"].tolist() == [2, 3]
    assert [next(valid)["x"].tolist() for _ in range(5)][-1] == [0, 1]  # wrapped round to a new pass
    assert torch.equal(torch.get_rng_state(), before)


_RANK = """
import os
import time
from examples.multimodal_dev.data.loader import build_iterator
from tests.unit.test_loader import _Rows, _collate

class Slow(_Rows):
    def __getitem__(self, i):
        open(os.path.join(os.environ["BUSY_MARKS"], str(os.getpid())), "w").close()
        time.sleep(60)  # busy in the middle of a batch when the rank is killed
        return super().__getitem__(i)

it = build_iterator(Slow(), 0, micro_batch_size=2, dp_rank=0, dp_size=1, collate_fn=_collate, num_workers=2)
next(it)
"""


def test_workers_die_with_a_rank_killed_with_sigkill():
    from processes import assert_workers_die_with_rank

    assert_workers_die_with_rank(_RANK, busy=2)


def test_a_worker_whose_rank_died_while_it_started_ends_itself():
    """The rank is killed before its worker asks to die with it: the worker ends itself at once."""
    import multiprocessing
    import signal
    import time

    from examples.multimodal_dev.data.loader import exit_with_parent

    def orphan():
        time.sleep(2)  # the rank is gone by now
        exit_with_parent()
        time.sleep(60)

    def rank(child_pid):
        worker = multiprocessing.get_context("fork").Process(target=orphan)
        worker.start()
        child_pid.value = worker.pid
        os.kill(os.getpid(), signal.SIGKILL)

    import psutil

    ctx = multiprocessing.get_context("fork")
    pid = ctx.Value("i", 0)
    parent = ctx.Process(target=rank, args=(pid,))
    parent.start()
    parent.join(30)
    assert parent.exitcode == -signal.SIGKILL and pid.value
    try:
        worker = psutil.Process(pid.value)
        gone, alive = psutil.wait_procs([worker], timeout=15)
        assert not alive, "the orphaned worker outlived its rank"
    except psutil.NoSuchProcess:
        pass

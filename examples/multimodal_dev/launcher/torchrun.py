"""``torchrun`` for ``run_qwen35_vl.sh``: its arguments, without the launcher's own traceback when a
rank fails, and on a host without CUDA with the ranks forked from one process that imported the
engine once.

A rank that stops on a user's mistake prints one line naming it (``pretrain_multimodal.py: ...``)
and exits non-zero; torchrun then raises ``ChildFailedError`` and Python prints a traceback of the
launcher itself, which buries that line. Here the failure becomes one more line (which rank, its
exit code or signal) and the exit status 1.

Stopping: SIGTERM or SIGINT to torchrun (``kill``, a supervisor, Ctrl-C) is passed to every rank's
process group (torchrun starts each rank in a session of its own); torchrun waits for them (SIGKILL
after its shutdown timeout, 30 s), then says so in one line and exits 128 + the signal. A torchrun
that is killed outright takes its ranks with it: each asks the kernel for that (``../lifetime.py``).

Rank start (``FORK_RANKS``): torchrun starts every rank as a fresh interpreter, which spends about
6 s of CPU importing torch, megatron-core (dynamo and inductor through its ``torch.compile``
decorators) and transformers (megatron builds every tokenizer through it) before it reads an
argument. Where a CPU host's ranks outnumber its cores, this is most of a short run. With
``FORK_RANKS=1`` (the default without CUDA where the ranks outnumber the cores) torchrun runs
``rank_main`` instead, through its own function entry point and forkserver start method: the
forkserver imports ``PRELOAD`` once and every rank forks from it, then runs the training module as
``python -m`` would. The engine each rank runs is the same either way. With CUDA every rank stays a
fresh interpreter: a process forked after CUDA was initialised cannot use it, and importing
megatron-core probes the device.

A multiprocessing forkserver already running when ``main`` is called is the one the ranks fork from
(``set_forkserver_preload`` names what a new one would import).
"""

from __future__ import annotations

import os
import sys

# What every rank imports before its first line of work: megatron.training (torch, megatron-core) and
# the tokenizer libraries megatron's build_tokenizer imports (transformers)
PRELOAD = ("megatron.training", "megatron.core.tokenizers.text")
FORK_SWITCH = "FORK_RANKS"


def forks_ranks(cuda: bool, nproc: int, cores: int) -> bool:
    """Whether the ranks fork from a preloaded process: ``FORK_RANKS``, by default where there is no CUDA
    and the ranks outnumber the cores. Fresh interpreters import side by side, a core each; where they
    queue for the cores, one import in the forkserver is the shorter wait (measured here, 2 cores: 3 or
    4 ranks 35% faster, 2 ranks no faster, 1 rank 1.7 s slower, the forkserver's import coming first)."""
    value = os.environ.get(FORK_SWITCH, "0" if cuda or nproc <= cores else "1")
    if value not in ("0", "1"):
        raise SystemExit(f"torchrun: {FORK_SWITCH}={value}: expected 0 (fresh interpreters) or 1 (fork)")
    if value == "1" and cuda:
        raise SystemExit(
            f"torchrun: {FORK_SWITCH}=1 needs a host without CUDA (a forked process cannot use "
            f"CUDA once its parent has initialised it)"
        )
    return value == "1"


def rank_main(module: str, *argv: str) -> None:
    """One rank: ``python -m module argv`` in this forked process."""
    import atexit
    import multiprocessing
    import runpy

    multiprocessing.set_start_method(None, force=True)  # the rank's own workers start as a fresh interpreter's do
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise  # its exit status, as the interpreter would end
    except BaseException as err:  # as the interpreter reports an uncaught exception: on stderr, status 1
        sys.excepthook(type(err), err, err.__traceback__)
        raise SystemExit(1) from None
    finally:
        atexit._run_exitfuncs()  # a forked process ends without the interpreter's exit handlers


def _launch_forked(args) -> None:
    import logging
    import multiprocessing
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # as torch.distributed.run.run: a c10d rendezvous on a free port of this host
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    os.environ["PYTHONUNBUFFERED"] = "1"  # the forkserver's streams, hence the ranks': torchrun runs python -u
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    # its report of a failed rank is a traceback of the launcher; main() says which rank in one line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    elastic_launch(config, rank_main)(args.training_script, *args.training_script_args)


def out_of_memory_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended in this process's memory
    cgroup (v2's ``memory.events``, v1's ``memory.oom_control``), or None where neither says."""
    files = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if controllers == "":
                    files += [f"/sys/fs/cgroup{path.rstrip('/')}/memory.events", "/sys/fs/cgroup/memory.events"]
                elif "memory" in controllers.split(","):
                    root = "/sys/fs/cgroup/memory"
                    files += [f"{root}{path.rstrip('/')}/memory.oom_control", f"{root}/memory.oom_control"]
    except (OSError, ValueError):
        return None
    for name in files:  # inside a container the cgroup's own folder is often shown as the root
        try:
            with open(name) as f:
                return next(int(line.split()[1]) for line in f if line.startswith("oom_kill "))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return None


def failure_line(
    rank: int, exitcode: int, signal_name: str | None, oom_before: int | None, oom_after: int | None
) -> str:
    """The one line for a failed rank. A rank ended by SIGKILL said nothing itself: most often the
    kernel's out-of-memory killer, which the cgroup's count shows where it can."""
    head = f"torchrun: rank {rank} stopped ({f'signal {signal_name}' if signal_name else f'exit code {exitcode}'})"
    if signal_name != "SIGKILL":
        return f"{head}; its output above says why"
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return (
            f"{head}: the kernel's out-of-memory killer ended {oom_after - oom_before} process(es) of this "
            "memory cgroup while the run went on; a rank held more memory than the host gives it"
        )
    return (
        f"{head}, which a rank cannot report itself: if no one sent it, the kernel's out-of-memory killer is "
        "the likely cause (dmesg or journalctl -k: 'Killed process')"
    )


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..lifetime import LAUNCHER_PID
    from .roll_call import NodesMissing, register

    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks end with this process (lifetime.py)
    oom_kills = out_of_memory_kills()
    register()  # the rendezvous backend of several nodes (megatron_argv.torchrun_argv)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # "auto", "cpu", "gpu": a rank a device or core, never more ranks than cores
        nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 0
        cores = len(os.sched_getaffinity(0))
        if args.module and forks_ranks(torch.cuda.is_available(), nproc, cores):
            _launch_forked(args)
        else:
            run(args)
    except NodesMissing as err:
        print(f"torchrun: {err}", file=sys.stderr)
        return 1
    except SignalException as err:  # torchrun has passed it to every rank and waited for them to end
        print(f"torchrun: stopped by {err.sigval.name}; every rank has ended", file=sys.stderr)
        return 128 + err.sigval
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        print(failure_line(rank, failure.exitcode, signal_name, oom_kills, out_of_memory_kills()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

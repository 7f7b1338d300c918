"""Training jobs for the tests that stop themselves: after a given optimizer step (on every
rank, or on one), or at the start, on ranks that do not share a filesystem.

`torch.multiprocessing.spawn` starts fresh interpreters that import the function to run
by name, so these live in a module of their own rather than in a test file."""

import functools
import time
from pathlib import Path

import torch

import annotated_transformer as at
from plumbing import free_port
from tools import train_ddp


def stop_after_step(step: int, stop) -> None:
    """Make at.make_optimizer's optimizers call `stop()` right after optimizer step `step`.

    The twin's `train` then trains with it. functools.wraps gives it the twin's source, so
    the run's folder (which the lesson's code names) stays the one an uninterrupted run
    trains into."""
    make_optimizer = at.make_optimizer

    @functools.wraps(make_optimizer)
    def make_and_watch(*args, **kwargs):
        optimizer, schedule = make_optimizer(*args, **kwargs)
        steps = [0]

        def after(*_):
            steps[0] += 1
            if steps[0] == step:
                stop()

        optimizer.register_step_post_hook(after)
        return optimizer, schedule

    at.make_optimizer = make_and_watch


def worker(
    rank: int,
    world_size: int,
    fields: dict,
    data_dir: str,
    port: int,
    fail_at: int = 0,
    separate: bool = False,
    fail_rank: int | None = None,
):
    """train_ddp.ddp_worker, with every rank (or only `fail_rank`) raising right after
    optimizer step `fail_at`; `separate`: each rank on a data folder of its own, as on
    machines that share no filesystem (they still meet over TCP)."""
    torch.set_num_threads(1)
    if fail_at and fail_rank in (None, rank):

        def fail():
            raise RuntimeError(f"rank {rank} stopped on purpose at step {fail_at}")

        stop_after_step(fail_at, fail)
    if separate:
        data_dir = str(machine_folder(data_dir, rank))
    train_ddp.ddp_worker(rank, world_size, fields, data_dir, port)


def fails_and_teardown_aborts(rank: int, world_size: int, fields: dict, data_dir: str, port):
    """worker, every rank raising after step 3, in a process where leaving the process group
    aborts (SIGABRT), as gloo's teardown once did when a peer had gone."""
    import os

    torch.distributed.destroy_process_group = lambda *_, **__: os.abort()
    worker(rank, world_size, fields, data_dir, port, fail_at=3)


def rank_1_fails_at_step_3(rank: int, world_size: int, fields: dict, data_dir: str, port) -> None:
    """A stand-in for train_ddp.ddp_worker, with its arguments, for train_ddp.train_distributed
    to start: rank 1 raises after optimizer step 3, rank 0 trains on as if nothing happened."""
    worker(rank, world_size, fields, data_dir, port, fail_at=3, fail_rank=1)


def spawn(fields: dict, data_dir, fail_at: int = 0, world_size: int = 2) -> None:
    """Run the job on `world_size` CPU processes (gloo) and wait for it."""
    args = (world_size, fields, str(data_dir), free_port(), fail_at)
    torch.multiprocessing.spawn(worker, args=args, nprocs=world_size, join=True)


def machine_folder(data_dir, rank: int) -> Path:
    """The data folder of rank `rank` when every rank is on a machine of its own."""
    return Path(data_dir) / f"machine-{rank}"


def spawn_on_separate_machines(fields: dict, data_dir, timeout: float, fail_at: int = 0):
    """Run the job on two CPU processes, each on its own machine_folder, and wait at most
    `timeout` seconds. Returns the job's error (None if it ended well); raises
    TimeoutError, after killing the processes it started, if the job hangs."""
    args = (2, fields, str(data_dir), free_port(), fail_at, True)
    job = torch.multiprocessing.spawn(worker, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not job.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job still runs after {timeout:.0f} s: it hangs")
    except torch.multiprocessing.ProcessRaisedException as error:
        return error
    finally:
        for process in job.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return None

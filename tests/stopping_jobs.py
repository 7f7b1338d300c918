"""Training jobs for the tests that stop themselves after a given optimizer step.

`torch.multiprocessing.spawn` starts fresh interpreters that import the function to run
by name, so it lives in a module of its own rather than in a test file."""

import torch

import annotated_transformer as at


def stop_after_step(step: int, stop) -> None:
    """Make at.make_optimizer's optimizers call `stop()` right after optimizer step `step`."""
    make_optimizer = at.make_optimizer

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


def worker(rank: int, world_size: int, fields: dict, data_dir: str, port: int, fail_at: int):
    """at.ddp_worker, with every rank raising right after optimizer step `fail_at`."""
    torch.set_num_threads(1)
    if fail_at:

        def fail():
            raise RuntimeError(f"stopped on purpose at step {fail_at}")

        stop_after_step(fail_at, fail)
    at.ddp_worker(rank, world_size, fields, data_dir, port)


def spawn(fields: dict, data_dir, fail_at: int = 0, world_size: int = 2) -> None:
    """Run the job on `world_size` CPU processes (gloo) and wait for it."""
    args = (world_size, fields, str(data_dir), at.free_port(), fail_at)
    torch.multiprocessing.spawn(worker, args=args, nprocs=world_size, join=True)

"""Training on several processes with DDP: the notebook's `train`, one process per rank.

A new process cannot see the notebook, so every rank imports its `.py` twin and runs the
twin's `train` with Appendix C's `DDPProcesses`. This module sits above the lesson and the
trainer (trainer.py never imports the lesson). Appendix C of the notebook calls
`train_distributed`; torchrun calls this file:

    AT_PRESET=gpu torchrun --standalone --nproc-per-node=8 tools/train_ddp.py

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; the preset comes
from AT_PRESET and the data folder from AT_DATA_DIR (default data/).
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import annotated_transformer as twin  # noqa: E402
import plumbing  # noqa: E402
from plumbing import (  # noqa: E402
    CheckpointError,
    code_reached,
    free_port,
    gather_from_ranks,
    prepare_cpu_memory,
    read_checkpoint,
    say,
    use_language,
)

# What a DDP run trains with: the loop, and Appendix C's processes that it is given.
ROOTS = ("train", "DDPProcesses")


def device_for(local_rank: int, local_world_size: int) -> torch.device:
    """A GPU of its own for each of this machine's processes where it has enough of them,
    else the CPU: the notebook's two processes on a machine with one GPU both train on
    the CPU."""
    if torch.cuda.is_available() and local_world_size <= torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def same_checkpoint_on_every_rank(folder: Path) -> None:
    """Stop in one line unless every rank sees the same last.pt in `folder`: a rank on a
    machine of its own would see none, start afresh, and the job would hang."""
    path = folder / "last.pt"
    done = gather_from_ranks(len(read_checkpoint(path)["history"]) if path.is_file() else None)
    if len(set(done)) > 1:
        raise CheckpointError(
            say(
                "the ranks see different checkpoints in {folder} (finished epochs by rank, None "
                "for none: {epochs}): put data/ on a filesystem that every machine shares",
                folder=folder,
                epochs=done,
            )
        )


def ddp_worker(rank: int, world_size: int, settings_fields: dict, data_dir: str, port) -> None:
    """One rank of a DDP job: join the group, train with the twin's loop, leave.

    `port` None reads torchrun's environment.
    """
    import torch.distributed as dist

    use_language(os.environ.get("AT_LANGUAGE", "en"))  # the notebook's, which started us
    if rank != 0:  # rank 0 alone prints what train says: one line per epoch, not one per rank
        sys.stdout = open(os.devnull, "w")  # open until the process ends
    settings = twin.Settings(**settings_fields)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # on this machine
    device = device_for(int(os.environ.get("LOCAL_RANK", rank)), local_world_size)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    else:  # share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
        prepare_cpu_memory()  # as the notebook's own process does
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world_size
    )
    if rank == 0:
        data = twin.prepare_data(settings, Path(data_dir))  # rank 0 downloads what is missing
    dist.barrier()
    if rank != 0:
        data = twin.prepare_data(settings, Path(data_dir))
    folder = plumbing.run_folder(settings, data, vars(twin), Path(data_dir), roots=ROOTS)
    same_checkpoint_on_every_rank(folder)
    processes = twin.DDPProcesses(rank=rank, world_size=world_size)
    twin.train(settings, data, folder, device=device, processes=processes)
    dist.barrier()  # every rank is done with the group before any leaves it
    # Only a job that ended well leaves the group here (no `finally`). After an error, a
    # peer may be gone, and tearing gloo down then can abort the process (SIGABRT) before
    # spawn has written the error file (under torchrun, before Python prints the
    # traceback): the job would report a signal instead of the error. The process's exit
    # closes the group's sockets after the error is out.
    dist.destroy_process_group()
    # Then leave without finalizing the interpreter: there, gloo's threads have aborted a
    # rank that had trained and left the group ("terminate called without an active
    # exception", SIGABRT), now and then in the tests. The run is written and every rank is
    # past the barrier, so nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_distributed(settings, data_dir: Path, world_size: int | None = None) -> Path:
    """Train with DDP in `world_size` processes: by default one per GPU, or 2 without one.
    Each takes a GPU of its own if there are enough, else the CPU (device_for).

    Returns the run's folder, named by the twin's code, which is what the workers train.
    """
    world_size = world_size or torch.cuda.device_count() or 2
    args = (world_size, dataclasses.asdict(settings), str(data_dir), free_port())
    torch.multiprocessing.spawn(ddp_worker, args=args, nprocs=world_size, join=True)
    data = twin.prepare_data(settings, Path(data_dir))
    return plumbing.run_folder(settings, data, vars(twin), Path(data_dir), roots=ROOTS)


def not_in_twin(namespace: dict) -> list[str]:
    """The definitions on DDP's training path whose code in `namespace` (the notebook's)
    differs from the twin's: the workers will not train with those edits."""
    ours, theirs = code_reached(namespace, ROOTS), code_reached(vars(twin), ROOTS)
    return sorted(name for name in ours if ours[name] != theirs.get(name))


def main() -> None:
    if "RANK" not in os.environ:
        sys.exit("run this under torchrun, e.g. torchrun --nproc-per-node=2 tools/train_ddp.py")
    settings = twin.get_settings(os.environ.get("AT_PRESET"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    data_dir = os.environ.get("AT_DATA_DIR", str(twin.DATA_DIR))
    ddp_worker(rank, world_size, dataclasses.asdict(settings), data_dir, None)


if __name__ == "__main__":
    main()

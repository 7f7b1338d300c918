"""What the notebook's `train` need not show: the checkpoint file, rank bookkeeping, the record.

`train`, in Part 6 of the notebook, holds the run's state as its own variables: the model,
the optimizer, the schedule (which counts the steps) and the history. At each epoch's end it hands
them to `save_last`, and a rerun gets them back from `load_last`, the function beside it;
the two are the checkpoint's format, and a finished run is simply one whose last.pt holds
every epoch. Then comes the run's record (`run_record`).

A run's folder (`run_folder`, named by what training reaches) comes from plumbing.py, like
the files. This module imports plumbing and nothing else of the project:
never the notebook or its `.py` twin (a test holds the import direction). DDP's worker
processes, which need the twin's `train`, start from tools/train_ddp.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from plumbing import (
    CheckpointError,
    differences,
    peak_memory_gb,
    read_checkpoint,
    save_checkpoint,
    say,
)

# ---------------------------------------------------------------------------------------
# The checkpoint of the last finished epoch: written, and read back


def manifest_of(folder: Path) -> dict:
    """What the run in `folder` is made of: its manifest.json ({} if it has none)."""
    path = Path(folder) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save_last(folder: Path, kept: dict, history: list[dict], rank=0, world_size=1) -> None:
    """Write last.pt: the state of each of the loop's `kept` objects (model, optimizer,
    schedule, and the running mean of the epochs averaged so far), its history, how many
    processes trained, and what the run is made of. Every rank calls it after each epoch;
    rank 0 writes."""
    if rank == 0:
        states = {name: kept_object.state_dict() for name, kept_object in kept.items()}
        save_checkpoint(Path(folder) / "last.pt", **states, history=history,
                        processes=world_size, made_of=manifest_of(folder))  # fmt: skip


def load_last(folder: Path, kept: dict, epochs: int, *, world_size=1) -> list[dict]:
    """Put last.pt back into the loop's `kept` objects, as save_last wrote them; return the
    history so far ([] if no epoch has finished, all `epochs` records if the run has)."""
    path = Path(folder) / "last.pt"
    if not path.is_file():  # a run that starts from nothing
        print(say("training into {folder}", folder=folder))
        return []
    checkpoint = read_checkpoint(path)
    check_made_of(checkpoint, kept, folder, path)
    finished = len(checkpoint["history"]) >= epochs  # loads on any number of processes
    if checkpoint["processes"] != world_size and not finished:
        raise CheckpointError(
            say(
                "{path} was written by a run on {n} process(es), not {world_size}: resume with "
                "as many, or retrain",
                path=path,
                n=checkpoint["processes"],
                world_size=world_size,
            )
        )
    for name in kept:  # the model, the optimizer, the schedule, the average
        kept[name].load_state_dict(checkpoint[name])
    epoch, step = len(checkpoint["history"]) - 1, kept["schedule"].last_epoch
    print(resumed_line(folder, path, finished, epoch, step))
    return checkpoint["history"]


def resumed_line(folder: Path, path: Path, finished: bool, epoch: int, step: int) -> str:
    """What a run that loads its checkpoint prints: a finished one, where and with what it
    was trained; an unfinished one, where it goes on, and whether under another torch build,
    whose kernels may round otherwise (it trains on: the result is as good, if not the same
    to the last bit as a run never stopped)."""
    manifest = manifest_of(folder)
    built, python = manifest.get("torch build"), manifest.get("python")
    if finished and built:
        return say("loaded {path}, trained with torch {torch} and Python {python}",
                   path=path, torch=built, python=python)  # fmt: skip
    if finished:
        return say("loaded {path}", path=path)
    line = say("going on after epoch {epoch}, step {step}", epoch=epoch, step=step)
    if built and built != torch.__version__:
        line += say(
            "; the epochs so far ran under torch {built}, the rest run under {here}, which "
            "may round otherwise: not the same to the last bit as a run never stopped",
            built=built,
            here=torch.__version__,
        )
    return line


def check_made_of(checkpoint: dict, kept: dict, folder: Path, path: Path) -> None:
    """Stop in one line if a checkpoint is not save_last's (a key is missing), or was trained
    on other data, settings or code than its folder names (a file copied by hand)."""
    if not {*kept, "history", "processes", "made_of"} <= set(checkpoint):
        raise CheckpointError(
            say(
                "{path} does not say what it was trained on (an older or hand-made file): move "
                "it away, or pass retrain=True to run_folder",
                path=path,
            )
        )
    changed = differences(checkpoint["made_of"], manifest_of(folder))
    if changed:
        raise CheckpointError(
            say(
                "{path} was trained with {changed}, not what its folder names: it belongs to "
                "another run; move it away, or pass retrain=True to run_folder",
                path=path,
                changed=changed,
            )
        )


# ---------------------------------------------------------------------------------------
# What is printed after each epoch, and the record of a run


def epoch_line(record: dict) -> str:
    """The one line printed after each epoch."""
    return say(
        "epoch {epoch}: train loss {train_loss:.3f}, val loss {val_loss:.3f}, "
        "val BLEU {val_bleu:.1f}, {seconds:.0f} s, {speed:,.0f} target tokens/s",
        speed=record["tokens"] / record["seconds"],
        **record,
    )


def run_record(model, history, settings, folder, test_results: dict, device) -> dict:
    """The fields of build/results.json: the run's own settings beside its own history (every
    epoch's figures), its test BLEU, and what it ran on."""
    return {
        **test_results,
        "train_seconds": sum(h["seconds"] for h in history),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "device": str(device),
        "run_folder": str(folder),
        "peak_memory_gb": peak_memory_gb(),  # of this process (the kernel), so far
        "settings": dataclasses.asdict(settings),
        "history": history,
    }

"""Checkpoints and exact resume: after an epoch, after SIGKILL, around a re-plan, with
averaging; and decoding with beam search and the key-value cache."""

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_same_weights,
    multi30k_folder,
    quick_settings,
    tiny_data,
    tiny_settings,
    train_as_the_notebook,
)  # fmt: skip

import annotated_transformer as at
import trainer
from plumbing import CheckpointError, read_checkpoint, save_checkpoint

TINY = tiny_settings(dropout=0.1, beam_size=3)
# the quick preset for two epochs: linear decay to zero and clipping, as the cpu preset
TWO_EPOCHS = dataclasses.replace(quick_settings(), epochs=2)


def losses(history) -> list:
    return [(h["train_loss"], h["val_loss"], h["val_bleu"]) for h in history]


class Stopped(Exception):
    """The run stopped here, as if killed."""


@contextlib.contextmanager
def stopped_at_save(when, *, written: bool):
    """Run.save raises Stopped on its first call where when(run) holds: right after
    writing last.pt (written=True), or instead of writing it (killed just before).
    functools.wraps keeps Run's code, and so the run's folder, as it was."""
    save = trainer.Run.save

    @functools.wraps(save)
    def save_or_stop(run):
        if when(run):
            if written:
                save(run)
            raise Stopped
        save(run)

    trainer.Run.save = save_or_stop
    try:
        with pytest.raises(Stopped):
            yield
    finally:
        trainer.Run.save = save


def at_an_epochs_end(epoch: int):
    """when() for stopped_at_save: the save that ends epoch `epoch`."""
    return lambda run: run.epoch == epoch + 1 and run.now.done == 0


@pytest.mark.slow
def test_a_run_stopped_after_its_first_epoch_resumes_to_the_same_weights(
    quick_data, tmp_path, capsys
):
    straight, straight_history, _ = train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "a")
    with stopped_at_save(at_an_epochs_end(0), written=True):
        train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "b")
    folder = trainer.run_folder(TWO_EPOCHS, quick_data, vars(at), tmp_path / "b")
    last = read_checkpoint(folder / "last.pt")
    assert len(last["history"]) == 1 and last["ranks"][0]["position"]["done"] == 0
    assert not (folder / "final.pt").exists()
    capsys.readouterr()
    resumed, history, _ = train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "b")
    assert f"resuming from {folder / 'last.pt'}" in capsys.readouterr().out
    assert [h["epoch"] for h in history] == [0, 1]
    assert_same_weights(straight, resumed)
    assert losses(history) == losses(straight_history)  # the same seed: the same curve
    # "Watch it learn": every epoch keeps its translations of the watched sentences,
    # the first epoch's through the resume too
    watched = [h["watched"] for h in history]
    assert [len(w) for w in watched] == [len(at.WATCHED_SENTENCES)] * 2
    assert all(isinstance(t, str) for w in watched for t in w)
    assert watched == [h["watched"] for h in straight_history]


def test_a_finished_run_round_trips_and_a_damaged_checkpoint_is_refused(tmp_path):
    vocabs = tiny_data().vocabs
    model = at.model_for(TINY, vocabs)
    history = [{"epoch": 0, "train_loss": 3.5, "val_loss": 3.25}]
    save_checkpoint(tmp_path / "final.pt", model=model.state_dict(), history=history)
    fresh = at.model_for(TINY, vocabs)
    with pytest.raises(AssertionError):
        assert_same_weights(model, fresh)  # so that loading has something to do
    loaded, loaded_history = trainer.load_final(tmp_path, fresh)
    assert_same_weights(model, loaded)
    assert loaded_history == history

    (tmp_path / "last.pt").write_bytes((tmp_path / "final.pt").read_bytes())
    for name in ("final.pt", "last.pt"):
        good = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="final.pt is damaged or truncated"):
        trainer.load_final(tmp_path, fresh)
    with pytest.raises(CheckpointError, match="last.pt is damaged or truncated"):
        trainer.read_last(tmp_path, world_size=1)  # what a run started again reads


class Trap:
    """Pickles into a call that writes a file: what a malicious checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    for name in ("final.pt", "last.pt"):
        torch.save({"model": {}, "trap": Trap(marker)}, tmp_path / name)
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        trainer.load_final(tmp_path, torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        trainer.read_last(tmp_path, world_size=1)
    assert not marker.exists(), "loading a checkpoint ran code"
    torch.load(tmp_path / "last.pt", weights_only=False)  # the trap is real: unpickling runs it
    assert marker.read_text() == "code ran"


# --- killed for real: SIGKILL, no cleanup, no finally blocks ------------------------------

CHILD = """
import json, os, signal, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
import annotated_transformer as at
import trainer
from stopping_jobs import stop_after_step

data_dir, out, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
settings = at.Settings(**json.loads(sys.argv[4]))
if kill_at:
    stop_after_step(kill_at, lambda: os.kill(os.getpid(), signal.SIGKILL))
data = at.prepare_data(settings, data_dir)
# the notebook's training cell
folder = trainer.run_folder(settings, data, vars(at), data_dir)
finished = trainer.load_final(folder, at.model_for(settings, data.vocabs))
model, history = finished or at.train(settings, data, folder, device=torch.device("cpu"))
torch.save({"model": model.state_dict(), "history": history}, out)
"""
KILLED = dataclasses.replace(TWO_EPOCHS, batch_tokens=300, checkpoint_steps=3)
BUDGET = dataclasses.replace(KILLED, epochs=3, average_last=2)  # and averaging


def run_child(tmp_path, data_dir, kill_at, settings=KILLED):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"out-{data_dir.name}-{kill_at}.pt"
    tests = Path(__file__).resolve().parent
    mirror = multi30k_folder()[0]
    env = {**os.environ, "MULTI30K_DIR": str(mirror), "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    fields = json.dumps(dataclasses.asdict(settings))
    result = subprocess.run(
        [sys.executable, str(script), str(data_dir), str(out), str(kill_at), fields],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, out


def same_outputs(straight_out, resumed_out) -> list:
    """Asserts that the two runs' models are equal to the last bit; returns their scores."""
    a = torch.load(straight_out, weights_only=True)
    b = torch.load(resumed_out, weights_only=True)
    assert_same_weights(a["model"], b["model"])
    scores = [
        [(h["train_loss"], h["val_loss"], h["val_bleu"], h.get("averaged")) for h in run["history"]]
        for run in (a, b)
    ]
    assert scores[0] == scores[1]
    return scores[0]


@pytest.mark.slow
def test_sigkill_mid_epoch_then_restart_is_bit_identical(quick_data, tmp_path):
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", kill_at=0)
    assert straight.returncode == 0, straight.stderr[-2000:]

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # the folder that this process names for the run: the one the child trained in
    folder = trainer.run_folder(KILLED, quick_data, vars(at), tmp_path / "killed")
    last = read_checkpoint(folder / "last.pt")
    assert last["history"] == [] and last["ranks"][0]["position"]["done"] > 0  # mid-epoch 0
    assert last["state"]["step"] == 3  # the last multiple of checkpoint_steps before 5

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", kill_at=0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    assert len(same_outputs(straight_out, resumed_out)) == 2


@pytest.mark.slow
def test_a_budget_run_killed_in_its_last_epoch_resumes_to_the_same_average(quick_data, tmp_path):
    """Linear decay, clipping and averaging survive SIGKILL: the epoch files already
    written are kept, and the averaged model is bit-identical to an uninterrupted run's."""
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", 0, BUDGET)
    assert straight.returncode == 0, straight.stderr[-2000:]
    last = trainer.run_folder(BUDGET, quick_data, vars(at), tmp_path / "straight") / "last.pt"
    kill_at = read_checkpoint(last)["state"]["step"] * 5 // 6  # in the last of three epochs

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at, BUDGET)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    folder = trainer.run_folder(BUDGET, quick_data, vars(at), tmp_path / "killed")
    assert (folder / "epoch-1.pt").is_file() and not (folder / "epoch-2.pt").exists()
    assert len(read_checkpoint(folder / "last.pt")["history"]) == 2

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", 0, BUDGET)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    scores = same_outputs(straight_out, resumed_out)
    assert len(scores) == 3 and scores[-1][-1]["epochs"] == [1, 2]


# --- a planned run killed around its re-plan ------------------------------------------------


class StepClock:
    """trainer's `time` module with a fake `perf_counter` that only optimizer steps move:
    a second a step in the first epoch, a thousand after it (as if the machine slowed
    down), nothing for validation. It reads the step of the run that resumed last, so a
    resumed run measures what an uninterrupted one measured, on any machine."""

    def __init__(self):
        self.run = None

    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self) -> float:
        if self.run is None:
            return 0.0
        step, first_epoch = self.run.state.step, self.run.plan.epoch_steps
        return float(min(step, first_epoch) + 1000 * max(step - first_epoch, 0))


@pytest.fixture
def step_clock(monkeypatch):
    clock = StepClock()
    resume = trainer.Run.resume

    def resume_on_the_clock(run, *args):
        clock.run = run
        return resume(run, *args)

    monkeypatch.setattr(trainer.Run, "resume", resume_on_the_clock)
    monkeypatch.setattr(trainer, "time", clock)
    return clock


def plan_of(history) -> dict:
    """The plan that a run ended with, but for when it was made."""
    return {k: v for k, v in history[-1]["plan"].items() if k != "made"}


# planned to the clock; no mid-epoch checkpoints
PLANNED = dataclasses.replace(quick_settings(), epochs=None, train_minutes=1.5, checkpoint_steps=0)


@pytest.mark.slow
def test_a_planned_run_killed_around_its_replan_resumes_bit_for_bit(
    quick_data, tmp_path, step_clock
):
    """The run plans from the timed steps of its first epoch; its second epoch is slower
    (see StepClock), so the re-plan after it cuts the run to three epochs. Killed between
    that re-plan and the epoch's last.pt, or in the middle of its last epoch, the run
    resumes and ends bit for bit where an uninterrupted run ends, with the same plan."""
    straight, history, _ = train_as_the_notebook(PLANNED, quick_data, tmp_path / "straight")
    plan = history[-1]["plan"]
    assert plan["made"] and plan["tokens_per_second"] > 0  # planned from the timed steps
    change = plan["replans"][-1]
    assert change["after_epoch"] == 1 and change["was"] > plan["epochs"] == 3 == len(history)

    with stopped_at_save(at_an_epochs_end(1), written=False):
        train_as_the_notebook(PLANNED, quick_data, tmp_path / "between")
    folder = trainer.run_folder(PLANNED, quick_data, vars(at), tmp_path / "between")
    last = read_checkpoint(folder / "last.pt")
    assert len(last["history"]) == 1 and last["plan"]["epochs"] == change["was"]  # before it
    resumed, resumed_history, _ = train_as_the_notebook(PLANNED, quick_data, tmp_path / "between")
    assert_same_weights(straight, resumed)
    assert plan_of(resumed_history) == plan_of(history)
    assert losses(resumed_history) == losses(history)

    every_step = dataclasses.replace(PLANNED, checkpoint_steps=1)  # the same run's folder

    def in_last_epoch(run) -> bool:
        return run.state.step == plan["steps"] - 1

    with stopped_at_save(in_last_epoch, written=True):
        train_as_the_notebook(every_step, quick_data, tmp_path / "last-epoch")
    folder = trainer.run_folder(PLANNED, quick_data, vars(at), tmp_path / "last-epoch")
    last = read_checkpoint(folder / "last.pt")
    assert len(last["history"]) == 2 and last["plan"]["epochs"] == 3  # the re-plan is kept
    resumed, resumed_history, _ = train_as_the_notebook(
        PLANNED, quick_data, tmp_path / "last-epoch"
    )
    assert_same_weights(straight, resumed)
    assert plan_of(resumed_history) == plan_of(history)
    assert losses(resumed_history) == losses(history)

"""Checkpoints and exact resume: after an epoch, after SIGKILL (with averaging); files
that are damaged, would run code, or belong to another run."""

import contextlib
import dataclasses
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_same_weights,
    loop_objects,
    multi30k_folder,
    quick_settings,
    tiny_data,
    tiny_settings,
    train_as_the_notebook,
)  # fmt: skip

import annotated_transformer as at
import plumbing
import trainer
from plumbing import CheckpointError, read_checkpoint

TINY = tiny_settings(dropout=0.1, beam_size=3)
# the quick preset for two epochs: linear decay to zero and clipping, as the cpu preset
TWO_EPOCHS = dataclasses.replace(quick_settings(), epochs=2)


def losses(history) -> list:
    return [(h["train_loss"], h["val_loss"], h["val_bleu"]) for h in history]


class Stopped(Exception):
    """The run stopped here, as if killed."""


@contextlib.contextmanager
def stopped_after_saving(epoch: int):
    """trainer.save_last raises Stopped right after writing the last.pt of epoch `epoch`.
    functools.wraps keeps save_last's code, and so the run's folder, as it was."""
    save = trainer.save_last

    @functools.wraps(save)
    def save_then_stop(folder, kept, history, *args):
        save(folder, kept, history, *args)
        if len(history) == epoch + 1:
            raise Stopped

    trainer.save_last = save_then_stop
    try:
        with pytest.raises(Stopped):
            yield
    finally:
        trainer.save_last = save


@pytest.mark.slow
def test_a_run_stopped_after_its_first_epoch_resumes_to_the_same_weights(
    quick_data, tmp_path, capsys
):
    straight, straight_history, _ = train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "a")
    with stopped_after_saving(epoch=0):
        train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "b")
    folder = plumbing.run_folder(TWO_EPOCHS, quick_data, vars(at), tmp_path / "b")
    last = read_checkpoint(folder / "last.pt")
    assert (
        len(last["history"]) == 1 and last["schedule"]["last_epoch"] == last["history"][0]["step"]
    )
    capsys.readouterr()
    resumed, history, _ = train_as_the_notebook(TWO_EPOCHS, quick_data, tmp_path / "b")
    out = capsys.readouterr().out
    assert "going on after epoch 0, step" in out and "training" not in out
    assert [h["epoch"] for h in history] == [0, 1]
    assert_same_weights(straight, resumed)
    assert losses(history) == losses(straight_history)  # the same seed: the same curve
    # "Watch it learn": every epoch keeps its translations of the watched sentences,
    # the first epoch's through the resume too
    watched = [h["watched"] for h in history]
    assert [len(w) for w in watched] == [len(at.WATCHED_SENTENCES)] * 2
    assert all(isinstance(t, str) for w in watched for t in w)
    assert watched == [h["watched"] for h in straight_history]


@pytest.mark.slow
def test_a_run_stopped_while_averaging_averages_the_same_epochs_again(quick_data, tmp_path):
    """Stopped after the first of the two epochs it averages: last.pt holds the average so
    far, and the rerun adds the last epoch to it and scores the same mean as an
    uninterrupted run."""
    settings = dataclasses.replace(TWO_EPOCHS, average_last=2)
    straight, straight_history, _ = train_as_the_notebook(settings, quick_data, tmp_path / "a")
    with stopped_after_saving(epoch=0):
        train_as_the_notebook(settings, quick_data, tmp_path / "b")
    resumed, history, _ = train_as_the_notebook(settings, quick_data, tmp_path / "b")
    assert_same_weights(straight, resumed)
    assert history[-1]["averaged"] == straight_history[-1]["averaged"]
    assert history[-1]["averaged"]["epochs"] == [0, 1]


def test_a_finished_run_round_trips_and_a_damaged_checkpoint_is_refused(tmp_path, capsys):
    """A run whose last.pt holds all its epochs loads, on any number of processes: its
    weights and schedule come back, and it says so in one line."""
    vocabs = tiny_data().vocabs
    kept = loop_objects(TINY, vocabs)
    history = [{"epoch": 0, "train_loss": 3.5, "val_loss": 3.25}]
    trainer.save_last(tmp_path, kept, history, world_size=2)
    fresh = loop_objects(dataclasses.replace(TINY, seed=1), vocabs)
    with pytest.raises(AssertionError):
        assert_same_weights(kept["model"], fresh["model"])  # so that loading has work to do
    fresh["schedule"].last_epoch = 7  # to be overwritten
    assert trainer.load_last(tmp_path, fresh, 1) == history and fresh["schedule"].last_epoch == 0
    assert_same_weights(kept["model"], fresh["model"])
    assert capsys.readouterr().out == f"loaded {tmp_path / 'last.pt'}\n"
    with pytest.raises(CheckpointError, match="by a run on 2 process"):
        trainer.load_last(tmp_path, fresh, 2)  # unfinished: it goes on only on 2 processes
    good = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="last.pt is damaged or truncated"):
        trainer.load_last(tmp_path, kept, 1)  # what a run started again reads


class Trap:
    """Pickles into a call that writes a file: what a malicious checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model": {}, "trap": Trap(marker)}, tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        trainer.load_last(tmp_path, {}, 1)
    assert not marker.exists(), "loading a checkpoint ran code"
    torch.load(tmp_path / "last.pt", weights_only=False)  # the trap is real: unpickling runs it
    assert marker.read_text() == "code ran"


def test_a_checkpoint_copied_from_a_run_on_other_vocabularies_stops_in_one_line(tmp_path):
    """Vocabularies of the same size give weights of the same shapes: without the record
    of what a checkpoint was trained on, it would load without a word."""
    data = tiny_data()
    de = data.vocabs["de"]
    other = at.Vocab([*de.itos[:4], *reversed(de.itos[4:])])  # the same size, other ids
    others = dataclasses.replace(data, vocabs={"de": other, "en": data.vocabs["en"]})
    mine = plumbing.run_folder(TINY, data, vars(at), tmp_path)
    theirs = plumbing.run_folder(TINY, others, vars(at), tmp_path)
    assert mine != theirs
    trainer.save_last(theirs, loop_objects(TINY, others.vocabs), [{"epoch": 0}])
    shutil.copy(theirs / "last.pt", mine / "last.pt")  # by hand
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    for epochs in (1, 2):  # finished, and to go on from
        with pytest.raises(CheckpointError) as refused:
            trainer.load_last(mine, loop_objects(TINY, data.vocabs), epochs)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(str(mine / "last.pt"))
        assert "was trained with other vocabularies" in message and "retrain=True" in message
    lacking = {k: v for k, v in read_checkpoint(theirs / "last.pt").items() if k != "processes"}
    plumbing.save_checkpoint(mine / "last.pt", **lacking)  # hand-made: a key is missing
    with pytest.raises(CheckpointError, match="last.pt does not say what it was trained on"):
        trainer.load_last(mine, loop_objects(TINY, data.vocabs), 2)
    shutil.copy(theirs / "last.pt", mine / "last.pt")
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before  # nothing lost
    loaded = trainer.load_last(theirs, loop_objects(TINY, others.vocabs), 1)
    assert loaded == [{"epoch": 0}]  # where it belongs: loads


# --- killed for real: SIGKILL, no cleanup, no finally blocks ------------------------------

CHILD = """
import json, os, signal, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
import annotated_transformer as at
import plumbing
from stopping_jobs import stop_after_step

data_dir, out, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
settings = at.Settings(**json.loads(sys.argv[4]))
if kill_at:
    stop_after_step(kill_at, lambda: os.kill(os.getpid(), signal.SIGKILL))
data = at.prepare_data(settings, data_dir)
# the notebook's training cell
folder = plumbing.run_folder(settings, data, vars(at), data_dir)
model, history = at.train(settings, data, folder, device=torch.device("cpu"))
torch.save({"model": model.state_dict(), "history": history}, out)
"""
# three epochs of linear decay, clipping and averaging of the last two
KILLED = dataclasses.replace(TWO_EPOCHS, batch_tokens=300, epochs=3, average_last=2)


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
def test_sigkill_mid_epoch_then_rerun_is_bit_identical_averaging_included(quick_data, tmp_path):
    """Killed in the middle of its last epoch, a run goes on from the last finished epoch
    (its last.pt, with the average so far) and ends bit-identical to an
    uninterrupted run: weights, losses, BLEU and the averaged model's scores."""
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", 0)
    assert straight.returncode == 0, straight.stderr[-2000:]
    steps = at.total_steps(quick_data.train, KILLED)
    kill_at = steps * 5 // 6  # in the middle of the last of three epochs
    assert 2 * steps // 3 < kill_at < steps

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # the folder that this process names for the run: the one the child trained in
    folder = plumbing.run_folder(KILLED, quick_data, vars(at), tmp_path / "killed")
    last = read_checkpoint(folder / "last.pt")
    assert len(last["history"]) == 2 and last["schedule"]["last_epoch"] == 2 * steps // 3
    assert last["average"]["n_averaged"] == 1  # epoch 1 of the last two, averaged so far

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", 0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "going on after epoch 1" in resumed.stdout
    scores = same_outputs(straight_out, resumed_out)
    assert len(scores) == 3 and scores[-1][-1]["epochs"] == [1, 2]


@pytest.mark.slow
def test_a_teachers_finished_run_loads_under_another_build_of_the_same_torch(
    quick_data, tmp_path, capsys, monkeypatch
):
    """A teacher trains once and hands out the run's folder: a student's torch of the same
    release but another build (2.13.0 on a Mac, +cu128 with CUDA, +cpu on Linux) names the
    same folder and loads the finished run, saying where and with what it was trained. An
    unfinished run goes on under the other build, saying that it is not bit-identical; another
    release names another folder and trains anew."""
    teacher = tmp_path / "teacher" / "data"
    with stopped_after_saving(epoch=0):
        train_as_the_notebook(TWO_EPOCHS, quick_data, teacher)
    shutil.copytree(teacher, tmp_path / "half")  # a copy of the run, one epoch in
    _, taught, folder = train_as_the_notebook(TWO_EPOCHS, quick_data, teacher)
    their_build = torch.__version__
    release = their_build.split("+")[0]
    student, half = tmp_path / "student" / "data", tmp_path / "half"
    shutil.copytree(teacher, student)  # what a student unpacks into the project's data/
    other_build = release if "+" in their_build else f"{release}+cu128"
    monkeypatch.setattr(torch, "__version__", other_build)
    capsys.readouterr()
    _, history, theirs = train_as_the_notebook(TWO_EPOCHS, quick_data, student)
    out = capsys.readouterr().out
    assert theirs.name == folder.name and history == taught
    assert out.splitlines() == [f"loaded {theirs / 'last.pt'}, trained with torch {their_build} "
                                f"and Python {platform.python_version()}"]  # fmt: skip
    _, history, resumed = train_as_the_notebook(TWO_EPOCHS, quick_data, half)
    out = capsys.readouterr().out
    assert resumed.name == folder.name and len(history) == 2
    assert f"ran under torch {their_build}, the rest run under {other_build}" in out
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")  # another release
    assert plumbing.run_folder(TWO_EPOCHS, quick_data, vars(at), student).name != folder.name

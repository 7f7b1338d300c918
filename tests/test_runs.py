"""One folder per run: what names it (the settings, the lesson's code), loading a finished
run instead of training it again, and the record of a run."""

import dataclasses
import linecache

import pytest
import torch
from conftest import ROOT, prepared_data

import annotated_transformer as at
import trainer
from plumbing import CheckpointError, read_checkpoint

# the smoke preset, cut to one quick epoch on 200 pairs
SETTINGS = dataclasses.replace(
    at.SMOKE, train_pairs=200, eval_pairs=20, batch_tokens=400, epochs=1, warmup=2, average_last=1
)
CPU = torch.device("cpu")
LESSON = trainer.Lesson.of(at)
SOURCE = (ROOT / "annotated_transformer.py").read_text(encoding="utf-8")


@pytest.fixture
def data(tmp_path, monkeypatch):
    return prepared_data(SETTINGS, tmp_path, monkeypatch)


def weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def same_weights(a, b) -> bool:
    a, b = weights(a), weights(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_cell(source: str, namespace: dict, filename: str, monkeypatch) -> dict:
    """Run `source` into `namespace` as a kernel runs a cell: with its text in linecache,
    where inspect (and so the lesson's code fingerprint) finds it."""
    lines = source.splitlines(keepends=True)
    monkeypatch.setitem(linecache.cache, filename, (len(source), None, lines, filename))
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def lesson_copy(monkeypatch, namespace: dict | None = None, source: str = SOURCE) -> dict:
    """The twin's cells run afresh into a namespace of their own."""
    namespace = {"__name__": "lesson_copy"} if namespace is None else namespace
    return run_cell(source, namespace, "annotated_transformer.py", monkeypatch)


# the edit: a cell that redefines attention() to count its calls, in training and not
COUNTING_ATTENTION = """
unedited_attention = attention
attention_calls = {"training": 0, "other": 0}


def attention(**kwargs):
    attention_calls["training" if torch.is_grad_enabled() else "other"] += 1
    return unedited_attention(**kwargs)
"""


def test_a_lesson_function_edited_in_the_notebook_is_the_one_that_trains(
    data, tmp_path, monkeypatch
):
    # bf16 autocast on a CPU: the model calls the lesson's attention(), not PyTorch's kernel
    settings = dataclasses.replace(SETTINGS, precision="bf16")
    unedited = trainer.Lesson.of(lesson_copy(monkeypatch))
    assert unedited.model_for.__module__ == "lesson_copy"  # the copy's own functions
    assert trainer.Lesson.of(lesson_copy(monkeypatch)).code == unedited.code  # same code, key
    namespace = lesson_copy(monkeypatch)
    run_cell(COUNTING_ATTENTION, namespace, "edited_cell.py", monkeypatch)  # the edited cell
    edited = trainer.Lesson.of(namespace)

    trained = trainer.load_or_train(edited, settings, data, tmp_path, device=CPU, show=False)
    calls = namespace["attention_calls"]
    assert calls["training"] > 0 and calls["other"] > 0  # training and validation used it
    assert trained.folder == trainer.run_dir(settings, edited, tmp_path)
    assert trained.folder != trainer.run_dir(settings, unedited, tmp_path)  # a new run


def test_a_changed_comment_keeps_the_run_a_changed_line_of_code_does_not(monkeypatch):
    unedited = trainer.Lesson.of(lesson_copy(monkeypatch)).code
    body = "    d_k = query.size(-1)\n"
    assert SOURCE.count(body) == 1  # in attention()
    commented = SOURCE.replace(body, body + "    # a note of the student's\n")
    assert trainer.Lesson.of(lesson_copy(monkeypatch, source=commented)).code == unedited
    scaled = SOURCE.replace(body, "    d_k = 2 * query.size(-1)\n")
    assert trainer.Lesson.of(lesson_copy(monkeypatch, source=scaled)).code != unedited


def test_a_changed_setting_trains_a_new_model_beside_the_old_one(data, tmp_path, capsys):
    first = trainer.load_or_train(LESSON, SETTINGS, data, tmp_path, device=CPU, show=False)
    assert "training into" in capsys.readouterr().out

    changed = dataclasses.replace(SETTINGS, dropout=0.2, lr_factor=2.0)
    second = trainer.load_or_train(LESSON, changed, data, tmp_path, device=CPU, show=False)
    assert "training into" in capsys.readouterr().out
    assert second.folder != first.folder and (first.folder / "final.pt").is_file()
    assert not same_weights(first.model, second.model)

    # unchanged, or changed only in what does not shape training: loaded, not trained
    for same in (SETTINGS, dataclasses.replace(SETTINGS, beam_size=5, checkpoint_steps=7)):
        again = trainer.load_or_train(LESSON, same, data, tmp_path, device=CPU, show=False)
        out = capsys.readouterr().out
        assert "loaded" in out and "training into" not in out
        assert again.folder == first.folder and same_weights(again.model, first.model)
        assert again.history == first.history

    # a model of another shape: refused in one line that names the setting
    final = first.folder / "final.pt"
    flipped = dataclasses.replace(SETTINGS, pre_norm=not SETTINGS.pre_norm)
    with pytest.raises(RuntimeError, match="state_dict"):  # what loading it blindly gives
        at.model_for(flipped, data.vocabs).load_state_dict(read_checkpoint(final)["model"])
    with pytest.raises(CheckpointError, match=r"other settings \(pre_norm\)") as refused:
        trainer.load_checkpoint(final, flipped, data.vocabs)
    assert "\n" not in str(refused.value) and "state_dict" not in str(refused.value)


def test_the_record_pairs_the_runs_own_settings_with_its_history(data, tmp_path, monkeypatch):
    """A planned run trains with the plan's epochs and fitted warm-up, but its folder and
    its checkpoints are named by the settings as given: those are the ones the record
    carries, beside the history, trained or loaded."""

    def speed(*args, **kwargs):  # epochs of 1 s and a validation of 0.4 s: 2 fit in 3 s
        epoch_tokens = sum(len(tgt) - 1 for _, tgt in data.train)
        return {"tokens_per_second": epoch_tokens / 1.0, "validation_seconds": 0.4}

    monkeypatch.setattr(trainer, "measure_speed", speed)
    settings = dataclasses.replace(SETTINGS, train_minutes=0.05, warmup=8)
    trained = trainer.load_or_train(LESSON, settings, data, tmp_path, device=CPU, show=False)
    plan = trained.history[-1]["plan"]
    assert plan["epochs"] == len(trained.history) == 2 != settings.epochs
    assert plan["warmup"] < settings.warmup  # fitted to the run's 10 steps
    loaded = trainer.load_or_train(LESSON, settings, data, tmp_path, device=CPU, show=False)
    stored = read_checkpoint(trained.folder / "final.pt")
    for run in (trained, loaded):
        record = trainer.run_record(LESSON, run, {"test_bleu": 1.0}, CPU)
        assert run.settings == settings and record["settings"] == dataclasses.asdict(settings)
        assert trainer.run_dir(run.settings, LESSON, tmp_path) == run.folder
        assert record["run_folder"] == str(trained.folder)
        assert stored["settings"] == trainer.training_settings(run.settings)
        assert record["history"] == stored["history"] == trained.history
        assert record["epochs"] == 2 and record["plan"] == plan and record["test_bleu"] == 1.0


def test_an_epoch_on_a_cpu_reports_no_gpu(data, tmp_path, capsys):
    trainer.load_or_train(LESSON, SETTINGS, data, tmp_path, device=CPU, show=True)
    out = capsys.readouterr().out
    assert "epoch 0: train loss" in out  # the epoch's line is there
    assert "no NVIDIA GPU here" not in out and "memory used / total" not in out

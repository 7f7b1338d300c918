"""One folder per run: named by everything that shapes the trained model, with a manifest
that says what made it; an edit made as a student makes it reaches training; a finished
run loads instead of training again; the record of a run."""

import dataclasses
import json
import linecache

import pytest
import torch
from conftest import CPU, ROOT, quick_settings, train_as_the_notebook

import annotated_transformer as at
import trainer
from plumbing import CheckpointError, read_checkpoint

SETTINGS = quick_settings()
SOURCE = (ROOT / "annotated_transformer.py").read_text(encoding="utf-8")


def weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def same_weights(a, b) -> bool:
    a, b = weights(a), weights(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_cell(source: str, namespace: dict, filename: str, monkeypatch) -> dict:
    """Run `source` into `namespace` as a kernel runs a cell: with its text in linecache,
    where inspect (and so the run's folder) finds it."""
    lines = source.splitlines(keepends=True)
    monkeypatch.setitem(linecache.cache, filename, (len(source), None, lines, filename))
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def lesson_copy(monkeypatch, source: str = SOURCE) -> dict:
    """The twin's cells run afresh into a namespace of their own, as a kernel holds them."""
    return run_cell(source, {"__name__": "__main__"}, "annotated_transformer.py", monkeypatch)


def edited(monkeypatch, old: str, new: str) -> dict:
    """A kernel's namespace after a student's edit of one line of a lesson cell."""
    assert SOURCE.count(old) == 1, old
    return lesson_copy(monkeypatch, SOURCE.replace(old, new))


# the edit: a cell that redefines attention() to count its calls and halve its queries
COUNTING_ATTENTION = """
unedited_attention = attention
attention_calls = {"training": 0, "other": 0}


def attention(*, query, key, value, mask=None, dropout=None):
    attention_calls["training" if torch.is_grad_enabled() else "other"] += 1
    return unedited_attention(query=0.5 * query, key=key, value=value, mask=mask, dropout=dropout)
"""


def test_an_edited_attention_is_the_one_that_trains(quick_data, tmp_path, monkeypatch):
    model, _, folder = train_as_the_notebook(
        SETTINGS, quick_data, tmp_path, lesson_copy(monkeypatch)
    )
    namespace = run_cell(COUNTING_ATTENTION, lesson_copy(monkeypatch), "cell.py", monkeypatch)
    edited_model, _, edited_folder = train_as_the_notebook(
        SETTINGS, quick_data, tmp_path, namespace
    )
    calls = namespace["attention_calls"]
    assert calls["training"] > 0 and calls["other"] > 0  # training and validation used it
    assert edited_folder != folder and not same_weights(model, edited_model)
    manifest = json.loads((edited_folder / "manifest.json").read_text())
    assert set(manifest) == {"preset", "settings", "data", "code", "trainer"}
    assert "attention" in manifest["code"] and "run_epoch" in manifest["code"]


def test_an_edit_says_what_changed_and_trains_beside_the_old_run(
    quick_data, tmp_path, monkeypatch, capsys
):
    train_as_the_notebook(SETTINGS, quick_data, tmp_path, lesson_copy(monkeypatch))
    assert "training into" in capsys.readouterr().out
    namespace = edited(monkeypatch, "    d_k = query.size(-1)\n", "    d_k = 2 * query.size(-1)\n")
    _, _, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path, namespace)
    out = capsys.readouterr().out
    assert f"trained before with other code for: attention; training anew into {folder}" in out
    assert len(list((tmp_path / "checkpoints").glob("*/final.pt"))) == 2  # the old one kept


@pytest.mark.parametrize(
    "old, new",
    [
        # data preparation: one line of encode_pairs written another way
        ("        pairs.append((src, tgt))\n", "        pairs += [(src, tgt)]\n"),
        # Part 4: shares the batches out in another order
        ("    return divisible_batches(batches, world_size)[rank::world_size]\n",
         "    return list(reversed(divisible_batches(batches, world_size)))[rank::world_size]\n"),
        # Part 4's epoch: its loop, one line
        ("    device = batches[0].src.device\n", "    device = batches[-1].src.device\n"),
        # the label smoothing that training uses
        ("class FastLabelSmoothing(LabelSmoothing):",
         "class FastLabelSmoothing(LabelSmoothing, object):"),
    ],
    ids=["encode_pairs", "shard_batches", "ddp_epoch", "FastLabelSmoothing"],
)  # fmt: skip
def test_an_edited_cell_of_any_part_names_a_new_folder(quick_data, tmp_path, monkeypatch, old, new):
    unedited = trainer.run_folder(SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path)
    changed = trainer.run_folder(SETTINGS, quick_data, edited(monkeypatch, old, new), tmp_path)
    assert changed != unedited


def test_data_that_changed_names_a_new_folder(quick_data, tmp_path):
    folder = trainer.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    fewer = dataclasses.replace(quick_data, train=quick_data.train[:-1])
    assert trainer.run_folder(SETTINGS, fewer, vars(at), tmp_path) != folder


def test_a_changed_comment_keeps_the_folder(quick_data, tmp_path, monkeypatch):
    unedited = trainer.run_folder(SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path)
    body = "    d_k = query.size(-1)\n"
    commented = edited(monkeypatch, body, body + "    # a note of the student's\n")
    assert trainer.run_folder(SETTINGS, quick_data, commented, tmp_path) == unedited
    # the notebook's namespace and the imported twin name the same folder
    assert trainer.run_folder(SETTINGS, quick_data, vars(at), tmp_path) == unedited


def test_a_definition_without_source_is_an_error_not_a_blank(quick_data, tmp_path):
    namespace = dict(vars(at))
    exec("def attention(**kwargs): pass", namespace)  # no file, no linecache entry
    with pytest.raises(CheckpointError, match="cannot read the code of attention"):
        trainer.run_folder(SETTINGS, quick_data, namespace, tmp_path)


def test_a_folder_is_named_by_its_preset_and_the_settings_that_shape_training(quick_data, tmp_path):
    folder = trainer.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    name, _, key = folder.name.rpartition("-")
    assert folder.parent == tmp_path / "checkpoints" and name == "smoke" and len(key) == 8
    same = {"beam_size": 9, "length_penalty": 0.1, "checkpoint_steps": 3}
    assert (
        trainer.run_folder(dataclasses.replace(SETTINGS, **same), quick_data, vars(at), tmp_path)
        == folder
    )
    others = {
        trainer.run_folder(
            dataclasses.replace(SETTINGS, **{field: value}), quick_data, vars(at), tmp_path
        )
        for field, value in [("epochs", 3), ("lr_factor", 0.5), ("seed", 1), ("dropout", 0.2)]
    }
    assert len(others) == 4 and folder not in others


def test_an_unchanged_run_loads_and_a_changed_setting_trains_beside_it(
    quick_data, tmp_path, capsys
):
    first, history, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    assert "training into" in capsys.readouterr().out
    again, again_history, again_folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert f"loaded {folder / 'final.pt'}" in out and "training" not in out
    assert again_folder == folder and same_weights(again, first) and again_history == history

    changed = dataclasses.replace(SETTINGS, dropout=0.2, lr_factor=2.0)
    second, _, second_folder = train_as_the_notebook(changed, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert "other settings for: dropout, lr_factor; training anew" in out
    assert second_folder != folder and (folder / "final.pt").is_file()
    assert not same_weights(first, second)


def test_a_missing_checkpoint_is_reported_as_missing(tmp_path):
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(tmp_path / "final.pt")
    assert "is missing" in str(error.value) and "damaged" not in str(error.value)


def test_the_record_pairs_the_runs_own_settings_with_its_history(quick_data, tmp_path):
    model, history, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    loaded, loaded_history, _ = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    for m, h in ((model, history), (loaded, loaded_history)):
        record = trainer.run_record(m, h, SETTINGS, folder, {"test_bleu": 1.0}, CPU)
        assert record["settings"] == dataclasses.asdict(SETTINGS)
        assert record["history"] == read_checkpoint(folder / "final.pt")["history"]
        assert record["epochs"] == SETTINGS.epochs and record["test_bleu"] == 1.0
        assert record["run_folder"] == str(folder) and record["plan"]["epochs"] == 1
        assert record["parameters"] == at.count_parameters(m)


def test_an_epoch_on_a_cpu_reports_no_gpu(quick_data, tmp_path, capsys):
    train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert "epoch 0: train loss" in out  # the epoch's line is there
    assert "no NVIDIA GPU here" not in out and "memory used / total" not in out


def test_an_edit_that_ddp_workers_cannot_see_is_named(monkeypatch):
    """DDP's workers import the .py twin: Part 10's cell names the notebook's edits they
    will not train with, instead of looking for their run in the wrong folder."""
    assert trainer.not_in_twin(lesson_copy(monkeypatch)) == []
    namespace = edited(monkeypatch, "    d_k = query.size(-1)\n", "    d_k = 2 * query.size(-1)\n")
    assert trainer.not_in_twin(namespace) == ["attention"]

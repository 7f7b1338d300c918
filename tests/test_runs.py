"""One folder per run: named by what training reaches (the settings that shape training,
the data, torch's version, and the code that `train` calls), with a manifest that says what
made it; an edit made as a student makes it reaches training, and an edit off that path
keeps the trained model; a finished run loads instead of training again; the record."""

import ast
import dataclasses
import inspect
import json
import linecache
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU, ROOT, quick_settings, run_cell, same_weights, train_as_the_notebook

import annotated_transformer as at
import plumbing
import trainer
from plumbing import CheckpointError, read_checkpoint

SETTINGS = quick_settings()
SOURCE = (ROOT / "annotated_transformer.py").read_text(encoding="utf-8")


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


@pytest.mark.slow
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
    assert set(manifest) == {"settings", "data", "code", "torch", "torch build", "python"}
    assert "attention" in manifest["code"] and "run_epoch" in manifest["code"]
    assert "trainer.save_last" in manifest["code"] and "trainer.save_checkpoint" in manifest["code"]


@pytest.mark.slow
def test_an_edit_says_what_changed_and_trains_beside_the_old_run(
    quick_data, tmp_path, monkeypatch, capsys
):
    train_as_the_notebook(SETTINGS, quick_data, tmp_path, lesson_copy(monkeypatch))
    assert "training into" in capsys.readouterr().out
    namespace = edited(monkeypatch, "    d_k = query.size(-1)\n", "    d_k = 2 * query.size(-1)\n")
    _, _, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path, namespace)
    out = capsys.readouterr().out
    assert "trained before with other code for: attention; this run trains anew" in out
    assert out.index("this run trains anew") < out.index(f"training into {folder}")
    assert len(list((tmp_path / "checkpoints").glob("*/last.pt"))) == 2  # the old one kept


DDP = ("train", "DDPProcesses")  # what DDP's workers train with (tools/train_ddp.py)


@pytest.mark.parametrize(
    "old, new, roots",
    [
        # Appendix C: shares the batches out in another order
        ("    return divisible_batches(batches, world_size)[rank::world_size]\n",
         "    return list(reversed(divisible_batches(batches, world_size)))[rank::world_size]\n",
         DDP),
        # Appendix C's epoch: its loop, one line
        ("    device = batches[0].src.device\n", "    device = batches[-1].src.device\n", DDP),
        # the label smoothing that training uses
        ("class FastLabelSmoothing(LabelSmoothing):",
         "class FastLabelSmoothing(LabelSmoothing, object):", ("train",)),
        # validation's greedy decoding, decorated with @torch.no_grad()
        ("        next_word = next_word.masked_fill(finished, ids.pad)\n",
         "        next_word = next_word.masked_fill(finished.clone(), ids.pad)\n", ("train",)),
    ],
    ids=["shard_batches", "ddp_epoch", "FastLabelSmoothing", "greedy_decode"],
)  # fmt: skip
def test_an_edited_cell_on_the_training_path_names_a_new_folder(
    quick_data, tmp_path, monkeypatch, old, new, roots
):
    unedited = plumbing.run_folder(
        SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path, roots=roots
    )
    namespace = edited(monkeypatch, old, new)
    assert plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path, roots=roots) != unedited


@pytest.mark.parametrize(
    "old, new",
    [
        # Part 8's sentence, which the lesson invites a student to change
        ('ATTENTION_SENTENCE = "', 'ATTENTION_SENTENCE = "Zwei Hunde spielen. '),
        # beam search, which training never calls
        ('        scores = candidates["scores"]\n',
         '        scores = candidates["scores"].clone()\n'),
        # a docstring on the training path
        ('    """Train on the batches once; return the mean loss per real target '
         'token."""',
         '    """Train on the batches once, as Part 3 showed."""'),
    ],
    ids=["ATTENTION_SENTENCE", "beam_search", "docstring"],
)  # fmt: skip
def test_an_edit_off_the_training_path_keeps_the_folder(
    quick_data, tmp_path, monkeypatch, old, new
):
    unedited = plumbing.run_folder(SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path)
    namespace = edited(monkeypatch, old, new)
    assert plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path) == unedited


def test_a_helper_reached_only_inside_a_no_grad_function_is_followed(
    quick_data, tmp_path, monkeypatch
):
    """evaluate, which the loop calls after each epoch, is wrapped by @torch.no_grad(): the
    key reads the function inside, and follows the names it uses."""
    source = inspect.getsource(at.evaluate)
    call = "batch_loss(model, criterion, batch).item()"
    assert source.count(call) == 1
    cell = "def loss_of(model, criterion, batch):\n    return batch_loss(model, criterion, batch)\n"
    cell += "\n\n" + source.replace(call, "loss_of(model, criterion, batch).item()")
    namespace = run_cell(cell, lesson_copy(monkeypatch), "cell.py", monkeypatch)
    folder = plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path)
    assert "loss_of" in json.loads((folder / "manifest.json").read_text())["code"]
    edited_cell = cell.replace("return batch_loss(", "return 1.0 * batch_loss(")
    namespace = run_cell(edited_cell, lesson_copy(monkeypatch), "cell2.py", monkeypatch)
    assert plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path) != folder


def test_an_edited_plumbing_function_that_training_calls_names_a_new_folder(
    quick_data, tmp_path, monkeypatch
):
    """trainer.save_last writes last.pt with plumbing.save_checkpoint: its code counts."""
    unedited = plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    path = inspect.getsourcefile(plumbing)
    text = (ROOT / "plumbing.py").read_text(encoding="utf-8")
    line = "    torch.save(content, buffer)\n"
    assert text.count(line) == 1
    edited_text = text.replace(line, "    torch.save(content, f=buffer)\n")
    lines = edited_text.splitlines(keepends=True)  # as many lines: the others stay in place
    monkeypatch.setitem(linecache.cache, path, (len(edited_text), None, lines, path))
    assert plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path) != unedited


# --- every edit on the data path reaches the data ----------------------------------------


@pytest.mark.parametrize(
    "old, new, subwords",
    [
        # tokenizing: every token lower-cased
        ("        lang: [[t.text for t in doc] for doc in tokenizers[lang].pipe(side)]\n",
         "        lang: [[t.text.lower() for t in doc] for doc in tokenizers[lang].pipe(side)]\n",
         False),
        # building a vocabulary: a word must be seen more often than min_freq
        ("        (t for t, c in counts.items() if c >= min_freq and t not in SPECIALS),\n",
         "        (t for t, c in counts.items() if c > min_freq and t not in SPECIALS),\n",
         False),
        # learning the merges: half as many
        ("learned, merges, is_dict=True)\n", "learned, merges // 2, is_dict=True)\n", True),
    ],
    ids=["tokenize_pairs", "build_vocab", "learned_merges"],
)  # fmt: skip
def test_an_edited_data_function_reaches_the_data_and_names_a_new_folder(
    quick_data, tmp_path, monkeypatch, old, new, subwords
):
    """No cache on disk stands between an edited cell and the data: prepare_data, run
    again as a student would, builds the data with the edit, in a new run's folder."""

    def prepare(namespace: dict):
        """prepare_data in `namespace`: words, or Appendix A's sub-words of 200 merges."""
        vocabs = namespace["vocabularies"]
        if subwords:
            joint = namespace["subword_vocabularies"]
            vocabs = lambda tokens: joint(tokens, merges=200)  # noqa: E731
        return namespace["prepare_data"](SETTINGS, tmp_path, make_vocabs=vocabs)

    before = prepare(lesson_copy(monkeypatch))
    unedited = plumbing.run_folder(SETTINGS, before, lesson_copy(monkeypatch), tmp_path)
    namespace = edited(monkeypatch, old, new)
    after = prepare(namespace)  # the same data folder: no cache
    words = [t for t in after.vocabs["en"].itos if t not in at.SPECIALS]
    if "lower" in new:
        assert all(w == w.lower() for w in words)
        assert any(w != w.lower() for w in before.vocabs["en"].itos[4:])
    elif "min_freq and" in new:
        assert set(words) < set(before.vocabs["en"].itos)
    else:
        assert len(after.vocabs["en"].merges) == 100 < len(before.vocabs["en"].merges)
    assert after.train != before.train
    assert plumbing.run_folder(SETTINGS, after, namespace, tmp_path) != unedited


@pytest.mark.slow
def test_retrain_moves_the_old_run_aside_and_trains_afresh(quick_data, tmp_path, capsys):
    _, _, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    again = plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path, retrain=True)
    assert again == folder and not (folder / "last.pt").exists()
    (kept,) = (tmp_path / "checkpoints" / "replaced").iterdir()
    assert (kept / "last.pt").is_file() and "moved the earlier run to" in capsys.readouterr().out


def test_data_that_changed_names_a_new_folder(quick_data, tmp_path):
    folder = plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    fewer = dataclasses.replace(quick_data, train=quick_data.train[:-1])
    assert plumbing.run_folder(SETTINGS, fewer, vars(at), tmp_path) != folder


def test_a_changed_comment_keeps_the_folder(quick_data, tmp_path, monkeypatch):
    unedited = plumbing.run_folder(SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path)
    body = "    d_k = query.size(-1)\n"
    commented = edited(monkeypatch, body, body + "    # a note of the student's\n")
    assert plumbing.run_folder(SETTINGS, quick_data, commented, tmp_path) == unedited
    # the notebook's namespace and the imported twin name the same folder
    assert plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path) == unedited


def test_a_definition_without_source_is_an_error_not_a_blank(quick_data, tmp_path, monkeypatch):
    namespace = lesson_copy(monkeypatch)
    exec("def attention(**kwargs): pass", namespace)  # no file, no linecache entry
    with pytest.raises(CheckpointError, match="cannot read the code of attention"):
        plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path)


def test_a_folder_is_named_by_its_preset_and_the_settings_that_shape_training(quick_data, tmp_path):
    folder = plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    name, _, key = folder.name.rpartition("-")
    assert folder.parent == tmp_path / "checkpoints" and name == "smoke" and len(key) == 8
    same = {"beam_size": 9, "length_penalty": 0.1}
    assert (
        plumbing.run_folder(dataclasses.replace(SETTINGS, **same), quick_data, vars(at), tmp_path)
        == folder
    )
    others = {
        plumbing.run_folder(
            dataclasses.replace(SETTINGS, **{field: value}), quick_data, vars(at), tmp_path
        )
        for field, value in [("epochs", 3), ("lr_factor", 0.5), ("seed", 1), ("dropout", 0.2)]
    }
    assert len(others) == 4 and folder not in others


@pytest.mark.slow
def test_an_unchanged_run_loads_and_a_changed_setting_trains_beside_it(
    quick_data, tmp_path, capsys
):
    first, history, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    assert "training into" in capsys.readouterr().out
    again, again_history, again_folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    out = capsys.readouterr().out
    built = f"torch {torch.__version__} and Python {platform.python_version()}"
    assert out == f"loaded {folder / 'last.pt'}, trained with {built}\n"  # nothing trained
    assert again_folder == folder and same_weights(again, first) and again_history == history

    changed = dataclasses.replace(SETTINGS, dropout=0.2, lr_factor=2.0)
    second, _, second_folder = train_as_the_notebook(changed, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert "other settings for: dropout, lr_factor; this run trains anew" in out
    assert second_folder != folder and (folder / "last.pt").is_file()
    assert not same_weights(first, second)


def test_a_missing_checkpoint_is_reported_as_missing(tmp_path):
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(tmp_path / "last.pt")
    assert "is missing" in str(error.value) and "damaged" not in str(error.value)


@pytest.mark.slow
def test_the_record_pairs_the_runs_own_settings_with_its_history(quick_data, tmp_path):
    model, history, folder = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    loaded, loaded_history, _ = train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    for m, h in ((model, history), (loaded, loaded_history)):
        record = trainer.run_record(m, h, SETTINGS, folder, {"test_bleu": 1.0}, CPU)
        assert record["settings"] == dataclasses.asdict(SETTINGS)
        assert record["history"] == read_checkpoint(folder / "last.pt")["history"]
        assert len(record["history"]) == SETTINGS.epochs and record["test_bleu"] == 1.0
        assert record["run_folder"] == str(folder) and h[-1]["step"] > 0
        assert record["train_seconds"] == sum(epoch["seconds"] for epoch in h) > 0
        assert record["parameters"] == at.count_parameters(m)


@pytest.mark.slow
def test_an_epoch_on_a_cpu_reports_no_gpu(quick_data, tmp_path, capsys):
    train_as_the_notebook(SETTINGS, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert "epoch 0: train loss" in out  # the epoch's line is there
    assert "no NVIDIA GPU here" not in out and "memory used / total" not in out


def test_an_edit_that_ddp_workers_cannot_see_is_named(monkeypatch):
    """DDP's workers import the .py twin: Appendix C's cell names the notebook's edits they
    will not train with, instead of looking for their run in the wrong folder."""
    from tools.train_ddp import not_in_twin

    assert not_in_twin(lesson_copy(monkeypatch)) == []
    namespace = edited(monkeypatch, "    d_k = query.size(-1)\n", "    d_k = 2 * query.size(-1)\n")
    assert not_in_twin(namespace) == ["attention"]


# --- the same key on every supported Python -----------------------------------------------

SAME_ON_EVERY_PYTHON = """
import ast, hashlib, json, sys
source = open(sys.argv[1], encoding="utf-8").read()
exec(compile(source, "canonical", "exec"))  # canonical(), as plumbing.py defines it
out = {}
for name in sys.argv[2:]:
    text = open(name, encoding="utf-8").read()
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            tree = ast.parse("".join(lines[first - 1 : node.end_lineno]))
            key = hashlib.sha256(canonical(tree).encode()).hexdigest()[:12]
            out[name.rsplit("/", 1)[-1] + ":" + node.name] = key
print(json.dumps(out))
"""


def other_pythons() -> list[str]:
    """Interpreters of Python 3.12 and 3.13 on this machine (pyenv's, or on the PATH)."""
    import glob
    import shutil

    found = [shutil.which(f"python3.{minor}") for minor in (12, 13)]
    found += glob.glob(str(Path.home() / ".pyenv/versions/3.1[23]*/bin/python3.1[23]"))
    working = []
    for python in filter(None, found):
        done = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode == 0 and done.stdout not in {w[1] for w in working}:
            working.append((python, done.stdout))
    return [python for python, _ in working]


@pytest.mark.slow
def test_the_code_reads_the_same_on_python_3_11_3_12_and_3_13(tmp_path):
    """ast.dump writes differently on each; `canonical` must not, or one checkout would
    name different folders on different Pythons. Every definition of the lesson, the
    trainer and plumbing, read by this Python and by each other one installed here."""
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no Python 3.12 or 3.13 here to compare with")
    tree = ast.parse((ROOT / "plumbing.py").read_text(encoding="utf-8"))
    (node,) = [n for n in tree.body if getattr(n, "name", "") == "canonical"]
    (prose,) = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PROSE"
    ]
    code = "\n\n".join(ast.unparse(n) for n in (prose, node))
    (tmp_path / "canonical.py").write_text("import ast\nimport re\n\n" + code)
    files = [str(ROOT / f) for f in ("annotated_transformer.py", "trainer.py", "plumbing.py")]
    script = [SAME_ON_EVERY_PYTHON, str(tmp_path / "canonical.py"), *files]
    runs = {}
    for python in [sys.executable, *pythons]:
        done = subprocess.run([python, "-c", *script], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        runs[python] = json.loads(done.stdout)
    mine = runs.pop(sys.executable)
    assert len(mine) > 100
    for python, theirs in runs.items():
        assert theirs == mine, f"{python} reads {sorted(k for k in mine if theirs[k] != mine[k])}"


def test_a_checkpoint_of_another_model_stops_in_one_line_and_stays(quick_data, tmp_path):
    """A last.pt of a wider model, copied by hand into this run's folder, stops with one
    line naming the file, what differs and what to do, before any weights load; the file
    stays."""
    wider = dataclasses.replace(SETTINGS, d_model=2 * SETTINGS.d_model)
    theirs = plumbing.run_folder(wider, quick_data, vars(at), tmp_path / "wider")
    folder = plumbing.run_folder(SETTINGS, quick_data, vars(at), tmp_path)
    kept = {"optimizer": {}, "schedule": {}, "history": [{"epoch": 0}], "processes": 1}
    weights = at.model_for(wider, quick_data.vocabs).state_dict()
    plumbing.save_checkpoint(folder / "last.pt", model=weights,
                             made_of=trainer.manifest_of(theirs), **kept)  # fmt: skip
    before = (folder / "last.pt").read_bytes()
    with pytest.raises(CheckpointError) as error:
        trainer.load_last(folder, {"model": at.model_for(SETTINGS, quick_data.vocabs)}, 1)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{folder / 'last.pt'} was trained with")
    assert "d_model" in message and "retrain=True" in message
    assert (folder / "last.pt").read_bytes() == before


def test_the_chinese_notebooks_code_names_the_english_runs_folder(
    quick_data, tmp_path, monkeypatch
):
    """Its strings and comments are translated (tools/translations.py): harmless edits, so a
    run of either edition loads the other's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import polib
    import translations as tr

    chinese = {(None, e.msgid): e.msgstr for e in polib.pofile(str(tr.CATALOGUE))}
    translated = tr.translate_code(SOURCE, {k: v for k, v in chinese.items() if v}, None)
    assert sum(not line.isascii() for line in translated.splitlines()) > 300 + sum(
        not line.isascii() for line in SOURCE.splitlines()
    )
    english = plumbing.run_folder(SETTINGS, quick_data, lesson_copy(monkeypatch), tmp_path)
    namespace = lesson_copy(monkeypatch, translated)
    assert plumbing.run_folder(SETTINGS, quick_data, namespace, tmp_path) == english

"""Sub-words (§5.1), three-way weight tying (§3.4) and the run planned to the clock."""

import dataclasses
import io
import json
import math
import time
from collections import Counter

import pytest
import subword_nmt.learn_bpe
import torch
from conftest import MIRROR, prepared_data

import annotated_transformer as at

# the smoke preset shrunk, with a joint sub-word vocabulary of 300 merges
SMALL = dataclasses.replace(
    at.SMOKE,
    name="small-bpe",
    d_model=16,
    d_ff=32,
    train_pairs=200,
    eval_pairs=20,
    batch_tokens=400,
    warmup=4,
    average_last=1,
    bpe_merges=300,
)


@pytest.fixture
def data(tmp_path, monkeypatch):
    return prepared_data(SMALL, tmp_path, monkeypatch)


def training_word_counts(pairs: int) -> dict[str, int]:
    """Word counts of the first training pairs, both languages, as learned_merges counts."""
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    text = at.load_pairs("train", MIRROR)[:pairs]
    tokens = at.tokenize_pairs(text, at.make_tokenizers())
    counts = Counter(t for lang in ("de", "en") for s in tokens[lang] for t in s)
    return {t: c for t, c in sorted(counts.items()) if t.strip() and " " not in t}


# --- BPE: the lesson's plain loop against subword-nmt --------------------------------------


def test_the_lessons_merges_are_subword_nmts_merges_on_real_words():
    counts = training_word_counts(300)
    ours = at.learn_merges(counts, 400)
    lines = io.StringIO("".join(f"{w} {c}\n" for w, c in counts.items()))
    learned = io.StringIO()
    subword_nmt.learn_bpe.learn_bpe(lines, learned, 400, is_dict=True)
    theirs = [tuple(line.split()) for line in learned.getvalue().splitlines()[1:]]
    assert len(ours) == 400 and ours == theirs


def test_the_lessons_split_is_subword_nmts_split():
    counts = training_word_counts(300)
    merges = at.learn_merges(counts, 400)
    splitter = at.bpe_splitter(merges)
    words = [*counts, "Quantencomputer", "Hundehütte", "x"]
    assert [at.split_word(w, merges) for w in words] == [
        splitter.segment_tokens([w]) for w in words
    ]


def test_pieces_join_back_into_the_words():
    merges = at.learn_merges({"spielen": 6, "spielt": 4, "laufen": 5, "läuft": 3}, 8)
    vocab = at.SubwordVocab([*at.SPECIALS, "spiel@@", "t@@", "e"], merges)
    words = ["Kinder", "spielten", ",", "spielen", "."]
    pieces = vocab.pieces([*words[:2], " ", *words[2:]])  # spaCy's whitespace tokens go
    assert pieces != words and "spiel@@" in pieces
    assert vocab.words(pieces) == words
    assert vocab.words(["spiel@@"]) == ["spiel"]  # a piece cut off at the end still reads
    word_vocab = at.Vocab([*at.SPECIALS, "a"])
    assert word_vocab.pieces(words) is words and word_vocab.words(words) is words


def test_a_sub_word_vocabulary_is_joint_saved_with_its_merges_and_knows_new_words(data, tmp_path):
    de, en = data.vocabs["de"], data.vocabs["en"]
    assert de is en and de.merges and len(de.merges) <= SMALL.bpe_merges
    assert at.unknown_words("Eine Frau liest über Hundeschlitten.", data.vocabs) == []
    path = tmp_path / "vocab.json"
    at.save_vocab(de, path)
    again = at.load_vocab(path)
    assert again.itos == de.itos and again.merges == de.merges
    assert again.fingerprint() == de.fingerprint()
    old = tmp_path / "old.json"  # a word vocabulary saved before sub-words: a plain list
    old.write_text(json.dumps(de.itos), encoding="utf-8")
    assert at.load_vocab(old).merges is None
    src, tgt = data.train[0]
    words = data.vocabs["en"].words(data.vocabs["en"].decode(tgt[1:-1]))
    assert " ".join(words) == " ".join(t for t in at.english_tokens([data.train_text[0][1]])[0])


def test_translate_returns_words_or_pieces(data):
    at.set_seed(0)
    model = at.model_for(SMALL, data.vocabs).eval()
    sources = [src for src, _ in data.val[:3]]
    pieces = at.translate(model, sources, data.vocabs, pieces=True)
    words = at.translate(model, sources, data.vocabs)
    assert words == [data.vocabs["en"].words(p) for p in pieces]
    assert all(not w.endswith(at.SEPARATOR) for sentence in words for w in sentence)
    assert at.readable("Quant@@") == "Quant-" and at.readable("computer") == "computer"


# --- three-way tying (§3.4) ----------------------------------------------------------------


def test_a_joint_vocabulary_ties_both_embeddings_and_the_output_as_one_tensor(data):
    model = at.model_for(SMALL, data.vocabs)
    shared = model.tgt_embed[0].embedding.weight
    assert model.src_embed[0].embedding.weight is shared
    assert model.generator.proj.weight is shared
    tokens = torch.tensor([[5, 6, 7]])
    expected = shared[tokens] * math.sqrt(SMALL.d_model)  # the paper's sqrt(d_model) holds
    assert torch.equal(model.src_embed[0](tokens), expected)
    assert torch.equal(model.tgt_embed[0](tokens), expected)
    config = at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, tie_output=False)
    untied = at.make_model(50, 50, config)
    tied = at.make_model(
        50, 50, dataclasses.replace(config, tie_output=True, share_embeddings=True)
    )
    assert untied.src_embed[0].embedding.weight is not untied.tgt_embed[0].embedding.weight
    # three 50 x 16 matrices became one, counted once
    assert at.count_parameters(untied) - at.count_parameters(tied) == 2 * 50 * 16


def test_sharing_embeddings_needs_one_vocabulary():
    with pytest.raises(ValueError, match="one vocabulary"):
        at.make_model(50, 60, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, share_embeddings=True))


# --- the run planned to the clock ----------------------------------------------------------


def make_plan(settings, data, data_dir):
    """plan_run on the CPU with the run's own validation batches."""
    cpu = torch.device("cpu")
    val_batches = at.validation_batches(data, settings, cpu)
    criterion = at.training_loss(settings, data.vocabs)
    return at.plan_run(settings, data, data_dir, cpu, val_batches, criterion)


def fake_speed(tokens_per_second: float, validation_seconds: float):
    """measure_speed as a fake clock would report it; the real one times real batches."""

    def measure(*args, **kwargs):
        return {"tokens_per_second": tokens_per_second, "validation_seconds": validation_seconds}

    return measure


def test_measure_speed_times_real_training_steps_and_a_validation_pass(data):
    cpu = torch.device("cpu")
    model = at.model_for(SMALL, data.vocabs)
    before = [p.detach().clone() for p in model.parameters()]
    val_batches = at.validation_batches(data, SMALL, cpu)
    criterion = at.training_loss(SMALL, data.vocabs)
    speed = at.measure_speed(model, SMALL, data, cpu, val_batches, criterion, "fp32", steps=2)
    assert speed["tokens_per_second"] > 0 and speed["validation_seconds"] > 0
    # it trained the throwaway model it was given: the weights moved
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_plan_fits_the_epochs_to_the_minutes(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(at, "measure_speed", fake_speed(100.0, 2.0))
    settings = dataclasses.replace(SMALL, train_minutes=1.0, average_last=2, precision="fp32")
    epoch_tokens = sum(len(tgt) - 1 for _, tgt in data.train)
    epoch_seconds = epoch_tokens / 100.0 + 2.0
    plan = make_plan(settings, data, tmp_path)
    assert plan["epochs"] == max(1, int((60.0 - 2.0) // epoch_seconds))
    assert plan["epochs"] * epoch_seconds + 2.0 <= 60.0 or plan["epochs"] == 1
    fitted = dataclasses.replace(settings, epochs=plan["epochs"])
    assert plan["steps"] == at.planned_steps(fitted, data.train)
    assert "ending about" in capsys.readouterr().out
    saved = json.loads((at.checkpoint_dir(settings, tmp_path) / "plan.json").read_text())
    assert saved == plan


def test_a_faster_machine_plans_more_epochs(data, tmp_path, monkeypatch):
    settings = dataclasses.replace(SMALL, train_minutes=2.0, precision="fp32")
    epochs = []
    for speed in (50.0, 100.0, 400.0):
        monkeypatch.setattr(at, "measure_speed", fake_speed(speed, 1.0))
        epochs.append(make_plan(settings, data, tmp_path)["epochs"])
    assert epochs == sorted(epochs) and epochs[0] < epochs[-1]


def test_a_machine_too_slow_for_the_budget_is_told_so_in_one_line(
    data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(at, "measure_speed", fake_speed(1.0, 1.0))
    settings = dataclasses.replace(SMALL, train_minutes=1.0, precision="fp32")
    plan = make_plan(settings, data, tmp_path)
    assert plan["epochs"] == 1
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warning) == 1 and "1 epoch(s) fit in 1 minutes" in warning[0]


def test_the_records_say_what_a_short_run_reached(tmp_path):
    record = {"kind": "make run", "val_bleu_history": [1.1, 7.2, 15.8, 23.7, 27.6, 31.7]}
    (tmp_path / "make-run-cpu-somewhere.json").write_text(json.dumps(record))
    settings = dataclasses.replace(at.get_settings("cpu"), train_minutes=20.0)
    line = at.too_slow(settings, 2, tmp_path)
    assert "make-run-cpu-somewhere.json had validation BLEU 7 after 2, 32 after 6" in line
    assert "\n" not in line and "raise train_minutes" in line
    assert "validation BLEU" not in at.too_slow(settings, 2, tmp_path / "no-records")

    # a record trained with the preset's layer norm comes first, whatever its name
    same = {**record, "settings": {"pre_norm": settings.pre_norm}, "val_bleu_history": [9, 19]}
    (tmp_path / "make-run-cpu-zz-same-norm.json").write_text(json.dumps(same))
    assert "zz-same-norm.json had validation BLEU 9 after 1, 19 after 2" in at.too_slow(
        settings, 1, tmp_path
    )
    # then a record of the preset's own model size
    size = {k: getattr(settings, k) for k in ("pre_norm", "N", "d_model", "d_ff", "h")}
    own = {**record, "settings": size, "val_bleu_history": [12, 25, 30]}
    (tmp_path / "make-run-cpu-zzz-same-size.json").write_text(json.dumps(own))
    assert "zzz-same-size.json had validation BLEU 12 after 1, 30 after 3" in at.too_slow(
        settings, 1, tmp_path
    )


def test_a_fixed_run_measures_nothing(data, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a run of fixed epochs must not measure")

    monkeypatch.setattr(at, "measure_speed", refuse)
    plan = make_plan(SMALL, data, tmp_path)
    assert plan == {"epochs": SMALL.epochs, "steps": at.planned_steps(SMALL, data.train)}


def test_a_planned_run_ends_its_schedule_at_zero_and_a_resumed_run_keeps_its_plan(
    data, tmp_path, monkeypatch
):
    monkeypatch.setattr(at, "measure_speed", fake_speed(10000.0, 0.5))
    settings = dataclasses.replace(SMALL, train_minutes=0.1, precision="fp32", checkpoint_steps=0)
    model, history = at.train_model(settings, data, tmp_path, show=False)
    plan = history[-1]["plan"]
    assert len(history) == plan["epochs"] > 1
    last = at.read_checkpoint(at.checkpoint_path(settings, tmp_path, "last"))
    assert last["state"]["step"] == plan["steps"]
    assert last["schedule"]["_last_lr"] == [0.0]  # the rate reached zero at the planned end

    # another machine, ten times faster, resumes: the plan stays the one it started with
    monkeypatch.setattr(at, "measure_speed", fake_speed(100000.0, 0.05))
    again = make_plan(settings, data, tmp_path)
    assert again == plan  # with the warm-up it fitted to its steps


# --- re-planning after each epoch ------------------------------------------------------


def schedule_at(settings, pairs, plan: dict, epochs_done: int):
    """A planned run's schedule, stepped to the end of its first `epochs_done` epochs."""
    model = at.make_model(8, 8, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2))
    optimizer, schedule = at.make_optimizer(model, settings, total_steps=plan["steps"])
    for _ in range(at.planned_steps(dataclasses.replace(settings, epochs=epochs_done), pairs)):
        optimizer.step()  # no gradients: a no-op that keeps LambdaLR from warning
        schedule.step()
    return schedule


@pytest.mark.parametrize(
    ("epoch_seconds", "epochs"),
    [
        (15.0, 4),  # 30 s spent, 30 left: two more epochs
        (10.0, 6),  # as planned: the plan and the schedule stay
        (5.0, 12),  # faster than the probe said: 50 s left, ten more
        (25.0, 3),  # 10 s left: one more, so the rate still reaches zero
        (45.0, 3),  # already over the budget: one more all the same
    ],
)
def test_a_replan_fits_the_epochs_left_to_the_minutes_left(data, epoch_seconds, epochs):
    settings = dataclasses.replace(SMALL, train_minutes=1.0, warmup=2, schedule="linear")
    six = at.planned_steps(dataclasses.replace(settings, epochs=6), data.train)
    plan = {"epochs": 6, "steps": six, "warmup": 2, "validation_seconds": 1.0}
    schedule = schedule_at(settings, data.train, plan, 2)
    step, before = schedule.last_epoch, schedule.lr_lambdas[0]
    rate = before(step)
    history = [{"seconds": epoch_seconds - 1.0, "validation_seconds": 1.0}] * 2  # a fake clock
    new = at.replan(plan, settings, history, schedule, data.train)
    assert new["epochs"] == epochs
    if epochs == plan["epochs"]:
        assert new is plan and schedule.lr_lambdas[0] is before
        return
    steps = at.planned_steps(dataclasses.replace(settings, epochs=epochs), data.train)
    assert new["steps"] == steps and new["replans"][-1]["after_epoch"] == 1
    assert new["decay"] == {"from_step": step, "from_rate": rate, "to_step": steps}
    # the rate goes on from where it was, in a straight line to zero at the new end
    after = schedule.lr_lambdas[0]
    assert after(step) == rate and after(steps) == 0.0 and after(steps + 5) == 0.0
    middle = (step + steps) / 2
    assert math.isclose(after(middle), rate / 2)


def test_a_run_still_warming_up_or_at_its_end_keeps_its_plan(data):
    settings = dataclasses.replace(SMALL, train_minutes=1.0, warmup=2, schedule="linear")
    steps = at.planned_steps(dataclasses.replace(settings, epochs=3), data.train)
    history = [{"seconds": 50.0, "validation_seconds": 1.0}]
    warming = {"epochs": 3, "steps": steps, "warmup": steps, "validation_seconds": 1.0}
    schedule = schedule_at(settings, data.train, warming, 1)
    assert at.replan(warming, settings, history, schedule, data.train) is warming
    ending = warming | {"warmup": 2}
    schedule = schedule_at(settings, data.train, ending, 3)
    assert at.replan(ending, settings, history * 3, schedule, data.train) is ending


class SlowClock:
    """The `time` module with a clock a thousand times slow: every epoch overruns."""

    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self):
        return 1000 * time.perf_counter()


def test_a_run_that_overruns_shrinks_its_plan_and_a_resumed_run_keeps_it(
    data, tmp_path, monkeypatch
):
    monkeypatch.setattr(at, "measure_speed", fake_speed(1000.0, 0.5))  # plans many epochs
    monkeypatch.setattr(at, "time", SlowClock())
    settings = dataclasses.replace(SMALL, train_minutes=1.0, precision="fp32", checkpoint_steps=1)
    model, history = at.train_model(settings, data, tmp_path / "straight", show=False)
    plan = history[-1]["plan"]
    epoch_tokens = sum(len(tgt) - 1 for _, tgt in data.train)
    assert plan["made"] and int(60 // (epoch_tokens / 1000.0 + 0.5)) > plan["epochs"]
    # after the first epoch past the warm-up, the plan shrank to one more epoch
    (change,) = plan["replans"]
    assert plan["epochs"] == change["epochs"] == change["after_epoch"] + 2 == len(history)
    last = at.read_checkpoint(at.checkpoint_path(settings, tmp_path / "straight", "last"))
    assert last["state"]["step"] == plan["steps"] == plan["decay"]["to_step"]
    assert last["schedule"]["_last_lr"] == [0.0]  # the re-aimed decay reached zero
    saved = at.checkpoint_dir(settings, tmp_path / "straight") / "plan.json"
    assert json.loads(saved.read_text()) == plan

    # killed in the middle of its last epoch, after the re-plan, and resumed
    class Killed(Exception):
        pass

    save, kill_at = at.Run.save, plan["steps"] - 1

    def save_then_die(run, position):
        save(run, position)
        if run.state.step == kill_at:
            raise Killed

    monkeypatch.setattr(at.Run, "save", save_then_die)
    with pytest.raises(Killed):
        at.train_model(settings, data, tmp_path / "killed", show=False)
    monkeypatch.setattr(at.Run, "save", save)
    resumed, again = at.train_model(settings, data, tmp_path / "killed", show=False)
    kept = again[-1]["plan"]  # the plan and decay of the run it resumed
    assert [kept[k] for k in ("epochs", "steps", "decay")] == [
        plan[k] for k in ("epochs", "steps", "decay")
    ]
    assert [h["train_loss"] for h in again] == [h["train_loss"] for h in history]
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name

"""Regression tests for the defects found by the cross-machine review (issue 11, item 4)."""

import gzip

import numpy as np
import pytest
import torch
from torch import nn

import annotated_transformer as at
import plumbing
import trainer
from plumbing import CheckpointError


def test_numpy_random_state_round_trips_mid_stream():
    """The whole MT19937 state comes back, including the position inside the key
    block and the cached Gaussian, not a fixed position of 624."""
    np.random.seed(3)
    np.random.random(5)  # moves the position inside the 624-word block
    np.random.standard_normal()  # leaves a second Gaussian cached (has_gauss = 1)
    assert np.random.get_state()[2] != 624 and np.random.get_state()[3] == 1
    states = plumbing.random_states()
    expected = (np.random.random(7), np.random.standard_normal(3))
    np.random.seed(99)  # something else entirely
    plumbing.restore_random_states(states)
    again = (np.random.random(7), np.random.standard_normal(3))
    assert np.array_equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])


def test_random_states_survive_a_weights_only_checkpoint(tmp_path):
    np.random.seed(5)
    np.random.random(10)
    plumbing.save_checkpoint(tmp_path / "r.pt", random=plumbing.random_states())
    expected = np.random.random(4)
    loaded = torch.load(tmp_path / "r.pt", weights_only=True)["random"]
    plumbing.restore_random_states(loaded)
    assert np.array_equal(np.random.random(4), expected)


def tokens_of(n, last_de="Hund", last_en="dog"):
    de = [["ein", "Hund"] for _ in range(n)]
    en = [["a", "dog"] for _ in range(n)]
    de[-1], en[-1] = ["ein", last_de], ["a", last_en]
    return {"de": de, "en": en}


@pytest.mark.parametrize("changed", ["de", "en"])
def test_vocabulary_cache_key_covers_every_sentence_of_both_languages(tmp_path, changed):
    """A change at sentence 60 (past the old 50-sentence key), in either language, makes
    a new vocabulary instead of reusing the cached one."""
    first = at.vocabularies(tokens_of(60), min_freq=1, data_dir=tmp_path)
    other = tokens_of(60, **({"last_de": "Katze"} if changed == "de" else {"last_en": "cat"}))
    second = at.vocabularies(other, min_freq=1, data_dir=tmp_path)
    word = "Katze" if changed == "de" else "cat"
    assert word not in first[changed].stoi and word in second[changed].stoi
    assert len(list(tmp_path.glob(f"vocab-{changed}-*.json"))) == 2


def test_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.de.gz"
    path.write_bytes(gzip.compress("\ufeffEin Hund\nZwei Katzen\n".encode()))
    assert plumbing.read_lines(path) == ["Ein Hund", "Zwei Katzen"]


def test_a_file_in_the_way_of_the_data_folder_is_one_clear_line(tmp_path):
    blocker = tmp_path / "data"
    blocker.write_text("I am a file, not a folder")
    with pytest.raises(at.DataError, match="is a file; move it away") as error:
        at.write_atomically(blocker / "tokens" / "train.json.gz", b"{}")
    assert "\n" not in str(error.value) and str(blocker) in str(error.value)
    assert blocker.read_text() == "I am a file, not a folder"  # nothing lost
    with pytest.raises(at.DataError, match="is a file"):  # the folder itself is the file
        at.write_atomically(blocker / "vocab.json", b"[]")


def tiny_data():
    """One test pair whose reference holds a word ("zebra") outside the vocabulary."""
    vocabs = {
        "de": at.Vocab([*at.SPECIALS, "ein", "Zebra", "läuft", "."]),
        "en": at.Vocab([*at.SPECIALS, "A", "runs", "."]),
    }
    de_ids = vocabs["de"].encode(["ein", "Zebra", "läuft", "."])
    en_ids = vocabs["en"].encode(["A", "zebra", "runs", "."])
    pair = ([0, *de_ids, 1], [0, *en_ids, 1])
    text = [("Ein Zebra läuft.", "A zebra runs.")]
    return at.Multi30k(vocabs, [pair], [pair], [pair], text, text, text)


def test_tokenized_bleu_does_not_match_unk_against_a_rare_reference_word(monkeypatch):
    """A model that writes <unk> where the reference has a rare word must not score 100."""
    data = tiny_data()
    unk_output = [data.vocabs["en"].decode(data.test[0][1][1:-1])]  # A <unk> runs .
    assert unk_output == [["A", "<unk>", "runs", "."]]
    monkeypatch.setattr(at, "translate", lambda *args, **kwargs: unk_output)
    settings = at.Settings(name="t", beam_size=2)
    results = at.evaluate_test(nn.Linear(1, 1), data, settings)
    assert results["test2016_bleu_greedy_lowercase_tokenized"] < 60
    assert at.english_tokens(["A zebra runs."]) == [["A", "zebra", "runs", "."]]


def test_heatmap_translation_leaves_the_model_where_it_is(monkeypatch):
    """translate_with_attention never moves the model (the old cell called model.cpu(),
    which silently took a trained model off the GPU for every later cell)."""
    data = tiny_data()
    at.set_seed(0)
    settings = at.Settings(name="t", N=1, d_model=16, d_ff=32, h=2)
    model = at.model_for(settings, data.vocabs)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was moved")

    monkeypatch.setattr(nn.Module, "cpu", refuse)
    monkeypatch.setattr(nn.Module, "to", refuse)
    src_tokens, tgt_tokens, maps = at.translate_with_attention(model, data.val[0][0], data.vocabs)
    assert src_tokens[0] == at.BOS and tgt_tokens[0] == at.BOS
    cross = maps["encoder-decoder attention"][0]
    assert cross.device.type == "cpu" and cross.shape == (2, len(tgt_tokens) - 1, len(src_tokens))
    assert torch.allclose(cross.sum(-1), torch.ones(2, len(tgt_tokens) - 1))


def test_resuming_with_another_number_of_processes_is_refused(tmp_path):
    """A last.pt holds one position and one set of random states per process: a run on
    another number of processes would resume from the wrong ones, so it stops in one line."""
    data, cpu = tiny_data(), torch.device("cpu")
    settings = at.Settings(name="t", N=1, d_model=16, d_ff=32, h=2)
    lesson = trainer.Lesson.of(at)

    def run_on(world_size: int) -> trainer.Run:
        run = trainer.new_run(lesson, settings, data, tmp_path, cpu, world_size=world_size)
        run.plan = {"epochs": settings.epochs, "steps": 10, "precision": "fp32"}
        return run

    run = run_on(1)
    trainer.start_or_resume(run, None)
    run.save(trainer.Position(epoch=1))
    assert run.path("last").is_file()
    with pytest.raises(CheckpointError, match=r"on 1 process\(es\), not 2: resume with as many"):
        trainer.read_last(run_on(2))
    checkpoint = trainer.read_last(run_on(1))  # the same count resumes
    assert trainer.start_or_resume(run_on(1), checkpoint) == trainer.Position(epoch=1)

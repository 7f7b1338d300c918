"""Checkpoints, exact resume, and decoding with beam search."""

import dataclasses

import pytest
import torch
from conftest import MIRROR, ROOT

import annotated_transformer as at

TINY = at.Settings(
    name="tiny",
    N=1,
    d_model=16,
    d_ff=32,
    h=2,
    train_pairs=200,
    eval_pairs=20,
    batch_tokens=400,
    accum_iter=2,
    epochs=2,
    warmup=10,
    beam_size=3,
)


@pytest.fixture
def data(tmp_path, monkeypatch):
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    monkeypatch.setenv("MULTI30K_DIR", str(MIRROR))
    return at.prepare_data(TINY, tmp_path)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_two_epochs_equal_one_epoch_plus_resume(data, tmp_path, capsys):
    cpu = torch.device("cpu")
    straight, _ = at.train_model(TINY, data, tmp_path / "a", device=cpu, show=False)
    one = dataclasses.replace(TINY, epochs=1)
    at.train_model(one, data, tmp_path / "b", device=cpu, show=False)
    resumed, history = at.train_model(TINY, data, tmp_path / "b", device=cpu, show=False)
    assert "resuming from" in capsys.readouterr().out
    assert [h["epoch"] for h in history] == [0, 1]
    a, b = parameters(straight), parameters(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_round_trip_and_refusals(data, tmp_path):
    model = at.model_for(TINY, data.vocabs)
    path = tmp_path / "c.pt"
    at.save_checkpoint(
        path,
        model=model.state_dict(),
        model_size=at.model_size(TINY),
        vocab_fingerprint=at.vocab_fingerprint(data.vocabs),
    )
    loaded = at.load_checkpoint(path, TINY, data.vocabs)
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())

    other_vocabs = {**data.vocabs, "en": at.Vocab([*at.SPECIALS, "zebra"])}
    with pytest.raises(at.CheckpointError, match="other vocabularies: delete it"):
        at.load_checkpoint(path, TINY, other_vocabs)
    with pytest.raises(at.CheckpointError, match="holds a model of size"):
        at.load_checkpoint(path, dataclasses.replace(TINY, d_model=32), data.vocabs)

    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(at.CheckpointError, match="damaged or truncated"):
        at.load_checkpoint(path, TINY, data.vocabs)


def test_final_checkpoint_is_loaded_not_retrained(data, tmp_path, capsys):
    cpu = torch.device("cpu")
    trained, _ = at.load_trained_model(TINY, data, tmp_path, device=cpu, show=False)
    again, _ = at.load_trained_model(TINY, data, tmp_path, device=cpu, show=False)
    assert "loaded" in capsys.readouterr().out
    a, b = parameters(trained), parameters(again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_beam_of_one_equals_greedy(data):
    at.set_seed(3)
    model = at.model_for(TINY, data.vocabs).eval()
    en = data.vocabs["en"]
    src = at.collate(data.val, list(range(10)), en.pad_id)
    ids = {"start": en.bos_id, "end": en.eos_id, "pad": en.pad_id}
    greedy = at.greedy_decode(
        model, src.src, src.src_mask, 20, start_id=en.bos_id, end_id=en.eos_id, pad_id=en.pad_id
    )
    beam = at.beam_search(model, src.src, src.src_mask, 20, beam_size=1, alpha=0.6, ids=ids)
    assert torch.equal(greedy, beam)


def test_same_seed_gives_the_same_loss_curve_to_the_last_bit(data, tmp_path):
    cpu = torch.device("cpu")
    _, first = at.train_model(TINY, data, tmp_path / "a", device=cpu, show=False)
    _, second = at.train_model(TINY, data, tmp_path / "b", device=cpu, show=False)
    curve = [(h["train_loss"], h["val_loss"]) for h in first]
    assert curve == [(h["train_loss"], h["val_loss"]) for h in second]


def test_every_torch_load_is_weights_only():
    source = (ROOT / "annotated_transformer.py").read_text()
    calls = [line for line in source.splitlines() if "torch.load(" in line]
    assert calls and all("weights_only=True" in line for line in calls)
    assert "import pickle" not in source

"""Checkpoints, exact resume, and decoding with beam search."""

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MIRROR, ROOT, prepared_data

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
    return prepared_data(TINY, tmp_path, monkeypatch)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def test_two_epochs_equal_one_epoch_plus_resume(data, tmp_path, capsys):
    cpu = torch.device("cpu")
    straight, straight_history = at.train_model(TINY, data, tmp_path / "a", device=cpu, show=False)
    one = dataclasses.replace(TINY, epochs=1)
    at.train_model(one, data, tmp_path / "b", device=cpu, show=False)
    resumed, history = at.train_model(TINY, data, tmp_path / "b", device=cpu, show=False)
    assert "resuming from" in capsys.readouterr().out
    assert [h["epoch"] for h in history] == [0, 1]
    a, b = parameters(straight), parameters(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # "Watch it learn": every epoch keeps its translations of the watched sentences,
    # the first epoch's through the resume too
    watched = [h["watched"] for h in history]
    assert [len(w) for w in watched] == [len(at.WATCHED_SENTENCES)] * 2
    assert all(isinstance(t, str) for w in watched for t in w)
    assert watched == [h["watched"] for h in straight_history]


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


def assert_equal_or_tied(ours, theirs, model, src, src_mask, tol=1e-4) -> None:
    """Two greedy-like decodes of `src` are equal, or each sentence where they part had a
    near tie at the first word they disagree on.

    Two decoders whose log-probabilities differ by rounding pick the same word unless the
    best two are within that rounding of each other; which one wins then depends on the
    CPU's kernels. A wrong decoder parts at a word that loses by far more than `tol`.
    """
    width = max(ours.size(1), theirs.size(1))
    pad = torch.nn.functional.pad
    ours, theirs = (pad(ys, (0, width - ys.size(1)), value=-1) for ys in (ours, theirs))
    memory = model.encode(src, src_mask)
    for row in (ours != theirs).any(dim=1).nonzero().flatten().tolist():
        t = int((ours[row] != theirs[row]).nonzero()[0])  # the first word they disagree on
        full = at.FullPrefix(model, memory[row : row + 1], src_mask[row : row + 1])
        log_probs = full(ours[row : row + 1, :t])[0]  # (V,) after their common prefix
        words = ours[row, t], theirs[row, t]
        assert min(words) >= 0, f"sentence {row}: one decode stopped, the other did not"
        gap = (log_probs[words[0]] - log_probs[words[1]]).abs().item()
        assert gap < tol, f"sentence {row}, word {t}: no tie, the log-probs are {gap:.1e} apart"


@pytest.mark.numerics
def test_beam_of_one_equals_greedy(data):
    at.set_seed(3)
    model = at.model_for(TINY, data.vocabs).eval()
    en = data.vocabs["en"]
    src = at.collate(data.val, list(range(10)), en.pad_id)
    ids = en.special_ids()
    greedy = at.greedy_decode(model, src.src, src.src_mask, 20, ids=ids)
    beam = at.beam_search(model, src.src, src.src_mask, 20, beam_size=1, alpha=0.6, ids=ids)
    assert greedy.size(1) > 5, "the sentences are several words long"
    with torch.no_grad():
        assert_equal_or_tied(beam, greedy, model, src.src, src.src_mask)


def test_same_seed_gives_the_same_loss_curve_to_the_last_bit(data, tmp_path):
    cpu = torch.device("cpu")
    _, first = at.train_model(TINY, data, tmp_path / "a", device=cpu, show=False)
    _, second = at.train_model(TINY, data, tmp_path / "b", device=cpu, show=False)
    curve = [(h["train_loss"], h["val_loss"]) for h in first]
    assert curve == [(h["train_loss"], h["val_loss"]) for h in second]


def test_every_torch_load_is_weights_only():
    """In the notebook's twin, the tools and the tests: nothing is ever unpickled."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("tests/*.py")]
    calls = []
    for path in set(files) - {Path(__file__).resolve()}:  # this file names what it looks for
        source = path.read_text()
        calls += [line for line in source.splitlines() if "torch.load(" in line]
        assert "import pickle" not in source and "pickle.load" not in source, path
    assert len(calls) >= 4 and all("weights_only=True" in line for line in calls), calls


@pytest.fixture(scope="module")
def decoding(tmp_path_factory):
    """A briefly trained small model (its weights vary a little between CPUs; no test
    relies on how well it learned)."""
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    folder = tmp_path_factory.mktemp("decoding")
    settings = dataclasses.replace(
        TINY, d_model=32, d_ff=64, train_pairs=1000, batch_tokens=800, accum_iter=1, epochs=3
    )
    settings = dataclasses.replace(settings, warmup=30, lr_factor=2.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTI30K_DIR", str(MIRROR))
        data = at.prepare_data(settings, folder)
    model, _ = at.train_model(settings, data, folder, device=torch.device("cpu"), show=False)
    return model.eval(), data


def variants(model, data, **options):
    """The trained weights in a model built with other options (pre-norm excepted)."""
    settings = dataclasses.replace(TINY, d_model=32, d_ff=64, **options)
    other = at.model_for(settings, data.vocabs).eval()
    other.load_state_dict(model.state_dict())
    return other


def assert_cached_equals_full(model, data):
    """Step by step over real targets, the cached log-probs equal the full recompute's."""
    src = at.collate(data.val, list(range(12)), data.vocabs["en"].pad_id)
    with torch.no_grad():
        memory = model.encode(src.src, src.src_mask)
        full = at.FullPrefix(model, memory, src.src_mask)
        cached = at.CachedPrefix(model, memory, src.src_mask)
        for t in range(1, src.tgt_in.size(1) + 1):
            prefix = src.tgt_in[:, :t]
            assert torch.allclose(full(prefix), cached(prefix), atol=1e-4)


@pytest.mark.numerics
@pytest.mark.parametrize("use_sdpa", [True, False])
def test_cached_steps_equal_the_full_recompute(decoding, use_sdpa):
    model, data = decoding
    assert_cached_equals_full(variants(model, data, use_sdpa=use_sdpa), data)


@pytest.mark.numerics
def test_cached_steps_equal_the_full_recompute_with_pre_norm(decoding):
    _, data = decoding
    at.set_seed(5)
    model = at.model_for(dataclasses.replace(TINY, pre_norm=True), data.vocabs).eval()
    assert_cached_equals_full(model, data)


def lockstep(record: list):
    """A `steps` class for beam_search that runs the cache beside the full recompute.

    The search follows the full recompute's log-probabilities, so both see the same
    prefixes and the same re-ordering of beams; each step the cache's log-probabilities
    must agree with the full recompute's. Two searches run apart, one per decoder, would
    also agree, except where two candidates tie within rounding: which one wins then
    depends on the CPU's kernels. `record` gets each instance (one per beam_search).
    """
    cached = at.CachedPrefix  # the notebook's, also where a test puts Lockstep in its place

    class Lockstep(at.FullPrefix):
        def __init__(self, model, memory, src_mask):
            super().__init__(model, memory, src_mask)
            self.cached = cached(model, memory, src_mask)
            self.steps, self.gap, self.moved = 0, 0.0, False
            record.append(self)

        def __call__(self, ys):
            full = super().__call__(ys)
            self.gap = max(self.gap, (full - self.cached(ys)).abs().max().item())
            self.steps += 1
            return full

        def reorder(self, rows):
            self.moved |= not torch.equal(rows, torch.arange(len(rows)))
            self.cached.reorder(rows)

    return Lockstep


def ending_at(steps, ends: list[int], k: int, end_id: int):
    """A version of the `steps` class that makes sentence b end exactly at step ends[b]:
    </s> gets log-probability 0 (certain) then and is ruled out before. Every other word
    keeps the model's log-probability, so the words still come from it. Rows are beams,
    k per sentence, in sentence order, as beam_search lays them out."""
    ends = torch.tensor(ends)

    class Ending(steps):
        def __call__(self, ys):
            log_probs = super().__call__(ys).clone()  # (rows, V)
            now = ends[torch.arange(ys.size(0)) // k] == ys.size(1) - 1
            log_probs[:, end_id] = torch.where(now, 0.0, -1e9)
            return log_probs

    return Ending


@pytest.mark.numerics
def test_the_cache_follows_greedy_and_beam_search(decoding):
    """Sentences that end at different steps (constructed, not left to training): at every
    step of greedy (beam 1) and beam 4 search, the cache, re-ordered as the beams move,
    gives the full recompute's log-probabilities."""
    model, data = decoding
    en = data.vocabs["en"]
    src = at.collate(data.val, list(range(20)), en.pad_id)
    ids = en.special_ids()
    ends = [3 + (7 * b) % 20 for b in range(20)]  # steps 3 .. 22, all different from 30
    for k in (1, 4):
        record = []
        steps = ending_at(lockstep(record), ends, k, en.eos_id)
        out = at.beam_search(
            model, src.src, src.src_mask, 30, beam_size=k, alpha=0.6, ids=ids, scorer=steps
        )
        (search,) = record
        assert search.steps == max(ends) + 1 and search.gap < 1e-4, (k, search.gap)
        assert search.moved == (k > 1), "beam search re-orders the beams, and the cache"
        lengths = (out != en.pad_id).sum(dim=1)  # <s>, the words and </s>
        assert lengths.tolist() == [end + 2 for end in ends]  # ended where constructed
        words = out[:, 1:-1]
        assert len(set(map(tuple, words.tolist()))) > 10, "the words come from the model"


@pytest.mark.numerics
def test_translate_with_the_cache_follows_the_full_recompute(decoding, monkeypatch):
    """translate's cached path, with its chunks and banned words, keeps the cache in step
    with the full recompute (see lockstep); both paths then give the same translations."""
    model, data = decoding
    sources = [pair[0] for pair in data.val]
    plain = at.translate(model, sources, data.vocabs, beam_size=3, cached=False)
    record = []
    monkeypatch.setattr(at, "CachedPrefix", lockstep(record))
    assert at.translate(model, sources, data.vocabs, beam_size=3) == plain
    assert record and all(search.steps > 5 and search.gap < 1e-4 for search in record)


def test_sources_longer_than_the_position_table_are_cut_with_a_count(decoding, capsys):
    model, data = decoding
    limit = at.positions_of(model)
    de = data.vocabs["de"]
    long_source = [de.bos_id, *[de.unk_id] * (limit + 20), de.eos_id]
    out = at.translate(model, [long_source, data.val[0][0]], data.vocabs, beam_size=2)
    assert f"cut 1 of 2 sources longer than {limit} tokens" in capsys.readouterr().out
    assert len(out) == 2 and len(out[0]) < limit


CHILD = """
import os, signal, sys, dataclasses
from pathlib import Path
import torch
torch.set_num_threads(1)
import annotated_transformer as at
from stopping_jobs import stop_after_step

data_dir, out, kill_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
settings = dataclasses.replace(
    at.Settings(name="tiny", N=1, d_model=16, d_ff=32, h=2, train_pairs=200, eval_pairs=20),
    batch_tokens=300, accum_iter=2, epochs=2, warmup=10, checkpoint_steps=3,
)
if sys.argv[4] == "budget":  # the cpu preset's ways: linear decay, clipping, averaging
    settings = dataclasses.replace(
        settings, epochs=3, schedule="linear", clip_norm=1.0, average_last=2
    )
if kill_at:  # the hard way out: no cleanup, no finally blocks
    stop_after_step(kill_at, lambda: os.kill(os.getpid(), signal.SIGKILL))
model, history = at.train_model(settings, data_dir=data_dir, device=torch.device("cpu"), show=False)
torch.save({"model": model.state_dict(), "history": history}, out)
"""


def run_child(tmp_path, data_dir, kill_at, kind="paper"):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"out-{data_dir.name}-{kill_at}.pt"
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "MULTI30K_DIR": str(MIRROR), "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    result = subprocess.run(
        [sys.executable, str(script), str(data_dir), str(out), str(kill_at), kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, out


def test_sigkill_mid_epoch_then_restart_is_bit_identical(tmp_path):
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", kill_at=0)
    assert straight.returncode == 0, straight.stderr[-2000:]

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at=7)
    assert killed.returncode == -signal.SIGKILL
    last = torch.load(tmp_path / "killed" / "checkpoints" / "tiny" / "last.pt", weights_only=True)
    position = last["ranks"][0]["position"]
    assert position["epoch"] == 0 and position["batches"] > 0  # mid-epoch
    assert last["state"]["step"] == 6  # the last multiple of checkpoint_steps before 7

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", kill_at=0)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    a = torch.load(straight_out, weights_only=True)
    b = torch.load(resumed_out, weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    losses = [[(h["train_loss"], h["val_loss"]) for h in run["history"]] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_a_budget_run_killed_in_its_last_epoch_resumes_to_the_same_average(tmp_path):
    """Linear decay, clipping and averaging survive SIGKILL: the epoch files already
    written are kept, and the averaged model is bit-identical to an uninterrupted run's."""
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", 0, "budget")
    assert straight.returncode == 0, straight.stderr[-2000:]
    last = tmp_path / "straight" / "checkpoints" / "tiny" / "last.pt"
    steps = torch.load(last, weights_only=True)["state"]
    kill_at = steps["step"] * 5 // 6  # in the middle of the last of the three epochs

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at, "budget")
    assert killed.returncode == -signal.SIGKILL
    folder = tmp_path / "killed" / "checkpoints" / "tiny"
    assert (folder / "epoch-1.pt").is_file() and not (folder / "epoch-2.pt").exists()
    assert torch.load(folder / "last.pt", weights_only=True)["ranks"][0]["position"]["epoch"] == 2

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", 0, "budget")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = torch.load(straight_out, weights_only=True)
    b = torch.load(resumed_out, weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    scores = [
        [(h["train_loss"], h["val_loss"], h["val_bleu"], h.get("averaged")) for h in run["history"]]
        for run in (a, b)
    ]
    assert scores[0] == scores[1] and scores[0][-1][3]["epochs"] == [1, 2]

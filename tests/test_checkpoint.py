"""Checkpoints, exact resume, and decoding with beam search."""

import contextlib
import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import MIRROR, ROOT, prepared_data

import annotated_transformer as at
import trainer
from plumbing import CheckpointError, save_checkpoint

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
CPU = torch.device("cpu")
LESSON = trainer.Lesson.of(at)


@pytest.fixture
def data(tmp_path, monkeypatch):
    return prepared_data(TINY, tmp_path, monkeypatch)


def parameters(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def assert_same_weights(a, b) -> None:
    a, b = parameters(a), parameters(b)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def train(settings, data, data_dir, lesson=LESSON) -> trainer.Run:
    """trainer.train_model on the CPU, quietly: resumes from the folder's last.pt if any."""
    return trainer.train_model(trainer.new_run(lesson, settings, data, data_dir, CPU, show=False))


class Stopped(Exception):
    """The run stopped here, as if killed."""


@contextlib.contextmanager
def stopped_at_save(when, *, written: bool):
    """Run.save raises Stopped on its first call where when(run, position) holds: right
    after writing last.pt (written=True), or instead of writing it (killed just before)."""
    save = trainer.Run.save

    def save_or_stop(run, position):
        if when(run, position):
            if written:
                save(run, position)
            raise Stopped
        save(run, position)

    trainer.Run.save = save_or_stop
    try:
        with pytest.raises(Stopped):
            yield
    finally:
        trainer.Run.save = save


def test_a_run_stopped_after_its_first_epoch_resumes_to_the_same_weights(data, tmp_path, capsys):
    straight = train(TINY, data, tmp_path / "a")
    with stopped_at_save(lambda run, position: position.epoch == 1, written=True):
        train(TINY, data, tmp_path / "b")
    last = trainer.read_checkpoint(trainer.run_dir(TINY, LESSON, tmp_path / "b") / "last.pt")
    assert last["ranks"][0]["position"]["epoch"] == 1 and len(last["history"]) == 1
    capsys.readouterr()
    resumed = train(TINY, data, tmp_path / "b")
    assert "resuming from" in capsys.readouterr().out
    assert [h["epoch"] for h in resumed.history] == [0, 1]
    assert_same_weights(straight.model, resumed.model)
    # "Watch it learn": every epoch keeps its translations of the watched sentences,
    # the first epoch's through the resume too
    watched = [h["watched"] for h in resumed.history]
    assert [len(w) for w in watched] == [len(at.WATCHED_SENTENCES)] * 2
    assert all(isinstance(t, str) for w in watched for t in w)
    assert watched == [h["watched"] for h in straight.history]


def test_checkpoint_round_trip_and_refusals(data, tmp_path):
    model = at.model_for(TINY, data.vocabs)
    path = tmp_path / "c.pt"
    save_checkpoint(
        path,
        model=model.state_dict(),
        settings=trainer.training_settings(TINY),
        vocab_fingerprint=trainer.vocab_fingerprint(data.vocabs),
    )
    loaded = trainer.load_checkpoint(path, TINY, data.vocabs)
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    # the name, decoding and the checkpoint interval do not shape training: it still loads
    other_decoding = dataclasses.replace(TINY, name="t2", beam_size=5, checkpoint_steps=7)
    trainer.load_checkpoint(path, other_decoding, data.vocabs)

    other_vocabs = {**data.vocabs, "en": at.Vocab([*at.SPECIALS, "zebra"])}
    with pytest.raises(CheckpointError, match="other vocabularies: delete its folder"):
        trainer.load_checkpoint(path, TINY, other_vocabs)
    with pytest.raises(CheckpointError, match=r"other settings \(d_model\)") as refused:
        trainer.load_checkpoint(path, dataclasses.replace(TINY, d_model=32), data.vocabs)
    assert "\n" not in str(refused.value)

    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        trainer.load_checkpoint(path, TINY, data.vocabs)


class Trap:
    """Pickles into a call that writes a file: what a malicious checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def test_a_checkpoint_that_would_run_code_is_refused_unread(data, tmp_path):
    path, marker = tmp_path / "trap.pt", tmp_path / "ran"
    torch.save({"model": {}, "trap": Trap(marker)}, path)
    with pytest.raises(CheckpointError, match="damaged or truncated"):
        trainer.load_checkpoint(path, TINY, data.vocabs)
    assert not marker.exists(), "loading a checkpoint ran code"
    torch.load(path, weights_only=False)  # the trap is real: a plain unpickling runs it
    assert marker.read_text() == "code ran"


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
    first, second = (train(TINY, data, tmp_path / run).history for run in ("a", "b"))
    curve = [(h["train_loss"], h["val_loss"]) for h in first]
    assert curve == [(h["train_loss"], h["val_loss"]) for h in second]


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
    trained = trainer.load_or_train(LESSON, settings, data, folder, device=CPU, show=False)
    return trained.model.eval(), data


def with_attention(model, use_sdpa: bool):
    """A copy of the trained model whose attention runs on PyTorch's fused kernel
    (use_sdpa) or on the lesson's own attention()."""
    other = copy.deepcopy(model).eval()
    layers = [m for m in other.modules() if isinstance(m, at.MultiHeadAttention)]
    assert layers
    for layer in layers:
        layer.use_sdpa = use_sdpa
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
    assert_cached_equals_full(with_attention(model, use_sdpa), data)


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
lesson = trainer.Lesson.of(at)  # after stop_after_step, so that it trains with its hook
data = at.prepare_data(settings, data_dir)
trained = trainer.load_or_train(lesson, settings, data, data_dir, device=torch.device("cpu"))
torch.save({"model": trained.model.state_dict(), "history": trained.history}, out)
"""
KILLED = dataclasses.replace(TINY, batch_tokens=300, warmup=10, checkpoint_steps=3, beam_size=4)
# the cpu preset's ways: linear decay, clipping, averaging
BUDGET = dataclasses.replace(KILLED, epochs=3, schedule="linear", clip_norm=1.0, average_last=2)


def run_child(tmp_path, data_dir, kill_at, settings=KILLED):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"out-{data_dir.name}-{kill_at}.pt"
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "MULTI30K_DIR": str(MIRROR), "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}"}
    fields = json.dumps(dataclasses.asdict(settings))
    result = subprocess.run(
        [sys.executable, str(script), str(data_dir), str(out), str(kill_at), fields],
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
    # the folder that this process names for the run: the one the child trained in
    folder = trainer.run_dir(KILLED, LESSON, tmp_path / "killed")
    last = torch.load(folder / "last.pt", weights_only=True)
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
    straight, straight_out = run_child(tmp_path, tmp_path / "straight", 0, BUDGET)
    assert straight.returncode == 0, straight.stderr[-2000:]
    last = trainer.run_dir(BUDGET, LESSON, tmp_path / "straight") / "last.pt"
    steps = torch.load(last, weights_only=True)["state"]
    kill_at = steps["step"] * 5 // 6  # in the middle of the last of the three epochs

    killed, _ = run_child(tmp_path, tmp_path / "killed", kill_at, BUDGET)
    assert killed.returncode == -signal.SIGKILL
    folder = trainer.run_dir(BUDGET, LESSON, tmp_path / "killed")
    assert (folder / "epoch-1.pt").is_file() and not (folder / "epoch-2.pt").exists()
    assert torch.load(folder / "last.pt", weights_only=True)["ranks"][0]["position"]["epoch"] == 2

    resumed, resumed_out = run_child(tmp_path, tmp_path / "killed", 0, BUDGET)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = torch.load(straight_out, weights_only=True)
    b = torch.load(resumed_out, weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    scores = [
        [(h["train_loss"], h["val_loss"], h["val_bleu"], h.get("averaged")) for h in run["history"]]
        for run in (a, b)
    ]
    assert scores[0] == scores[1] and scores[0][-1][3]["epochs"] == [1, 2]


# --- a planned run killed around its re-plan ------------------------------------------------


class SlowClock:
    """trainer's `time` module with a clock a thousand times slow: every epoch overruns
    the budget, so the first re-plan after the warm-up cuts the run to one more epoch."""

    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self):
        return 1000 * time.perf_counter()


def fake_speed(tokens_per_second: float, validation_seconds: float):
    """measure_speed as a fake clock would report it: the same plan on every machine."""

    def measure(*args, **kwargs):
        return {"tokens_per_second": tokens_per_second, "validation_seconds": validation_seconds}

    return measure


KEPT = ("epochs", "steps", "warmup", "lr_factor", "decay")  # what a plan sets for training
# re-planned after its second epoch, when the warm-up is over; no mid-epoch checkpoints
PLANNED = dataclasses.replace(
    TINY, train_minutes=1.0, warmup=6, schedule="linear", checkpoint_steps=0
)


def test_a_planned_run_killed_around_its_replan_resumes_bit_for_bit(data, tmp_path, monkeypatch):
    """Killed between plan.json and last.pt (the re-plan written to plan.json, the
    epoch's last.pt not), or in the middle of its last epoch: the resumed run takes its
    plan from last.pt, whatever plan.json says, and ends bit for bit where an
    uninterrupted run ends."""
    monkeypatch.setattr(trainer, "measure_speed", fake_speed(1000.0, 0.5))  # many epochs
    monkeypatch.setattr(trainer, "time", SlowClock())
    straight = train(PLANNED, data, tmp_path / "straight")
    plan = straight.plan
    (change,) = plan["replans"]  # after the first epoch past the warm-up: one more
    assert change["after_epoch"] == 1 and change["was"] > plan["epochs"] == 3
    assert len(straight.history) == 3

    def replanned(run, position):  # the save right after the re-plan, at the epoch's end
        return "replans" in run.plan and position.batches == 0

    with stopped_at_save(replanned, written=False):
        train(PLANNED, data, tmp_path / "between")
    folder = trainer.run_dir(PLANNED, LESSON, tmp_path / "between")
    last = trainer.read_checkpoint(folder / "last.pt")
    position = last["ranks"][0]["position"]
    assert (position["epoch"], position["batches"]) == (1, 0)  # from the end of epoch 0
    on_disk = json.loads((folder / "plan.json").read_text())
    assert on_disk["epochs"] == 3 and last["plan"]["epochs"] == change["was"]  # plan.json stale
    resumed = train(PLANNED, data, tmp_path / "between")
    assert_same_weights(straight.model, resumed.model)
    assert [resumed.plan[k] for k in KEPT] == [plan[k] for k in KEPT]
    assert [h["train_loss"] for h in resumed.history] == [h["train_loss"] for h in straight.history]

    def in_last_epoch(run, position):
        return run.state.step == plan["steps"] - 1

    every_step = dataclasses.replace(PLANNED, checkpoint_steps=1)  # the same run's folder
    with stopped_at_save(in_last_epoch, written=True):
        train(every_step, data, tmp_path / "last-epoch")
    folder = trainer.run_dir(PLANNED, LESSON, tmp_path / "last-epoch")
    assert trainer.read_checkpoint(folder / "last.pt")["plan"]["epochs"] == plan["epochs"]
    (folder / "plan.json").write_text("{garbage")
    resumed = train(PLANNED, data, tmp_path / "last-epoch")
    assert_same_weights(straight.model, resumed.model)
    assert [resumed.plan[k] for k in KEPT] == [plan[k] for k in KEPT]

"""Translating and scoring: greedy decoding and beam search on scripted models, BLEU on
words the vocabulary lacks, and the heatmaps' pass through a model."""

import copy
import dataclasses
import functools
import itertools
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ROOT,
    quick_settings,
    tiny_data,
    tiny_model,
    tiny_settings,
    train_as_the_notebook,
)  # fmt: skip
from torch import nn

import annotated_transformer as at


def beams(k: int):
    """translate's `search` for beam search with k beams and the paper's alpha."""
    return functools.partial(at.beam_search, beam_size=k, alpha=0.6)


def test_bleu_does_not_match_unk_against_a_rare_reference_word(monkeypatch):
    """A model that writes <unk> where the reference has a rare word must not score 100."""
    data = tiny_data()
    unk_output = [data.vocabs["en"].decode(data.test[0][1][1:-1])]  # A <unk> runs .
    assert unk_output == [["A", "<unk>", "runs", "."]]
    monkeypatch.setattr(at, "translate", lambda *args, **kwargs: unk_output)
    settings = at.Settings(name="t", beam_size=2)
    results = at.evaluate_test(nn.Linear(1, 1), data, settings)
    assert data.test_text[0][1] == "A zebra runs." and results["test2016_bleu_greedy"] < 60


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


@pytest.mark.parametrize("block_kind", ["paper", "rotary"])
def test_heatmap_weights_are_the_models_own_and_nothing_stays_behind(block_kind):
    """The hooks catch what each block computes (its output is the weights times its
    values), rotary attention's turned scores included, and come off afterwards: the model
    keeps no weights and no hook."""
    data = tiny_data()
    at.set_seed(0)
    settings = at.Settings(name="t", N=2, d_model=16, d_ff=32, h=2, pre_norm=True)
    model = at.model_for(settings, data.vocabs)
    if block_kind == "rotary":
        model = at.modernise(model, settings.h, settings.d_ff)
    model = model.double()  # float64: the two computations agree far below 1e-10
    src, tgt = torch.tensor(data.val[0][0]), torch.tensor(data.val[0][1])
    maps = at.attention_maps(model, src, tgt, data.vocabs["en"].pad_id)
    blocks = [m for m in model.modules() if isinstance(m, at.MultiHeadAttention)]
    assert all(not b.dropout._forward_hooks for b in blocks) and len(blocks) == 2 + 2 * 2
    assert isinstance(model.encoder.layers[0].self_attn, at.RotaryAttention) == (
        block_kind == "rotary")  # fmt: skip
    assert [len(maps[kind]) for kind in maps] == [2, 2, 2]
    layer = model.encoder.layers[0]
    x = model.src_embed(src.unsqueeze(0))  # what the first layer's sub-layer normalises
    x = layer.attn_sublayer.norm(x) if layer.attn_sublayer.pre_norm else x
    block = layer.self_attn
    v = block.split_heads(block.w_v(x))  # (1, h, S, d_k)
    heads = (maps["encoder self-attention"][0].unsqueeze(0) @ v).transpose(1, 2).flatten(2)
    expected = block(query=x, key=x, value=x, mask=torch.ones(1, 1, len(src), dtype=torch.bool))
    assert torch.allclose(block.w_o(heads), expected, atol=1e-10)


# --- greedy decoding --------------------------------------------------------------------

PAD, START, END = 0, 1, 2
IDS = at.SpecialIds(start=START, end=END, pad=PAD)
V = 11  # the greedy tests' vocabulary: the three specials and words 3 .. 10


class ScriptedGenerator(nn.Module):
    """Stands in for model.generator: at call t, row b predicts script[b][t]."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = torch.tensor(script), 0

    def forward(self, x):
        words = self.script[:, self.calls]
        self.calls += 1
        return F.log_softmax(F.one_hot(words, V).float() * 10, dim=-1)


def source():
    src = torch.tensor([[START, 5, 6, END], [START, 7, END, PAD], [START, 8, 9, END]])
    return src, (src != PAD).unsqueeze(-2)


def test_greedy_decode_shape_and_start_symbol():
    """An untrained model: (B, <= max_output_len) ids that start with <s>."""
    src, src_mask = source()
    ys = at.greedy_decode(tiny_model(V, seed=0), src, src_mask, max_output_len=6, ids=IDS)
    assert ys.dtype == torch.long and ys.size(0) == 3 and 2 <= ys.size(1) <= 6
    assert (ys[:, 0] == START).all()


def test_greedy_decode_pads_after_the_end_and_stops_when_all_are_done():
    """A finished sentence gets padding; decoding ends once every sentence has </s>."""
    model = tiny_model(V, seed=0)
    model.generator = ScriptedGenerator(
        [
            [5, END, 6, 7, 8, 9, 10],  # ends at step 2, then would go on talking
            [5, 6, 7, END, 8, 9, 10],  # ends at step 4
            [END, 3, 4, 5, 6, 7, 8],  # ends at once
        ]
    )
    src, src_mask = source()
    ys = at.greedy_decode(model, src, src_mask, max_output_len=8, ids=IDS)
    assert ys.tolist() == [
        [START, 5, END, PAD, PAD],
        [START, 5, 6, 7, END],
        [START, END, PAD, PAD, PAD],
    ]
    assert model.generator.calls == 4, "no step after the last sentence finished"


def test_greedy_decode_stops_after_one_step_when_end_always_wins():
    """With a generator that always prefers </s>, the output is just <s> </s>."""
    model = tiny_model(V, seed=0)
    with torch.no_grad():
        model.generator.proj.weight.zero_()
        model.generator.proj.bias.zero_()
        model.generator.proj.bias[END] = 100.0
    src, src_mask = source()
    ys = at.greedy_decode(model, src, src_mask, max_output_len=10, ids=IDS)
    assert ys.tolist() == [[START, END]] * 3


def test_greedy_decode_respects_max_output_len():
    """A sentence that never ends is cut at max_output_len tokens, <s> included."""
    model = tiny_model(V, seed=0)
    model.generator = ScriptedGenerator([[5] * 10] * 3)
    src, src_mask = source()
    ys = at.greedy_decode(model, src, src_mask, max_output_len=4, ids=IDS)
    assert ys.tolist() == [[START, 5, 5, 5]] * 3


# --- beam search on a scripted model -----------------------------------------------------

# The scripted model knows five words: the three specials, then 3 and 4 ("a" and "b").


class Scripted:
    """A stand-in for the model: next-word log-probabilities fixed by the prefix."""

    def __init__(self, table=None, seed: int = 0):
        self.table, self.seed, self.calls = table or {}, seed, 0

    def eval(self):
        return self

    def encode(self, src, src_mask):
        return torch.zeros(src.size(0), src.size(1), 1)

    def log_probs(self, prefix: tuple) -> torch.Tensor:
        if prefix in self.table:
            probs = torch.tensor(self.table[prefix], dtype=torch.float)
        else:  # a fixed random distribution per prefix
            generator = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**31)
            probs = torch.rand(3, generator=generator) + 0.05
        probs = torch.cat([torch.zeros(2), probs / probs.sum()])  # never <pad> or <s>
        return probs.log()

    def steps(self, model, memory, src_mask):
        scripted = self

        class Steps:
            def __call__(self, ys):
                scripted.calls += 1
                return torch.stack([scripted.log_probs(tuple(row[1:])) for row in ys.tolist()])

            def reorder(self, rows):
                pass

        return Steps()


def search(model: Scripted, beam_size: int, alpha: float, max_len: int = 5, sentences: int = 1):
    src = torch.ones(sentences, 3, dtype=torch.long)
    mask = torch.ones(sentences, 1, 3, dtype=torch.bool)
    out = at.beam_search(
        model, src, mask, max_len, beam_size=beam_size, alpha=alpha, ids=IDS, scorer=model.steps
    )
    return [tuple(w for w in row[1:] if w != PAD) for row in out.tolist()]


def best_by_brute_force(model: Scripted, alpha: float, max_len: int) -> tuple:
    """Score every output that ends with </s> within the cap; return the best."""
    best, best_score = None, -math.inf
    for n in range(max_len - 1):  # n words before </s>
        for words in itertools.product((3, 4), repeat=n):
            output = (*words, END)
            total = sum(model.log_probs(output[:i])[w].item() for i, w in enumerate(output))
            score = total / ((5 + len(output)) / 6) ** alpha
            if score > best_score:
                best, best_score = output, score
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", range(8))
def test_a_wide_beam_finds_the_best_penalised_translation(alpha, seed):
    """With more beams than prefixes nothing is pruned, so beam search must return the
    exact optimum; this checks the bookkeeping, the penalty and the stopping rule."""
    model = Scripted(seed=seed)
    assert search(model, beam_size=32, alpha=alpha) == [best_by_brute_force(model, alpha, 5)]


def test_a_finished_translation_leaves_the_beam_and_the_penalty_decides():
    # "</s>" at once has probability 0.5, "a </s>" 0.45 * 0.99: short wins without a
    # penalty, but not with a strong one, and only if "a" kept exploring after "</s>"
    table = {(): [0.5, 0.45, 0.05], (3,): [0.99, 0.005, 0.005], (4,): [0.4, 0.3, 0.3]}
    assert search(Scripted(table), beam_size=2, alpha=0.0) == [(END,)]
    assert search(Scripted(table), beam_size=2, alpha=3.0) == [(3, END)]


def test_search_stops_once_no_live_beam_can_win():
    # every step ends with </s> at 0.9: with alpha 0 the first finished one already beats
    # any longer output, so the search must stop after the first step
    model = Scripted({(): [0.9, 0.05, 0.05]})
    assert search(model, beam_size=2, alpha=0.0, max_len=30) == [(END,)]
    assert model.calls == 1


def test_beam_of_one_is_greedy_on_a_scripted_model():
    for seed in range(6):
        model = Scripted(seed=seed)
        greedy, prefix = [], ()
        while len(prefix) < 9:
            word = int(model.log_probs(prefix).argmax())
            prefix = (*prefix, word)
            if word == END:
                break
        greedy = [prefix]
        assert search(model, beam_size=1, alpha=0.6, max_len=10) == greedy, seed


# --- a briefly trained model: the cache, greedy and beam search, and translate -----------

DECODING_TINY = tiny_settings(dropout=0.1, beam_size=3)


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
def test_beam_of_one_equals_greedy(quick_data):
    at.set_seed(3)
    model = at.model_for(DECODING_TINY, quick_data.vocabs).eval()
    en = quick_data.vocabs["en"]
    src = at.collate(quick_data.val, list(range(10)), en.pad_id)
    ids = en.special_ids()
    greedy = at.greedy_decode(model, src.src, src.src_mask, 20, ids=ids)
    beam = at.beam_search(model, src.src, src.src_mask, 20, beam_size=1, alpha=0.6, ids=ids)
    assert greedy.size(1) > 5, "the sentences are several words long"
    with torch.no_grad():
        assert_equal_or_tied(beam, greedy, model, src.src, src.src_mask)


@pytest.fixture(scope="module")
def decoding(tmp_path_factory, multi30k):
    """A briefly trained small model (its weights vary a little between CPUs; no test
    relies on how well it learned)."""
    folder = tmp_path_factory.mktemp("decoding")
    settings = dataclasses.replace(
        DECODING_TINY,
        d_model=32,
        d_ff=64,
        train_pairs=1000,
        batch_tokens=800,
        accum_iter=1,
        epochs=3,
    )
    settings = dataclasses.replace(settings, warmup=30, lr_factor=2.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTI30K_DIR", str(multi30k))
        data = at.prepare_data(settings, folder)
    model, _, _ = train_as_the_notebook(settings, data, folder)
    return model.eval(), data


def with_attention(model, fused: bool):
    """A copy of the trained model whose attention runs on PyTorch's fused kernel
    (tools/bench.py's FusedAttention) or on the lesson's own attention()."""
    sys.path.insert(0, str(ROOT / "tools"))
    import bench  # only these tests need the benchmark's FusedAttention

    other = copy.deepcopy(model).eval()
    assert any(isinstance(m, at.MultiHeadAttention) for m in other.modules())
    return bench.with_fused_attention(other) if fused else other


# Cached and full decoding compute the same function in a different order; in float64 their
# rounding (about 1e-16 of log-probabilities under 100) stays below 1e-12, far under this
# bound, and a real difference (a wrong position, a stale cache) is far above it.
FLOAT64_BOUND = 1e-10


def in_float64(model):
    """A copy of `model` that computes in float64."""
    return copy.deepcopy(model).double().eval()


def assert_cached_equals_full(model, data):
    """Step by step over real targets, the cached log-probs equal the full recompute's,
    in float64."""
    model = in_float64(model)
    src = at.collate(data.val, list(range(12)), data.vocabs["en"].pad_id)
    with torch.no_grad():
        memory = model.encode(src.src, src.src_mask)
        full = at.FullPrefix(model, memory, src.src_mask)
        cached = at.CachedPrefix(model, memory, src.src_mask)
        for t in range(1, src.tgt_in.size(1) + 1):
            prefix = src.tgt_in[:, :t]
            assert torch.allclose(full(prefix), cached(prefix), atol=FLOAT64_BOUND)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "attention"])
def test_cached_steps_equal_the_full_recompute(decoding, fused):
    model, data = decoding
    assert_cached_equals_full(with_attention(model, fused), data)


@pytest.mark.slow
@pytest.mark.numerics
def test_cached_steps_equal_the_full_recompute_with_pre_norm(decoding):
    _, data = decoding
    at.set_seed(5)
    model = at.model_for(dataclasses.replace(DECODING_TINY, pre_norm=True), data.vocabs).eval()
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
        def __init__(self, model, memory, src_mask, banned=()):
            super().__init__(model, memory, src_mask, banned)
            self.cached = cached(model, memory, src_mask, banned)
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


@pytest.mark.slow
@pytest.mark.numerics
def test_the_cache_follows_greedy_and_beam_search(decoding):
    """Sentences that end at different steps (constructed, not left to training): at every
    step of greedy decoding, and of beam search with one beam and with four, the cache,
    re-ordered as the beams move, gives the full recompute's log-probabilities (float64)."""
    model, data = decoding
    model = in_float64(model)
    en = data.vocabs["en"]
    src = at.collate(data.val, list(range(20)), en.pad_id)
    ids = en.special_ids()
    ends = [3 + (7 * b) % 20 for b in range(20)]  # steps 3 .. 22, all different from 30
    for search_with, k in (("greedy", 1), ("beam", 1), ("beam", 4)):
        record = []
        steps = ending_at(lockstep(record), ends, k, en.eos_id)
        if search_with == "greedy":  # translate's path for one beam
            out = at.greedy_decode(model, src.src, src.src_mask, 30, ids=ids, scorer=steps)
        else:
            out = at.beam_search(
                model, src.src, src.src_mask, 30, beam_size=k, alpha=0.6, ids=ids, scorer=steps
            )
        (search,) = record
        assert search.steps == max(ends) + 1 and search.gap < FLOAT64_BOUND, (search_with, k)
        assert search.moved == (k > 1), "beam search re-orders the beams, and the cache"
        lengths = (out != en.pad_id).sum(dim=1)  # <s>, the words and </s>
        assert lengths.tolist() == [end + 2 for end in ends]  # ended where constructed
        words = out[:, 1:-1]
        assert len(set(map(tuple, words.tolist()))) > 10, "the words come from the model"


@pytest.mark.slow
@pytest.mark.numerics
def test_translate_with_the_cache_follows_the_full_recompute(decoding, monkeypatch):
    """translate's cached path, with its chunks and banned words, keeps the cache in step
    with the full recompute (see lockstep); both paths then give the same translations.
    Each sentence ends at a constructed step from 6 to 15 (ending_at), however briefly the
    model trained, so every search runs more than 5 steps. In float64, so that no near-tie
    of two words can part the two paths."""
    model, data = decoding
    model = in_float64(model)
    sources = [pair[0] for pair in data.val]
    en, k = data.vocabs["en"], 3
    ends = [6 + b % 10 for b in range(100)]  # translate's chunks hold at most 100 sentences
    record = []
    full = at.FullPrefix
    monkeypatch.setattr(at, "FullPrefix", ending_at(full, ends, k, en.eos_id))
    plain = at.translate(
        model,
        sources,
        data.vocabs,
        search=functools.partial(at.beam_search, beam_size=k, alpha=0.6),
        cached=False,
    )
    monkeypatch.setattr(at, "FullPrefix", full)
    monkeypatch.setattr(at, "CachedPrefix", ending_at(lockstep(record), ends, k, en.eos_id))
    assert (
        at.translate(
            model,
            sources,
            data.vocabs,
            search=functools.partial(at.beam_search, beam_size=k, alpha=0.6),
        )
        == plain
    )
    chunks = [min(100, len(sources) - start) for start in range(0, len(sources), 100)]
    assert [search.steps for search in record] == [max(ends[:n]) + 1 for n in chunks]
    assert all(search.gap < FLOAT64_BOUND for search in record)


@pytest.mark.slow
def test_sources_longer_than_the_position_table_are_cut_with_a_count(decoding, capsys):
    model, data = decoding
    limit = model.src_embed[1].table.size(0)
    de = data.vocabs["de"]
    long_source = [de.bos_id, *[de.unk_id] * (limit + 20), de.eos_id]
    out = at.translate(
        model,
        [long_source, data.val[0][0]],
        data.vocabs,
        search=functools.partial(at.beam_search, beam_size=2, alpha=0.6),
    )
    assert f"cut 1 of 2 sources longer than {limit} tokens" in capsys.readouterr().out
    assert len(out) == 2 and len(out[0]) < limit


# --- the ban on <unk>, on both decoders ---------------------------------------------------


def test_translate_never_writes_unk_where_the_model_would(quick_data):
    at.set_seed(0)
    model = at.model_for(quick_settings(), quick_data.vocabs).eval()
    en = quick_data.vocabs["en"]
    with torch.no_grad():
        model.generator.proj.bias[en.unk_id] = 100.0  # <unk> is by far the likeliest word
    sources = [src for src, _ in quick_data.val[:6]]
    src = torch.tensor([sources[0]])
    src_mask = (src != quick_data.vocabs["de"].pad_id).unsqueeze(-2)

    def search(beam: int):
        return at.greedy_decode if beam == 1 else beams(beam)

    for beam in (1, 3):
        # the decoder alone, with no word banned, writes nothing but <unk>
        unbanned = search(beam)(model, src, src_mask, 8, ids=en.special_ids())
        assert set(unbanned[0, 1:].tolist()) == {en.unk_id}
        banned = at.translate(model, sources, quick_data.vocabs, search=search(beam))
        assert all("<unk>" not in tokens for tokens in banned)
        # the ban works on both decoders (their words are not compared: an untrained
        # model's near ties may round one way on one and the other way on the other)
        plain = at.translate(model, sources, quick_data.vocabs, search=search(beam), cached=False)
        assert all(tokens and "<unk>" not in tokens for tokens in plain)

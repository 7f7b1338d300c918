"""Translating and scoring: greedy decoding and beam search on scripted models, BLEU on
words the vocabulary lacks, and the heatmaps' pass through a model."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_data
from torch import nn

import annotated_transformer as at


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


# --- greedy decoding --------------------------------------------------------------------

PAD, START, END = 0, 1, 2
IDS = at.SpecialIds(start=START, end=END, pad=PAD)
V = 11  # the greedy tests' vocabulary: the three specials and words 3 .. 10


def tiny_model(**options):
    """An untrained one-layer model over V words, the same for every test."""
    at.set_seed(0)
    config = at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0, **options)
    return at.make_model(V, V, config)


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
    ys = at.greedy_decode(tiny_model(), src, src_mask, max_output_len=6, ids=IDS)
    assert ys.dtype == torch.long and ys.size(0) == 3 and 2 <= ys.size(1) <= 6
    assert (ys[:, 0] == START).all()


def test_greedy_decode_pads_after_the_end_and_stops_when_all_are_done():
    """A finished sentence gets padding; decoding ends once every sentence has </s>."""
    model = tiny_model()
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
    model = tiny_model(tie_output=False)
    with torch.no_grad():
        model.generator.proj.weight.zero_()
        model.generator.proj.bias.zero_()
        model.generator.proj.bias[END] = 100.0
    src, src_mask = source()
    ys = at.greedy_decode(model, src, src_mask, max_output_len=10, ids=IDS)
    assert ys.tolist() == [[START, END]] * 3


def test_greedy_decode_respects_max_output_len():
    """A sentence that never ends is cut at max_output_len tokens, <s> included."""
    model = tiny_model()
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

"""Sub-words (§5.1) and three-way weight tying (§3.4)."""

import dataclasses
import io
import math
from collections import Counter

import pytest
import subword_nmt.learn_bpe
import torch
from conftest import multi30k_folder, prepared_data, quick_settings

import annotated_transformer as at

# the quick preset narrowed, with a joint sub-word vocabulary of 300 merges
SMALL = dataclasses.replace(quick_settings(), name="small-bpe", d_model=16, d_ff=32)
MERGES = 300


@pytest.fixture
def data(tmp_path, monkeypatch):
    subwords = lambda tokens: at.subword_vocabularies(tokens, merges=MERGES)  # noqa: E731
    return prepared_data(SMALL, tmp_path, monkeypatch, make_vocabs=subwords)


def training_word_counts(pairs: int) -> dict[str, int]:
    """Word counts of the first training pairs, both languages, as learned_merges counts."""
    mirror, source = multi30k_folder()
    if not mirror.is_dir():
        pytest.skip(f"no Multi30k mirror: {source}")
    text = at.load_pairs("train", mirror)[:pairs]
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
    ids = vocab.encode([*words[:2], " ", *words[2:]])
    assert ids == at.Vocab.encode(vocab, pieces)  # encode looks up the pieces
    every_piece = at.SubwordVocab([*at.SPECIALS, *dict.fromkeys(pieces)], merges)
    assert every_piece.decode(every_piece.encode(words)) == words  # the pieces glue back
    assert vocab.decode([vocab.stoi["spiel@@"]]) == ["spiel"]  # a piece cut off at the end reads


def test_a_sub_word_vocabulary_is_joint_and_knows_new_words(data):
    de, en = data.vocabs["de"], data.vocabs["en"]
    assert de is en and de.merges and len(de.merges) <= MERGES
    pieces = de.pieces(at.german_tokens("Eine Frau liest über Hundeschlitten."))
    assert all(piece in de.stoi for piece in pieces)  # no <unk>: new words split into known
    src, tgt = data.train[0]
    first_pair = at.load_pairs("train", at.DATA_DIR)[:1]
    (english,) = at.tokenize_pairs(first_pair, at.make_tokenizers())["en"]
    assert en.decode(tgt[1:-1]) == english  # decoding gives back the words


def test_translate_returns_words(data):
    at.set_seed(0)
    model = at.model_for(SMALL, data.vocabs).eval()
    sources = [src for src, _ in data.val[:3]]
    words = at.translate(model, sources, data.vocabs)
    assert len(words) == 3
    assert all(not w.endswith(at.SEPARATOR) for sentence in words for w in sentence)


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
    config = at.ModelConfig(N=1, d_model=16, d_ff=32, h=2)
    apart = at.make_model(50, 50, config)
    joint = at.make_model(50, 50, dataclasses.replace(config, share_embeddings=True))
    assert apart.src_embed[0].embedding.weight is not apart.tgt_embed[0].embedding.weight
    # the source's 50 x 16 matrix became the target's (which the generator already uses)
    assert at.count_parameters(apart) - at.count_parameters(joint) == 50 * 16


def test_sharing_embeddings_needs_one_vocabulary():
    with pytest.raises(ValueError, match="one vocabulary"):
        at.make_model(50, 60, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, share_embeddings=True))

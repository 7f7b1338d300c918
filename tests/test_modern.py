"""Appendix D: each of today's parts computes what its paper defines, and today's model
decodes, keeps its parameter budget, and names a run folder of its own."""

import dataclasses

import pytest
import torch
from conftest import assert_same_weights, quick_settings
from torch import nn

import annotated_transformer as at
import plumbing
from plumbing import code_reached

pytestmark = pytest.mark.usefixtures("float64")  # seed 0 and float64 (conftest.py)


def test_rms_norm_is_layer_norm_without_the_mean_and_matches_its_formula():
    x = torch.randn(3, 5, 16) + 2.0  # a mean far from zero
    theirs = nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 2.0)
    by_formula = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * theirs.weight
    assert torch.allclose(theirs(x), by_formula, atol=1e-5)
    layer_norm = nn.LayerNorm(16, eps=1e-5, elementwise_affine=False)
    centred = x - x.mean(-1, keepdim=True)
    assert torch.allclose(nn.RMSNorm(16, eps=1e-5)(centred), layer_norm(x), atol=1e-5)
    assert not torch.allclose(nn.RMSNorm(16, eps=1e-5)(x), layer_norm(x), atol=1e-2)


def test_a_rotary_score_depends_only_on_the_offset_and_its_sign():
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(m, n):
        return (at.rotate(q, first=m) * at.rotate(k, first=n)).sum()

    for m, n in [(0, 0), (3, 1), (1, 3), (17, 40)]:
        for shift in (1, 10, 100):
            assert torch.allclose(score(m, n), score(m + shift, n + shift), atol=1e-4)
    assert not torch.allclose(score(3, 1), score(1, 3), atol=1e-3)
    assert torch.allclose(at.rotate(q, first=0), q)  # position 0: no turn
    sequence = torch.randn(2, 4, 6, 32)  # (B, h, T, d_k)
    turned = at.rotate(sequence)
    assert torch.allclose(turned.norm(dim=-1), sequence.norm(dim=-1), atol=1e-5)
    assert torch.allclose(turned[:, :, 4:], at.rotate(sequence[:, :, 4:], first=4), atol=1e-6)


def test_rotary_pairs_turn_at_the_sinusoids_frequencies():
    """Dimensions (2i, 2i+1) at position p turn by p / 10000^(2i/d), §3.5's angles."""
    d, p = 8, 5
    unit = torch.zeros(1, 1, d)
    unit[..., 0::2] = 1.0  # (1, 0) in every pair
    turned = at.rotate(unit.expand(1, p + 1, d).contiguous())[0, p]
    table = at.PositionalEncoding(d, dropout=0.0).table[p]  # sin at 2i, cos at 2i+1
    assert torch.allclose(turned[0::2], table[1::2], atol=1e-5)  # cos(p theta_i)
    assert torch.allclose(turned[1::2], table[0::2], atol=1e-5)  # sin(p theta_i)


@pytest.mark.parametrize("d_model, d_ff", [(512, 2048), (128, 256), (32, 64)])
def test_swiglu_keeps_the_feed_forward_layers_parameters(d_model, d_ff):
    glu, ffn = at.SwiGLU(d_model, d_ff), at.FeedForward(d_model, d_ff)
    assert glu.w.out_features == round(2 * d_ff / 3)
    assert abs(at.count_parameters(glu) / at.count_parameters(ffn) - 1) < 0.02


def test_swiglu_is_shazeers_formula():
    glu, x = at.SwiGLU(16, 48), torch.randn(2, 3, 16)
    W, V, W2 = glu.w.weight.T, glu.v.weight.T, glu.w2.weight.T
    swish = lambda z: z * torch.sigmoid(z)  # noqa: E731
    assert torch.allclose(glu(x), (swish(x @ W) * (x @ V)) @ W2, atol=1e-6)


def small_modern_model():
    config = at.ModelConfig(N=2, d_model=16, d_ff=32, h=2, pre_norm=True, dropout=0.0)
    return at.modernise(at.make_model(11, 13, config), config.h, config.d_ff).eval()


def test_todays_model_has_only_todays_parts():
    model = small_modern_model()
    kinds = {type(m) for m in model.modules()}
    assert nn.LayerNorm not in kinds and at.FeedForward not in kinds
    assert {nn.RMSNorm, at.SwiGLU, at.RotaryAttention} <= kinds
    for layer in model.decoder.layers:  # cross-attention compares two sentences: no turn
        assert type(layer.cross_attn) is at.MultiHeadAttention
    assert not model.src_embed[1].table.any() and not model.tgt_embed[1].table.any()


def test_cached_decoding_of_todays_model_matches_the_full_prefix():
    model, ids = small_modern_model(), at.SpecialIds(start=1, end=2, pad=0)
    src = torch.randint(3, 11, (3, 6))
    src[1, 4:] = 0  # padding
    mask = (src != 0).unsqueeze(-2)
    with torch.no_grad():
        memory = model.encode(src, mask)
        full, cached = at.FullPrefix(model, memory, mask), at.CachedPrefix(model, memory, mask)
        ys = torch.randint(3, 13, (3, 7))
        for t in range(1, 8):
            assert torch.allclose(full(ys[:, :t]), cached(ys[:, :t]), atol=1e-10)
    greedy = [
        at.greedy_decode(model, src, mask, 10, ids=ids, scorer=s)
        for s in (at.FullPrefix, at.CachedPrefix)
    ]
    assert torch.equal(greedy[0], greedy[1])


def test_modernise_refuses_a_post_norm_model_in_one_line():
    post_norm = at.make_model(11, 11, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2))
    with pytest.raises(ValueError, match="pre_norm=True"):
        at.modernise(post_norm, 2, 32)


def test_modernise_keeps_the_attention_dropout_it_replaces():
    config = at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, pre_norm=True)
    model = at.make_model(11, 11, config)
    for attention in model.modules():
        if isinstance(attention, at.MultiHeadAttention):
            attention.dropout.p = 0.25  # a model with dropout on its attention weights
    model = at.modernise(model, 2, 32)
    turned = [layer.self_attn for layer in (*model.encoder.layers, *model.decoder.layers)]
    assert all(isinstance(block, at.RotaryAttention) for block in turned)
    assert [block.dropout.p for block in turned] == [0.25, 0.25]
    assert model.decoder.layers[0].cross_attn.dropout.p == 0.25  # left as it was


def vocabularies(de: int, en: int) -> dict:
    return {"de": list(range(de)), "en": list(range(en))}


@pytest.mark.parametrize("preset", ["smoke", "cpu"])
def test_todays_model_keeps_the_presets_budget_within_5_percent(preset):
    settings, vocabs = at.get_settings(preset), vocabularies(7853, 5893)  # the cpu run's
    paper, modern = at.model_for(settings, vocabs), at.modern_model_for(settings, vocabs)
    assert abs(at.count_parameters(modern) / at.count_parameters(paper) - 1) < 0.05
    assert settings.pre_norm or isinstance(paper.encoder.final_norm, nn.Identity)


def test_todays_model_is_drawn_from_the_seed():
    settings, vocabs = at.get_settings("smoke"), vocabularies(50, 40)
    first, second = (at.modern_model_for(settings, vocabs).state_dict() for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_todays_run_is_keyed_by_the_new_parts_and_the_papers_is_not():
    """An edit to a new part moves today's run (the key reaches it) and keeps the paper's."""
    paper = code_reached(vars(at), ("train",))
    modern = code_reached(vars(at), ("train", "modern_model_for"))
    new_parts = {"rotate", "RotaryAttention", "SwiGLU", "modernise", "modern_model_for"}
    assert new_parts <= set(modern) and not new_parts & set(paper)
    assert {name: modern[name] for name in paper} == paper  # the paper's code, hashed alike


def test_train_trains_the_model_its_build_makes(tmp_path, quick_data):
    settings = dataclasses.replace(quick_settings(), name="smoke-modern")
    folder = plumbing.run_folder(
        settings, quick_data, vars(at), tmp_path, roots=("train", "modern_model_for")
    )
    model, history = at.train(
        settings, quick_data, folder, device=torch.device("cpu"), build=at.modern_model_for
    )
    assert isinstance(model.encoder.layers[0].feed_forward, at.SwiGLU) and len(history) == 1
    reloaded, again = at.train(
        settings, quick_data, folder, device=torch.device("cpu"), build=at.modern_model_for
    )
    assert again == history and isinstance(reloaded.encoder.layers[0].self_attn, at.RotaryAttention)
    assert_same_weights(reloaded, model)
    assert (folder / "last.pt").is_file()
    # (`again == history` holds each epoch's seconds too: loaded, not trained again)

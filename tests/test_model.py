"""The model's parts against PyTorch's own implementations of the same maths."""

import copy
import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT
from torch import nn

import annotated_transformer as at

sys.path.insert(0, str(ROOT / "tools"))
import bench  # its FusedAttention: the lesson's block on PyTorch's fused kernel

# Two computations of one function (ours and PyTorch's, fused and plain) are compared in
# float64: their rounding, about 1e-16 of values near 1 summed over a few dozen terms, stays
# below 1e-13, far under ATOL; a real difference (a mask, a scale, a transpose) is far above.
ATOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64")  # seed 0 and float64 (conftest.py)


def lengths_to_mask(lengths, size):
    """(B,) lengths -> (B, size) boolean mask, True on the first `length` positions."""
    return torch.arange(size).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


@torch.no_grad()
def randomise_norms(module: nn.Module) -> None:
    """Give every LayerNorm non-default weights, so a swapped norm would be noticed."""
    for norm in module.modules():
        if isinstance(norm, nn.LayerNorm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()


# --- scaled dot-product attention -------------------------------------------------------

B, H, T, D_K = 2, 3, 5, 4


def random_qkv(t_q=T, t_k=T):
    return (
        torch.randn(B, H, t_q, D_K),
        torch.randn(B, H, t_k, D_K),
        torch.randn(B, H, t_k, D_K),
    )


@pytest.mark.numerics
def test_attention_without_mask_equals_sdpa():
    """No mask: the same output as PyTorch's fused kernel, and weights that sum to 1."""
    q, k, v = random_qkv(t_q=3, t_k=T)
    out, weights = at.attention(query=q, key=k, value=v)
    assert out.shape == (B, H, 3, D_K) and weights.shape == (B, H, 3, T)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=ATOL)
    assert torch.allclose(weights.sum(-1), torch.ones(B, H, 3))


@pytest.mark.numerics
@pytest.mark.parametrize(
    "mask",
    [
        at.causal_mask(T),  # (1, T, T), broadcast over batch and heads
        lengths_to_mask([3, 5], T)[:, None, None, :],  # (B, 1, 1, T) key padding
        lengths_to_mask([2, 4], T)[:, None, None, :] & at.causal_mask(T),  # both at once
    ],
    ids=["causal", "padding", "causal-and-padding"],
)
def test_attention_with_mask_equals_sdpa(mask):
    """A boolean mask (True = may attend) means the same in both; masked keys get 0 weight."""
    q, k, v = random_qkv()
    out, weights = at.attention(query=q, key=k, value=v, mask=mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, expected, atol=ATOL)
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()
    assert torch.allclose(weights.sum(-1), torch.ones(B, H, T))


# --- multi-head attention ---------------------------------------------------------------

D_MODEL, HEADS = 16, 4


def kernel(module: nn.Module, fused: bool) -> nn.Module:
    """`module` with its attention on PyTorch's fused kernel (fused) or on ours."""
    return bench.with_fused_attention(module) if fused else module


def mha_pair(fused):
    ours = kernel(at.MultiHeadAttention(HEADS, D_MODEL, 0.0), fused).eval()
    ref = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).eval()
    at.copy_into_pytorch(ours, ref)
    return ours, ref


@pytest.mark.numerics
@pytest.mark.parametrize("fused", [False, True], ids=["attention", "fused"])
def test_multi_head_self_attention_equals_pytorch(fused):
    """Self-attention with a causal mask and a key padding mask, as in the decoder."""
    ours, ref = mha_pair(fused)
    x = torch.randn(2, 6, D_MODEL)
    keep = lengths_to_mask([4, 6], 6)  # (B, T)
    mask = keep.unsqueeze(1) & at.causal_mask(6)  # (B, T, T): our convention
    out = ours(query=x, key=x, value=x, mask=mask)
    future = ~at.causal_mask(6)[0]  # (T, T): PyTorch's attn_mask has no batch dimension
    expected, _ = ref(x, x, x, attn_mask=future, key_padding_mask=~keep, need_weights=False)
    assert out.shape == (2, 6, D_MODEL)
    assert torch.allclose(out, expected, atol=ATOL)


@pytest.mark.numerics
@pytest.mark.parametrize("fused", [False, True], ids=["attention", "fused"])
def test_multi_head_cross_attention_equals_pytorch(fused):
    """Queries and keys of different lengths, with a (B, 1, T_k) key padding mask."""
    ours, ref = mha_pair(fused)
    query, memory = torch.randn(2, 3, D_MODEL), torch.randn(2, 7, D_MODEL)
    keep = lengths_to_mask([7, 4], 7)  # (B, T_k)
    out = ours(query=query, key=memory, value=memory, mask=keep.unsqueeze(1))
    expected, _ = ref(query, memory, memory, key_padding_mask=~keep, need_weights=False)
    assert out.shape == (2, 3, D_MODEL)
    assert torch.allclose(out, expected, atol=ATOL)
    unmasked, _ = ref(query, memory, memory, need_weights=False)
    assert not torch.allclose(out, unmasked, atol=1e-3), "the padding mask must matter"


def test_multi_head_attention_rejects_indivisible_width():
    """d_model must split evenly into h heads."""
    with pytest.raises(ValueError, match="d_model=10.*h=4"):
        at.MultiHeadAttention(4, 10, 0.0)


def test_the_first_forward_and_the_split_one_compute_the_same():
    """Part 5 cuts Part 1's forward into projections and attend(), for the cache: the
    class that trains has attend(), and its forward is Part 1's function."""
    block = at.MultiHeadAttention(HEADS, D_MODEL, 0.0).eval()
    x, keep = torch.randn(2, 5, D_MODEL), lengths_to_mask([5, 3], 5).unsqueeze(1)
    q, k, v = (block.split_heads(w(x)) for w in (block.w_q, block.w_k, block.w_v))
    out, _ = at.attention(query=q, key=k, value=v, mask=keep.unsqueeze(1))
    by_hand = block.w_o(out.transpose(1, 2).reshape(2, 5, D_MODEL))  # Part 1's last lines
    assert torch.allclose(block(query=x, key=x, value=x, mask=keep), by_hand, atol=ATOL)
    assert torch.allclose(block.attend(q, k, v, keep), by_hand, atol=ATOL)


def test_cpu_autocast_runs_our_attention_not_the_fused_kernel(monkeypatch):
    """The fused kernel's bf16 backward is slow on a CPU: under CPU autocast, ours runs."""
    torch.set_default_dtype(torch.float32)  # autocast casts float32 (the seed fixture resets)
    mha = bench.with_fused_attention(at.MultiHeadAttention(2, 16, 0.0)).eval()
    x = torch.randn(2, 5, 16)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernel was called")

    monkeypatch.setattr(bench.F, "scaled_dot_product_attention", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(query=x, key=x, value=x)
    assert out.dtype == torch.bfloat16
    with pytest.raises(AssertionError, match="fused kernel"):
        mha(query=x, key=x, value=x)  # outside autocast, FusedAttention does call it


# --- encoder and decoder layers ---------------------------------------------------------

D_FF = 32


@pytest.mark.numerics
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("fused", [False, True], ids=["attention", "fused"])
def test_encoder_layer_equals_pytorch(pre_norm, fused):
    """Our encoder layer computes nn.TransformerEncoderLayer, padded positions included."""
    config = at.LayerConfig(d_model=D_MODEL, h=HEADS, d_ff=D_FF, dropout=0.0)
    ours = kernel(at.EncoderLayer(dataclasses.replace(config, pre_norm=pre_norm)), fused)
    ref = nn.TransformerEncoderLayer(
        D_MODEL, HEADS, D_FF, dropout=0.0, batch_first=True, norm_first=pre_norm
    )
    randomise_norms(ours)
    at.copy_into_pytorch(ours.self_attn, ref.self_attn)
    ref.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    ref.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    ref.norm1.load_state_dict(ours.attn_sublayer.norm.state_dict())
    ref.norm2.load_state_dict(ours.ff_sublayer.norm.state_dict())
    ours.eval(), ref.eval()

    x = torch.randn(2, 5, D_MODEL)
    keep = lengths_to_mask([3, 5], 5)  # the first sentence ends in two padding tokens
    out = ours(x, keep.unsqueeze(1))
    # With autograd off, PyTorch takes its fused "fast path"; check it as well as the
    # plain path. Padded positions still attend to the real tokens in both, so every
    # position, padding included, must agree (nothing is zeroed).
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            expected = ref(x, src_key_padding_mask=~keep)
        assert torch.allclose(out, expected, atol=ATOL), f"grad enabled: {grad}"


@pytest.mark.numerics
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("fused", [False, True], ids=["attention", "fused"])
def test_decoder_layer_equals_pytorch(pre_norm, fused):
    """Our decoder layer computes nn.TransformerDecoderLayer with the same masks."""
    config = at.LayerConfig(d_model=D_MODEL, h=HEADS, d_ff=D_FF, dropout=0.0)
    ours = kernel(at.DecoderLayer(dataclasses.replace(config, pre_norm=pre_norm)), fused)
    ref = nn.TransformerDecoderLayer(
        D_MODEL, HEADS, D_FF, dropout=0.0, batch_first=True, norm_first=pre_norm
    )
    randomise_norms(ours)
    at.copy_into_pytorch(ours.self_attn, ref.self_attn)
    at.copy_into_pytorch(ours.cross_attn, ref.multihead_attn)
    ref.linear1.load_state_dict(ours.feed_forward.linear1.state_dict())
    ref.linear2.load_state_dict(ours.feed_forward.linear2.state_dict())
    ref.norm1.load_state_dict(ours.self_sublayer.norm.state_dict())
    ref.norm2.load_state_dict(ours.cross_sublayer.norm.state_dict())
    ref.norm3.load_state_dict(ours.ff_sublayer.norm.state_dict())
    ours.eval(), ref.eval()

    x, memory = torch.randn(2, 4, D_MODEL), torch.randn(2, 6, D_MODEL)
    src_keep = lengths_to_mask([6, 3], 6)  # (B, S)
    tgt_keep = lengths_to_mask([2, 4], 4)  # (B, T)
    tgt_mask = tgt_keep.unsqueeze(1) & at.causal_mask(4)  # (B, T, T)
    out = ours(x, memory, src_keep.unsqueeze(1), tgt_mask)
    expected = ref(
        x,
        memory,
        tgt_mask=~at.causal_mask(4)[0],  # (T, T)
        memory_key_padding_mask=~src_keep,
        tgt_key_padding_mask=~tgt_keep,
    )
    # Every query row keeps at least position 0, so padded positions agree as well.
    assert out.shape == (2, 4, D_MODEL)
    assert torch.allclose(out, expected, atol=ATOL)


# --- the assembled model ----------------------------------------------------------------

SRC_V, TGT_V, PAD = 11, 13, 0
SMALL = {"N": 2, "d_model": D_MODEL, "d_ff": D_FF, "h": HEADS, "dropout": 0.0}


def small_batch():
    """Two sentence pairs; the second of each is padded."""
    src = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 2, PAD, PAD]])
    tgt = torch.tensor([[1, 9, 10, 11, 2], [1, 12, 2, PAD, PAD]])
    return at.Batch(src, tgt, PAD)


def test_make_model_rejects_indivisible_width():
    """The error names both numbers that do not fit together."""
    with pytest.raises(ValueError, match="d_model=30") as error:
        at.make_model(SRC_V, TGT_V, at.ModelConfig(N=1, d_model=30, d_ff=8, h=4))
    assert "h=4" in str(error.value)


@pytest.mark.numerics
def test_small_model_output_shape_and_generator_distribution():
    """Decoder states are (B, T, d_model); the generator gives log-probs summing to 1."""
    model = at.make_model(SRC_V, TGT_V, at.ModelConfig(**SMALL)).eval()
    batch = small_batch()
    out = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    assert out.shape == (2, 4, D_MODEL)
    assert torch.isfinite(out).all()
    log_probs = model.generator(out)
    assert log_probs.shape == (2, 4, TGT_V)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 4), atol=1e-5)


def test_the_output_projection_is_the_target_embedding():
    """As in §3.4, the projection before the softmax and the target embedding are one tensor,
    counted once."""
    tied = at.make_model(SRC_V, TGT_V, at.ModelConfig(**SMALL))
    assert tied.generator.proj.weight is tied.tgt_embed[0].embedding.weight
    listed = sum(t.numel() for t in tied.state_dict().values())  # the tied matrix twice
    assert listed - at.count_parameters(tied) == TGT_V * D_MODEL


@pytest.mark.numerics
@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
def test_fused_and_plain_attention_give_the_same_model(pre_norm):
    """The fused kernel changes how attention is computed, not the function the model
    computes; the swap keeps the weights."""
    plain = at.make_model(SRC_V, TGT_V, at.ModelConfig(**SMALL, pre_norm=pre_norm)).eval()
    fused = bench.with_fused_attention(copy.deepcopy(plain))
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert isinstance(fused.decoder.layers[0].cross_attn, bench.FusedAttention)
    assert type(plain.decoder.layers[0].cross_attn) is at.MultiHeadAttention
    batch = small_batch()
    args = (batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    assert torch.allclose(fused(*args), plain(*args), atol=ATOL)


def test_dropout_sits_where_the_paper_puts_it():
    """Sub-layer outputs and embedding sums get P_drop; attention weights get none unless
    asked (the paper specifies none), and the FFN has no dropout module at all."""
    model = at.make_model(11, 11, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.1))
    layer = model.encoder.layers[0]
    assert layer.attn_sublayer.dropout.p == 0.1 and model.src_embed[1].dropout.p == 0.1
    assert layer.self_attn.dropout.p == 0.0
    assert not any(isinstance(m, nn.Dropout) for m in layer.feed_forward.modules())
    settings = at.Settings(name="t", N=1, d_model=16, d_ff=32, h=2, dropout=0.3)
    vocabs = {"de": at.Vocab([*at.SPECIALS, "x"]), "en": at.Vocab([*at.SPECIALS, "y"])}
    trained = at.model_for(settings, vocabs).encoder.layers[0]  # what the presets train
    assert trained.attn_sublayer.dropout.p == 0.3 and trained.self_attn.dropout.p == 0.0
    assert type(trained.self_attn) is at.MultiHeadAttention  # the lesson's attention() trains

# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The Annotated Transformer, rebuilt
#
# This notebook builds the model of *Attention Is All You Need* (Vaswani et al., 2017)
# from its parts, one cell at a time, and then teaches it to translate German into
# English on the Multi30k image-caption corpus. It runs on a laptop CPU in minutes and
# on a CUDA GPU as the paper's base model.
#
# How to read it:
#
# * Quotes and formulas from the paper stand in markdown cells right above the code
#   that computes them.
# * Our own remarks are set apart as block quotes, like this one:
#
# > Every code cell is followed by a small example that **asserts** what it shows, so
# > running the notebook from top to bottom is also a test of it.
#
# * Shapes use these letters: `B` batch size, `T` target length, `S` source length,
#   `h` number of heads, `d_k` size of one head, `V` vocabulary size.

# %% [markdown]
# ## Prelims
#
# Everything the notebook imports, in one place.

# %%
import contextlib
import dataclasses
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import altair as alt
import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# %% [markdown]
# One seed drives every random choice: weight initialisation, dropout, batch order and
# the synthetic data of the warm-up task. `set_seed` is called again wherever a result
# must not depend on what ran before it.


# %%
def set_seed(seed: int) -> None:
    """Seed Python, NumPy and PyTorch (CPU and every GPU) with one number."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


SEED = 42
set_seed(SEED)

# %% [markdown]
# ### Settings and presets
#
# All the knobs live in one frozen dataclass. A *preset* is a named instance of it.
# The environment variable `AT_PRESET` picks one: `smoke` (a tiny model on a slice of
# the data, for the test suite), `cpu` (a small model that trains on a laptop in about
# twenty minutes) or `gpu` (the paper's base model). Left unset, it is `gpu` when CUDA
# is available and `cpu` otherwise.


# %%
@dataclass(frozen=True)
class Settings:
    """Every setting of a run; a preset is a named instance."""

    name: str
    N: int = 6  # layers in the encoder stack and in the decoder stack
    d_model: int = 512  # width of every sub-layer's input and output
    d_ff: int = 2048  # inner width of the feed-forward sub-layer
    h: int = 8  # attention heads
    dropout: float = 0.1  # the paper's P_drop
    pre_norm: bool = False  # False is the paper's post-norm
    use_sdpa: bool = True  # PyTorch's fused attention kernel (same maths, faster)
    max_len: int = 64  # longest sentence, in tokens with <s> and </s>, kept for training
    train_pairs: int | None = None  # None uses all 29,000 training pairs
    eval_pairs: int | None = None  # None decodes every val/test sentence
    min_freq: int = 2  # a word seen fewer times in training becomes <unk>
    batch_tokens: int = 4000  # token budget of one micro-batch (padding included)
    accum_iter: int = 1  # micro-batches per optimizer step
    epochs: int = 10
    warmup: int = 4000  # optimizer steps of linear learning-rate warm-up
    lr_factor: float = 1.0  # multiplies the paper's learning-rate formula
    label_smoothing: float = 0.1  # the paper's epsilon_ls
    beam_size: int = 4  # the paper's beam size
    length_penalty: float = 0.6  # the paper's alpha
    seed: int = SEED


PRESETS = {
    "smoke": Settings(
        name="smoke",
        N=1,
        d_model=32,
        d_ff=64,
        h=2,
        train_pairs=2000,
        eval_pairs=100,
        batch_tokens=1500,
        accum_iter=2,
        epochs=2,
        warmup=40,
        beam_size=2,
    ),  # fmt: skip
    "cpu": Settings(
        name="cpu",
        N=3,
        d_model=256,
        d_ff=1024,
        h=4,
        batch_tokens=3000,
        epochs=9,
        warmup=800,
        lr_factor=1.0,
    ),  # fmt: skip
    "gpu": Settings(name="gpu", batch_tokens=12000, epochs=20, warmup=2000),
}


def get_settings(name: str | None = None) -> Settings:
    """Return the preset called `name`; None reads AT_PRESET, then picks gpu or cpu."""
    if name is None:
        name = os.environ.get("AT_PRESET") or ("gpu" if torch.cuda.is_available() else "cpu")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: set AT_PRESET to one of {', '.join(PRESETS)}")
    return PRESETS[name]


settings = get_settings()
print(settings)

# %% [markdown]
# A preset is frozen, so a change is a new object; `dataclasses.replace` makes one.

# %%
assert get_settings("gpu").d_model == 512 and get_settings("gpu").N == 6
assert dataclasses.replace(settings, epochs=1).epochs == 1
try:
    get_settings("laptop")
    raise AssertionError("an unknown preset must be refused")
except ValueError as error:
    assert "smoke, cpu, gpu" in str(error)
    print(error)

# %% [markdown]
# ## Background
#
# A translation model reads a sentence and writes another. Before 2017 the strongest
# ones were recurrent networks: they read the source one word at a time and carry
# everything they have seen in a single state vector that is updated at every step.
# Two things follow from that design. Training cannot run the positions of a sentence
# in parallel, because step `t` needs the state of step `t - 1`. And a word at the end
# of a long sentence reaches a word at its start only through every state in between,
# so the path that a gradient or a piece of information must travel grows with the
# distance.
#
# Convolutional models (ByteNet, ConvS2S) fixed the first problem but not quite the
# second: a stack of convolutions of width `k` needs about `n / k` or `log_k n` layers
# to connect two positions `n` apart.
#
# *Attention* connects any two positions in one step. For every position, the model
# computes a weighted average of the representations of all positions, with weights
# that depend on how well the two match. Earlier systems used attention as a bridge
# between a recurrent encoder and a recurrent decoder. The Transformer keeps only the
# attention: "the first transduction model relying entirely on self-attention to
# compute representations of its input and output without using sequence-aligned RNNs
# or convolution." Every position of a layer is computed at once, and the path between
# any two words is one layer long.
#
# The price is that an average forgets order and blurs detail. The paper pays it back
# with two devices that we build below: *positional encodings* (order) and *multi-head*
# attention (several averages side by side, each free to look at something different).

# %% [markdown]
# ## Part 1: the model
#
# The Transformer is an encoder-decoder. The encoder maps the source tokens
# $(x_1, \ldots, x_n)$ to vectors $z = (z_1, \ldots, z_n)$. The decoder then writes the
# output $(y_1, \ldots, y_m)$ one token at a time, and each step reads $z$ and the
# tokens written so far ("auto-regressive"). We build it bottom-up: embeddings and
# positions, attention, the feed-forward block, the residual wrapper, the layers, the
# stacks, and finally the assembled model.

# %% [markdown]
# ### Embeddings
#
# > "we use learned embeddings to convert the input tokens and output tokens to vectors
# > of dimension $d_{\text{model}}$ ... In the embedding layers, we multiply those
# > weights by $\sqrt{d_{\text{model}}}$."
#
# > Our note: the scaling keeps the embeddings on a similar scale to the positional
# > encodings that are added to them next (those lie in $[-1, 1]$).


# %%
class TokenEmbedding(nn.Module):
    """Look up a learned vector for every token id, scaled by sqrt(d_model)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.d_model = d_model

    def forward(self, tokens: Tensor) -> Tensor:
        # (B, T) -> (B, T, d_model)
        return self.embedding(tokens) * math.sqrt(self.d_model)


# %%
embed = TokenEmbedding(vocab_size=11, d_model=8)
assert embed(torch.tensor([[1, 2, 3]])).shape == (1, 3, 8)

# %% [markdown]
# ### Positional encoding
#
# Attention treats its input as a set, so the model must be told where each token
# stands. The paper adds a fixed vector to each embedding:
#
# $$PE_{(pos, 2i)} = \sin\left(pos / 10000^{2i/d_{\text{model}}}\right) \qquad
#   PE_{(pos, 2i+1)} = \cos\left(pos / 10000^{2i/d_{\text{model}}}\right)$$
#
# Each pair of dimensions is a sine and cosine of one frequency; the wavelengths form a
# geometric progression from $2\pi$ to $10000 \cdot 2\pi$. The paper chose this form
# because $PE_{pos+k}$ is a linear function of $PE_{pos}$ for any fixed offset $k$, which
# should make relative positions easy to attend to. Dropout is applied to the sum.


# %%
class PositionalEncoding(nn.Module):
    """Add the paper's sinusoidal position vectors, then apply dropout."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(max_len).unsqueeze(1)  # (max_len, 1)
        # 1 / 10000^(2i / d_model), computed in log space for accuracy
        inv_freq = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(position * inv_freq)  # even dimensions
        table[:, 1::2] = torch.cos(position * inv_freq)  # odd dimensions
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        T = x.size(1)
        # (B, T, d_model) + (T, d_model) broadcasts over the batch
        return self.dropout(x + self.table[:T])


# %% [markdown]
# The chart shows four dimensions of the encoding over the first 100 positions: low
# dimensions oscillate fast, higher ones slowly, so together they give each position a
# distinct pattern.

# %%
pe = PositionalEncoding(d_model=20, dropout=0.0)
pe_values = pe(torch.zeros(1, 100, 20))[0]  # (100, 20)
assert torch.allclose(pe_values[0, 1::2], torch.ones(10))  # cos(0) = 1
assert pe_values.abs().max() <= 1.0
pe_frame = pd.DataFrame(
    [
        {"position": p, "dimension": f"dim {d}", "value": pe_values[p, d].item()}
        for p in range(100)
        for d in (4, 5, 6, 7)
    ]
)
alt.Chart(pe_frame, title="Positional encoding, dimensions 4 to 7").mark_line().encode(
    x="position", y="value", color="dimension"
).properties(width=600, height=200)

# %% [markdown]
# ### Scaled dot-product attention
#
# > "An attention function can be described as mapping a query and a set of key-value
# > pairs to an output ... The output is computed as a weighted sum of the values, where
# > the weight assigned to each value is computed by a compatibility function of the
# > query with the corresponding key."
#
# $$\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\left(\frac{QK^T}{\sqrt{d_k}}\right)V$$
#
# The division by $\sqrt{d_k}$: if the entries of $q$ and $k$ have mean 0 and variance 1,
# their dot product has variance $d_k$. Large dot products push the softmax into regions
# where it is almost one-hot and its gradient almost zero; the scaling undoes that.
#
# > Our convention for masks, used everywhere below: a boolean tensor, `True` where a
# > query **may** attend to a key. Masked scores are set to the most negative float
# > rather than `-inf`, so a row that is entirely masked gives uniform weights instead
# > of `NaN`.


# %%
def attention(
    *, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, dropout=None
):
    """Return softmax(Q K^T / sqrt(d_k)) V and the attention weights."""
    d_k = query.size(-1)
    # Q K^T / sqrt(d_k): (..., T_q, d_k) @ (..., d_k, T_k) -> (..., T_q, T_k)
    scores = query @ key.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = scores.softmax(dim=-1)  # each row sums to 1
    if dropout is not None:
        weights = dropout(weights)
    # weighted sum of the values: (..., T_q, T_k) @ (..., T_k, d_v) -> (..., T_q, d_v)
    return weights @ value, weights


# %% [markdown]
# A query that matches one key much better than the others puts almost all its weight
# there; a masked key gets none.

# %%
q = torch.tensor([[[10.0, 0.0]]])  # (1, T_q=1, d_k=2)
k = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])  # (1, T_k=3, d_k=2)
v = torch.tensor([[[1.0], [2.0], [3.0]]])  # (1, T_k=3, d_v=1)
out, w = attention(query=q, key=k, value=v)
assert torch.allclose(w.sum(-1), torch.ones(1, 1)) and w[0, 0, 1] < 0.01
out, w = attention(query=q, key=k, value=v, mask=torch.tensor([[[True, True, False]]]))
assert w[0, 0, 2] == 0 and torch.allclose(out, torch.tensor([[[1.0]]]), atol=1e-3)

# %% [markdown]
# ### Multi-head attention
#
# > "Instead of performing a single attention function with $d_{\text{model}}$-dimensional
# > keys, values and queries, we found it beneficial to linearly project the queries,
# > keys and values $h$ times with different, learned linear projections to $d_k$, $d_k$
# > and $d_v$ dimensions, respectively."
#
# $$\mathrm{MultiHead}(Q, K, V) = \mathrm{Concat}(\mathrm{head_1}, \ldots,
#   \mathrm{head_h})W^O \quad \text{where}\ \mathrm{head_i} =
#   \mathrm{Attention}(QW_i^Q, KW_i^K, VW_i^V)$$
#
# with $d_k = d_v = d_{\text{model}} / h$, so the whole block costs about as much as one
# head of full width. We compute all heads at once: one $d_{\text{model}} \times
# d_{\text{model}}$ projection, then a reshape that splits the last axis into `h` heads.
#
# > Two switches, both off the paper's path. `use_sdpa` calls PyTorch's fused
# > `scaled_dot_product_attention`, the same formula in one optimised kernel (a test
# > checks they agree). `keep_weights` asks the block to keep its last attention
# > weights for the heatmaps at the end; it is off by default, so training stores
# > nothing it does not need.


# %%
class MultiHeadAttention(nn.Module):
    """h attention heads over learned projections, concatenated and projected by W^O."""

    def __init__(self, h: int, d_model: int, dropout: float, use_sdpa: bool = False):
        super().__init__()
        if d_model % h != 0:
            raise ValueError(f"d_model={d_model} must be divisible by h={h}: pick another h")
        self.h, self.d_k = h, d_model // h
        self.w_q = nn.Linear(d_model, d_model)  # the h matrices W_i^Q side by side
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)
        self.use_sdpa = use_sdpa
        self.keep_weights = False  # set True to keep the last weights in .weights
        self.weights: Tensor | None = None

    def split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

    def forward(self, *, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None):
        B, T_q, d_model = query.shape
        q = self.split_heads(self.w_q(query))  # (B, h, T_q, d_k)
        k = self.split_heads(self.w_k(key))  # (B, h, T_k, d_k)
        v = self.split_heads(self.w_v(value))  # (B, h, T_k, d_k)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (B, 1, T_q or 1, T_k): one mask for every head
        if self.use_sdpa and not self.keep_weights:
            p = self.dropout.p if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            out, weights = attention(query=q, key=k, value=v, mask=mask, dropout=self.dropout)
            self.weights = weights.detach() if self.keep_weights else None
        # Concat(head_1, ..., head_h): (B, h, T_q, d_k) -> (B, T_q, h * d_k)
        out = out.transpose(1, 2).reshape(B, T_q, d_model)
        return self.w_o(out)


# %%
mha = MultiHeadAttention(h=4, d_model=16, dropout=0.0)
x = torch.randn(2, 5, 16)
assert mha(query=x, key=x, value=x).shape == (2, 5, 16)
try:
    MultiHeadAttention(h=3, d_model=16, dropout=0.0)
    raise AssertionError("d_model not divisible by h must be refused")
except ValueError as error:
    print(error)

# %% [markdown]
# The model uses this block in three places: the encoder's self-attention (queries, keys
# and values all from the previous encoder layer), the decoder's self-attention (masked
# so that a position sees only earlier positions), and the decoder's encoder-decoder
# attention (queries from the decoder, keys and values from the encoder's output).

# %% [markdown]
# ### Position-wise feed-forward network
#
# > "each of the layers in our encoder and decoder contains a fully connected
# > feed-forward network, which is applied to each position separately and identically."
#
# $$\mathrm{FFN}(x) = \max(0, xW_1 + b_1)W_2 + b_2$$
#
# with inner width $d_{ff} = 2048$ in the base model. The paper's residual dropout is
# applied outside (next section); like PyTorch's own layers we also drop out the
# hidden activations.


# %%
class FeedForward(nn.Module):
    """max(0, x W_1 + b_1) W_2 + b_2, applied to every position."""

    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        # (B, T, d_model) -> (B, T, d_ff) -> (B, T, d_model)
        return self.linear2(self.dropout(torch.relu(self.linear1(x))))


# %%
assert FeedForward(d_model=8, d_ff=32, dropout=0.0)(torch.randn(2, 3, 8)).shape == (2, 3, 8)

# %% [markdown]
# ### Residual connection and layer normalisation
#
# > "We employ a residual connection around each of the two sub-layers, followed by layer
# > normalization. That is, the output of each sub-layer is
# > $\mathrm{LayerNorm}(x + \mathrm{Sublayer}(x))$ ... We apply dropout to the output of
# > each sub-layer, before it is added to the sub-layer input and normalized."
#
# > **Post-norm versus pre-norm.** The formula above normalises *after* the addition
# > ("post-norm"), which is what the paper did. Many later models (and the well-known
# > 2018 notebook, without saying so) normalise the sub-layer's *input* instead:
# > $x + \mathrm{Sublayer}(\mathrm{LayerNorm}(x))$ ("pre-norm"). The difference matters
# > for training. In post-norm every residual sum passes through a normalisation, so the
# > gradient reaching the early layers is rescaled many times; deep post-norm models
# > need the learning-rate warm-up to train at all. In pre-norm the residual path from
# > the input to the output is a plain sum, gradients flow through it undisturbed, and
# > training is more forgiving, often working with little or no warm-up. The cost is
# > that the sum grows layer by layer, so a pre-norm stack needs one last layer norm at
# > its top, and post-norm tends to end slightly better when it does train well
# > (Xiong et al., 2020, "On Layer Normalization in the Transformer Architecture").
# > We follow the paper by default; `pre_norm=True` switches every layer.


# %%
class ResidualSublayer(nn.Module):
    """Residual connection with dropout and LayerNorm, post-norm or pre-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            # x + Dropout(Sublayer(LayerNorm(x)))
            return x + self.dropout(sublayer(self.norm(x)))
        # LayerNorm(x + Dropout(Sublayer(x))), the paper's form
        return self.norm(x + self.dropout(sublayer(x)))


# %%
post = ResidualSublayer(d_model=8, dropout=0.0)
pre = ResidualSublayer(d_model=8, dropout=0.0, pre_norm=True)
x = torch.randn(2, 3, 8)
y = post(x, lambda t: 2 * t)
assert torch.allclose(y.mean(-1), torch.zeros(2, 3), atol=1e-5)  # output is normalised
assert torch.allclose(pre(x, lambda t: torch.zeros_like(t)), x)  # identity path is kept

# %% [markdown]
# ### Encoder
#
# > "The encoder is composed of a stack of $N = 6$ identical layers. Each layer has two
# > sub-layers. The first is a multi-head self-attention mechanism, and the second is a
# > simple, position-wise fully connected feed-forward network."


# %%
class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each inside a residual sub-layer."""

    def __init__(self, d_model: int, h: int, d_ff: int, dropout: float, **options):
        super().__init__()
        pre_norm, use_sdpa = options.get("pre_norm", False), options.get("use_sdpa", False)
        self.self_attn = MultiHeadAttention(h, d_model, dropout, use_sdpa)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.attn_sublayer = ResidualSublayer(d_model, dropout, pre_norm)
        self.ff_sublayer = ResidualSublayer(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        x = self.attn_sublayer(x, lambda t: self.self_attn(query=t, key=t, value=t, mask=src_mask))
        return self.ff_sublayer(x, self.feed_forward)


class Encoder(nn.Module):
    """A stack of N encoder layers (plus a final LayerNorm when pre-norm)."""

    def __init__(self, layers: list[EncoderLayer], d_model: int, pre_norm: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.final_norm(x)


# %%
layer = EncoderLayer(d_model=16, h=4, d_ff=32, dropout=0.0)
encoder = Encoder([layer], d_model=16)
src_mask = torch.tensor([[[True, True, True, False]]])  # (B=1, 1, S=4): last is padding
assert encoder(torch.randn(1, 4, 16), src_mask).shape == (1, 4, 16)

# %% [markdown]
# ### Decoder
#
# > "In addition to the two sub-layers in each encoder layer, the decoder inserts a third
# > sub-layer, which performs multi-head attention over the output of the encoder stack
# > ... We also modify the self-attention sub-layer in the decoder stack to prevent
# > positions from attending to subsequent positions."
#
# The self-attention mask is built in Part 2 (`causal_mask`); here the decoder simply
# takes it as an argument.


# %%
class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then feed-forward."""

    def __init__(self, d_model: int, h: int, d_ff: int, dropout: float, **options):
        super().__init__()
        pre_norm, use_sdpa = options.get("pre_norm", False), options.get("use_sdpa", False)
        self.self_attn = MultiHeadAttention(h, d_model, dropout, use_sdpa)
        self.cross_attn = MultiHeadAttention(h, d_model, dropout, use_sdpa)
        self.feed_forward = FeedForward(d_model, d_ff, dropout)
        self.self_sublayer = ResidualSublayer(d_model, dropout, pre_norm)
        self.cross_sublayer = ResidualSublayer(d_model, dropout, pre_norm)
        self.ff_sublayer = ResidualSublayer(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        x = self.self_sublayer(x, lambda t: self.self_attn(query=t, key=t, value=t, mask=tgt_mask))
        x = self.cross_sublayer(
            x, lambda t: self.cross_attn(query=t, key=memory, value=memory, mask=src_mask)
        )
        return self.ff_sublayer(x, self.feed_forward)


class Decoder(nn.Module):
    """A stack of N decoder layers (plus a final LayerNorm when pre-norm)."""

    def __init__(self, layers: list[DecoderLayer], d_model: int, pre_norm: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.final_norm = nn.LayerNorm(d_model) if pre_norm else nn.Identity()

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.final_norm(x)


# %%
decoder = Decoder([DecoderLayer(d_model=16, h=4, d_ff=32, dropout=0.0)], d_model=16)
memory = torch.randn(1, 4, 16)  # (B, S, d_model) from the encoder
tgt_mask = torch.ones(3, 3, dtype=torch.bool).tril().unsqueeze(0)  # (1, T=3, T=3)
assert decoder(torch.randn(1, 3, 16), memory, src_mask, tgt_mask).shape == (1, 3, 16)

# %% [markdown]
# ### Output generator
#
# > "We also use the usual learned linear transformation and softmax function to convert
# > the decoder output to predicted next-token probabilities."
#
# We return log-probabilities (`log_softmax`): the loss needs them, and they are
# numerically safer than probabilities followed by a log.


# %%
class Generator(nn.Module):
    """Linear projection to the vocabulary, then log-softmax."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.proj = nn.Linear(d_model, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        # (B, T, d_model) -> (B, T, V) log-probabilities
        return F.log_softmax(self.proj(x), dim=-1)


# %%
log_probs = Generator(d_model=16, vocab_size=11)(torch.randn(2, 3, 16))
assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 3))

# %% [markdown]
# ### The full model
#
# The encoder-decoder ties the pieces together: embed and position the source, encode
# it once, then decode the target prefix against that memory. `encode` and `decode` are
# separate methods because generation calls `decode` many times per `encode`.


# %%
class EncoderDecoder(nn.Module):
    """Embeddings, encoder, decoder and generator of the Transformer."""

    def __init__(self, src_embed, tgt_embed, encoder, decoder, generator):
        super().__init__()
        self.src_embed, self.tgt_embed = src_embed, tgt_embed
        self.encoder, self.decoder, self.generator = encoder, decoder, generator

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        return self.encoder(self.src_embed(src), src_mask)  # (B, S, d_model)

    def decode(self, memory: Tensor, src_mask: Tensor, tgt: Tensor, tgt_mask: Tensor) -> Tensor:
        return self.decoder(self.tgt_embed(tgt), memory, src_mask, tgt_mask)  # (B, T, d_model)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        """Return decoder states (B, T, d_model); apply .generator for log-probs."""
        return self.decode(self.encode(src, src_mask), src_mask, tgt, tgt_mask)


# %% [markdown]
# `make_model` builds one with the paper's base sizes as defaults.
#
# > Two choices the paper does not spell out, flagged here. *Initialisation*: every
# > weight matrix starts Glorot/Xavier-uniform, as in the paper's reference code.
# > *Weight sharing*: the paper shares one matrix between both embeddings and the
# > output projection, which works because it uses one joint sub-word vocabulary. We
# > keep separate German and English vocabularies, so we share only what can be
# > shared: the target embedding and the generator's projection (`tie_output=True`).
# > It saves `V x d_model` parameters and helps on a corpus as small as Multi30k.


# %%
def make_model(
    src_vocab: int, tgt_vocab: int, *, N=6, d_model=512, d_ff=2048, h=8, dropout=0.1, **options
) -> EncoderDecoder:
    """Build a Transformer; options: pre_norm, use_sdpa, max_len, tie_output."""
    if d_model % h != 0:
        raise ValueError(f"d_model={d_model} must be divisible by h={h}: pick another h")
    pre_norm, max_len = options.get("pre_norm", False), options.get("max_len", 5000)
    layer_options = {"pre_norm": pre_norm, "use_sdpa": options.get("use_sdpa", False)}
    enc_layers = [EncoderLayer(d_model, h, d_ff, dropout, **layer_options) for _ in range(N)]
    dec_layers = [DecoderLayer(d_model, h, d_ff, dropout, **layer_options) for _ in range(N)]
    model = EncoderDecoder(
        src_embed=nn.Sequential(
            TokenEmbedding(src_vocab, d_model), PositionalEncoding(d_model, dropout, max_len)
        ),
        tgt_embed=nn.Sequential(
            TokenEmbedding(tgt_vocab, d_model), PositionalEncoding(d_model, dropout, max_len)
        ),
        encoder=Encoder(enc_layers, d_model, pre_norm),
        decoder=Decoder(dec_layers, d_model, pre_norm),
        generator=Generator(d_model, tgt_vocab),
    )
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    if options.get("tie_output", True):
        model.generator.proj.weight = model.tgt_embed[0].embedding.weight
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# %% [markdown]
# The base model with vocabularies of the size we will build for Multi30k (about 8,000
# German and 6,000 English words): 6 + 6 layers, $d_{\text{model}} = 512$. Of its
# parameters, the two embedding tables hold about a seventh; the rest are in the
# layers. The paper reports 65 million for its base model with a 37,000-token shared
# vocabulary.

# %%
base = make_model(8000, 6000)
n_base = count_parameters(base)
print(f"base model: {n_base:,} parameters")
per_encoder_layer = 4 * (512 * 512 + 512) + (512 * 2048 + 2048) + (2048 * 512 + 512) + 2 * 2 * 512
assert count_parameters(base.encoder.layers[0]) == per_encoder_layer
assert 50_000_000 < n_base < 60_000_000
del base

# %% [markdown]
# ## Part 2: training machinery
#
# Now the parts that turn the model into something that learns: batches with masks,
# the loss with label smoothing, the learning-rate schedule, one epoch of training with
# gradient accumulation, and greedy decoding. We then prove they work together on a
# toy task.

# %% [markdown]
# ### Batches and masks
#
# The decoder is trained with *teacher forcing*: it is given the true target shifted
# right by one (starting with `<s>`) and must predict the target shifted left (ending
# with `</s>`). Two masks go with a batch:
#
# * the **padding mask** hides padding positions of the source (and of the target)
#   from attention, since sentences of one batch have different lengths;
# * the **causal mask** stops target position $i$ from seeing positions $> i$:
#   at inference those tokens do not exist yet, so training must not peek at them.


# %%
def causal_mask(size: int, device=None) -> Tensor:
    """(1, size, size) boolean mask, True where query i may see key j (j <= i)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril().unsqueeze(0)


class Batch:
    """Source, shifted target input and output, their masks and the real-token count."""

    def __init__(self, src: Tensor, tgt: Tensor, pad_id: int):
        self.src = src  # (B, S)
        self.src_mask = (src != pad_id).unsqueeze(-2)  # (B, 1, S)
        self.tgt_in = tgt[:, :-1]  # (B, T): <s> y_1 ... y_{T-1}
        self.tgt_out = tgt[:, 1:]  # (B, T): y_1 ... y_T </s>, what must be predicted
        T = self.tgt_in.size(1)
        padding = (self.tgt_in != pad_id).unsqueeze(-2)  # (B, 1, T)
        self.tgt_mask = padding & causal_mask(T, tgt.device)  # (B, T, T)
        self.ntokens = int((self.tgt_out != pad_id).sum())

    def to(self, device) -> "Batch":
        """Move every tensor of the batch to `device`."""
        for name in ("src", "src_mask", "tgt_in", "tgt_out", "tgt_mask"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self


# %% [markdown]
# The causal mask for a target of 10 tokens: row $i$ is the query position, column $j$
# the key position, and the coloured cells are what position $i$ may look at.

# %%
mask = causal_mask(10)[0]
assert mask[3, 3] and mask[3, 0] and not mask[3, 4]
mask_frame = pd.DataFrame(
    [{"query": i, "key": j, "may attend": bool(mask[i, j])} for i in range(10) for j in range(10)]
)
alt.Chart(mask_frame, title="Causal mask").mark_rect().encode(
    x="key:O", y="query:O", color="may attend:N"
).properties(width=220, height=220)

# %%
example = Batch(src=torch.tensor([[5, 6, 7, 0]]), tgt=torch.tensor([[1, 8, 9, 2, 0]]), pad_id=0)
assert example.tgt_in.tolist() == [[1, 8, 9, 2]] and example.tgt_out.tolist() == [[8, 9, 2, 0]]
assert example.src_mask.tolist() == [[[True, True, True, False]]]
assert example.ntokens == 3  # y_1, y_2 and </s>; the padding does not count
short = Batch(src=torch.tensor([[5, 6]]), tgt=torch.tensor([[1, 8, 2, 0, 0]]), pad_id=0)
assert not short.tgt_mask[0, :, 3].any()  # no query may attend to a padding key
assert short.tgt_mask[0, 2].tolist() == [True, True, True, False]

# %% [markdown]
# ### Training state
#
# A small record of progress that the training loop updates and checkpoints save.


# %%
@dataclass
class TrainState:
    """Counters of a training run."""

    step: int = 0  # optimizer steps taken
    micro_batches: int = 0  # forward/backward passes, accumulation included
    samples: int = 0  # sentence pairs seen
    tokens: int = 0  # real target tokens seen


# %% [markdown]
# ### Label smoothing
#
# > "During training, we employed label smoothing of value $\epsilon_{ls} = 0.1$. This
# > hurts perplexity, as the model learns to be more unsure, but improves accuracy and
# > BLEU score."
#
# Instead of a one-hot target, the correct word gets probability $1 - \epsilon$ and the
# remaining $\epsilon$ is spread evenly over the other words, except padding (which is
# never a right answer). The loss is the Kullback-Leibler divergence from that smoothed
# distribution $q$ to the model's $p$:
#
# $$\mathrm{KL}(q \,\|\, p) = \sum_w q(w) \log q(w) - \sum_w q(w) \log p(w)$$
#
# that is, cross-entropy against $q$ minus the entropy of $q$. The entropy is a constant,
# so it changes the value but not the gradient; thanks to it a perfect prediction scores
# exactly 0. Target positions that are padding contribute nothing.
#
# > The well-known notebook's demo of this loss printed `inf`: it fed probabilities
# > containing exact zeros, whose log is $-\infty$. We always pass log-probabilities
# > from `log_softmax`, which are finite.


# %%
class LabelSmoothing(nn.Module):
    """KL divergence to a smoothed one-hot target; returns the sum over real tokens."""

    def __init__(self, vocab_size: int, pad_id: int, smoothing: float = 0.1):
        super().__init__()
        self.kl = nn.KLDivLoss(reduction="sum")
        self.vocab_size, self.pad_id, self.smoothing = vocab_size, pad_id, smoothing

    def smoothed_target(self, target: Tensor) -> Tensor:
        """(n,) token ids -> (n, V) distribution: 1 - eps on the answer, eps spread."""
        # eps over V - 2 words: neither the right answer nor padding
        dist = torch.full((target.size(0), self.vocab_size), self.smoothing / (self.vocab_size - 2))
        dist = dist.to(target.device)
        dist.scatter_(1, target.unsqueeze(1), 1.0 - self.smoothing)
        dist[:, self.pad_id] = 0.0
        dist[target == self.pad_id] = 0.0  # padding positions carry no loss
        return dist

    def forward(self, log_probs: Tensor, target: Tensor) -> Tensor:
        # log_probs (n, V), target (n,)
        return self.kl(log_probs, self.smoothed_target(target))


# %% [markdown]
# The smoothed targets of three positions in a vocabulary of five words, where word 0
# is padding and the third position is padding itself:

# %%
smoothing = LabelSmoothing(vocab_size=5, pad_id=0, smoothing=0.4)
target_dist = smoothing.smoothed_target(torch.tensor([2, 1, 0]))
assert torch.allclose(target_dist[0], torch.tensor([0.0, 0.4 / 3, 0.6, 0.4 / 3, 0.4 / 3]))
assert target_dist[2].sum() == 0
dist_frame = pd.DataFrame(
    [
        {"position": f"position {i}", "word": w, "target probability": target_dist[i, w].item()}
        for i in range(3)
        for w in range(5)
    ]
)
alt.Chart(dist_frame, title="Smoothed targets (eps = 0.4, word 0 = padding)").mark_rect().encode(
    x="word:O", y="position:N", color="target probability:Q"
).properties(width=200, height=90)

# %% [markdown]
# How the loss reacts to confidence. We give the model a growing logit for the right
# word and watch the loss: it falls, then rises again once the model is more confident
# than the smoothed target allows. That is the regularising effect: overconfidence is
# penalised. Every value is finite.

# %%
criterion = LabelSmoothing(vocab_size=5, pad_id=0, smoothing=0.1)
losses = []
for confidence in range(1, 60):
    logits = torch.tensor([[0.0, 0.0, float(confidence), 0.0, 0.0]])
    losses.append(criterion(F.log_softmax(logits, dim=-1), torch.tensor([2])).item())
assert all(math.isfinite(value) for value in losses)
best = int(np.argmin(losses))
assert 0 < best < len(losses) - 1  # a minimum in the middle: too confident costs loss
alt.Chart(
    pd.DataFrame({"logit of the right word": range(1, 60), "loss": losses})
).mark_line().encode(x="logit of the right word", y="loss").properties(
    width=400, height=180, title="Label-smoothed loss against confidence"
)

# %% [markdown]
# ### Optimizer and learning-rate schedule
#
# > "We used the Adam optimizer with $\beta_1 = 0.9$, $\beta_2 = 0.98$ and
# > $\epsilon = 10^{-9}$. We varied the learning rate over the course of training,
# > according to the formula:"
#
# $$lrate = d_{\text{model}}^{-0.5} \cdot \min(step\_num^{-0.5},\;
#   step\_num \cdot warmup\_steps^{-1.5})$$
#
# It rises linearly for `warmup` steps (the paper: 4000) and then decays with the
# inverse square root of the step. The peak is at `step = warmup`, where both terms of
# the `min` are equal.
#
# > We add a `factor` that multiplies the formula (1.0 is the paper's). PyTorch's
# > `LambdaLR` calls the schedule with step 0 before training starts; the formula is
# > undefined there, so we treat step 0 as step 1.


# %%
def rate(step: int, *, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The paper's learning rate at optimizer step `step` (counted from 1)."""
    step = max(step, 1)
    # d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def make_optimizer(model: nn.Module, settings: Settings, fused: bool = False):
    """Adam with the paper's betas and eps, driven by `rate` through LambdaLR."""
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9, fused=fused or None
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: rate(
            step + 1, d_model=settings.d_model, warmup=settings.warmup, factor=settings.lr_factor
        ),
    )
    return optimizer, schedule


# %% [markdown]
# Three settings of $(d_{\text{model}}, warmup)$: a wider model gets a lower peak, and
# a longer warm-up a later, lower one.

# %%
schedule_frame = pd.DataFrame(
    [
        {
            "step": s,
            "setting": f"d_model={d}, warmup={w}",
            "learning rate": rate(s, d_model=d, warmup=w),
        }
        for d, w in [(512, 4000), (512, 8000), (256, 4000)]
        for s in range(1, 20001, 100)
    ]
)
assert rate(4000, d_model=512, warmup=4000) > rate(3900, d_model=512, warmup=4000)
assert rate(4000, d_model=512, warmup=4000) > rate(4100, d_model=512, warmup=4000)
alt.Chart(schedule_frame, title="Learning-rate schedule").mark_line().encode(
    x="step", y="learning rate", color="setting"
).properties(width=500, height=220)

# %% [markdown]
# ### Running an epoch, with gradient accumulation
#
# `run_epoch` makes one pass over a list of batches. With an optimizer it trains;
# without one it evaluates, under `torch.no_grad()` and in eval mode (no dropout).
#
# *Gradient accumulation* imitates a batch `accum_iter` times larger than fits in
# memory: the gradients of several micro-batches are summed before one optimizer step.
# For the sum to be the gradient of the big batch's mean loss, each micro-batch's loss
# (a mean over its tokens) is divided by the number of micro-batches in its group. The
# last group of an epoch may be shorter; it is divided by its own size and still gets
# its optimizer step, so no gradient is left over for the next epoch. The schedule
# advances once per optimizer step, not per micro-batch.
#
# > The loss we report is the mean per real target token, summed over the whole
# > epoch before dividing, so batches with more tokens weigh more.


# %%
def batch_loss(model: EncoderDecoder, criterion: LabelSmoothing, batch: Batch) -> Tensor:
    """Summed label-smoothed loss of one batch under teacher forcing."""
    out = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)  # (B, T, d_model)
    log_probs = model.generator(out)  # (B, T, V)
    return criterion(log_probs.reshape(-1, log_probs.size(-1)).float(), batch.tgt_out.reshape(-1))


def group_size(i: int, n: int, accum_iter: int) -> int:
    """How many micro-batches share the optimizer step of micro-batch i (of n)."""
    return min(accum_iter, n - (i - i % accum_iter))


# %%
def run_epoch(
    batches: Sequence[Batch], model, criterion, *, optimizer=None, schedule=None, **options
) -> float:
    """Train (with an optimizer) or evaluate over `batches`; return mean loss per token.

    options: accum_iter (default 1), state (a TrainState to update), autocast (a
    context-manager factory), sync (a factory that takes "is this the last micro-batch
    before a step?" and returns a context, for DistributedDataParallel's no_sync),
    progress (a callable given the loss and token count after every batch).
    """
    training = optimizer is not None
    accum_iter, state = options.get("accum_iter", 1), options.get("state") or TrainState()
    autocast = options.get("autocast", contextlib.nullcontext)
    sync, progress = (
        options.get("sync", lambda last: contextlib.nullcontext()),
        options.get("progress"),
    )
    model.train(training)
    total_loss, total_tokens, n = 0.0, 0, len(batches)
    with torch.enable_grad() if training else torch.no_grad():
        for i, batch in enumerate(batches):
            steps_now = training and ((i + 1) % accum_iter == 0 or i + 1 == n)
            with sync(steps_now), autocast():
                loss_sum = batch_loss(model, criterion, batch)
            if training:
                with sync(steps_now):
                    (loss_sum / batch.ntokens / group_size(i, n, accum_iter)).backward()
                state.micro_batches += 1
                state.samples += batch.src.size(0)
                state.tokens += batch.ntokens
            if steps_now:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                schedule.step()
                state.step += 1
            total_loss += loss_sum.item()
            total_tokens += batch.ntokens
            if progress is not None:
                progress(loss_sum.item() / max(batch.ntokens, 1), batch.ntokens)
    return total_loss / max(total_tokens, 1)


# %% [markdown]
# ### Greedy decoding
#
# At inference there is no target to feed. We encode the source once, start every
# sentence with `<s>`, and repeatedly append the most probable next token. The batch
# is decoded together; a sentence that has produced `</s>` gets padding from then on,
# and the loop ends as soon as every sentence has finished (or at `max_len`).


# %%
@torch.no_grad()
def greedy_decode(model, src: Tensor, src_mask: Tensor, max_len: int, *, start_id, end_id, pad_id):
    """Decode a batch greedily; return (B, <= max_len) ids starting with <s>."""
    model.eval()
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    B = src.size(0)
    ys = torch.full((B, 1), start_id, dtype=torch.long, device=src.device)  # (B, 1)
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)
    for _ in range(max_len - 1):
        out = model.decode(memory, src_mask, ys, causal_mask(ys.size(1), src.device))
        next_word = model.generator(out[:, -1]).argmax(dim=-1)  # (B,)
        next_word = next_word.masked_fill(finished, pad_id)
        ys = torch.cat([ys, next_word.unsqueeze(1)], dim=1)  # (B, t + 1)
        finished |= next_word == end_id
        if finished.all():
            break
    return ys


# %% [markdown]
# ## A first test: the copy task
#
# Before real data, a warm-up that isolates the machinery: the model sees a random
# sequence of digits and must output the same sequence. A working Transformer learns
# this in a minute on a CPU; a bug in masks, shifting or the loss shows up at once.
#
# The toy vocabulary has its own special ids: padding 0, start 1, end 2, and words
# 3 to 12. The start symbol is deliberately not the padding id (the well-known
# notebook used 0 for both, which hides mask bugs).

# %%
COPY_PAD, COPY_START, COPY_END, COPY_VOCAB = 0, 1, 2, 13


def copy_batch(batch_size: int, length: int, generator: torch.Generator) -> Batch:
    """Random sequences <s> w_1..w_length </s>; the target equals the source."""
    words = torch.randint(3, COPY_VOCAB, (batch_size, length), generator=generator)
    start = torch.full((batch_size, 1), COPY_START)
    end = torch.full((batch_size, 1), COPY_END)
    seq = torch.cat([start, words, end], dim=1)  # (B, length + 2)
    return Batch(src=seq, tgt=seq.clone(), pad_id=COPY_PAD)


# %%
copy_example = copy_batch(2, 5, torch.Generator().manual_seed(0))
assert copy_example.src.shape == (2, 7) and copy_example.ntokens == 2 * 6
assert (copy_example.src[:, 0] == COPY_START).all() and (copy_example.src != COPY_PAD).all()

# %% [markdown]
# Training: a two-layer model of width 64, Adam with the paper's schedule (a short
# warm-up, since we take only a few hundred steps), no label smoothing (a copy has one
# right answer) and gradient accumulation over two micro-batches, to exercise it.


# %%
def train_copy_task(epochs: int = 15, batches_per_epoch: int = 40, seed: int = SEED):
    """Train a small Transformer to copy digit sequences; return it."""
    set_seed(seed)
    model = make_model(COPY_VOCAB, COPY_VOCAB, N=2, d_model=64, d_ff=128, h=4, dropout=0.0)
    copy_settings = Settings(name="copy", d_model=64, warmup=100)
    optimizer, schedule = make_optimizer(model, copy_settings)
    criterion = LabelSmoothing(COPY_VOCAB, COPY_PAD, smoothing=0.0)
    data = torch.Generator().manual_seed(seed)
    state = TrainState()
    for epoch in range(epochs):
        batches = [copy_batch(64, 10, data) for _ in range(batches_per_epoch)]
        run_epoch(
            batches,
            model,
            criterion,
            optimizer=optimizer,
            schedule=schedule,
            accum_iter=2,
            state=state,
        )
        val_loss = run_epoch([copy_batch(64, 10, data) for _ in range(4)], model, criterion)
        print(f"epoch {epoch:2d}  optimizer steps {state.step:4d}  validation loss {val_loss:.4f}")
    return model


# %%
if __name__ == "__main__":  # runs in the notebook; importing the .py twin skips it
    copy_model = train_copy_task()
    held_out = copy_batch(32, 10, torch.Generator().manual_seed(12345))
    copied = greedy_decode(
        copy_model, held_out.src, held_out.src_mask, max_len=12,
        start_id=COPY_START, end_id=COPY_END, pad_id=COPY_PAD,
    )  # fmt: skip
    print("source:", held_out.src[0].tolist())
    print("output:", copied[0].tolist())
    assert torch.equal(copied, held_out.src), (
        "the copy model must reproduce every held-out sequence"
    )

"""Training machinery: batches, the loss, the schedule and run_epoch."""

import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from torch import nn

import annotated_transformer as at

PAD, START, END, V = 0, 1, 2, 11


@pytest.fixture(autouse=True)
def seed():
    at.set_seed(0)


def random_batch(batch_size=2, length=4):
    """<s> w_1 .. w_length </s> pairs with no padding: every batch has the same token count."""

    def sentence():
        start, end = torch.full((batch_size, 1), START), torch.full((batch_size, 1), END)
        return torch.cat([start, torch.randint(3, V, (batch_size, length)), end], dim=1)

    return at.Batch(sentence(), sentence(), PAD)


def concat(batches):
    """One batch holding the sentence pairs of several equally long batches."""
    src = torch.cat([b.src for b in batches])
    # the full target is tgt_in followed by the last token of tgt_out
    tgt = torch.cat([torch.cat([b.tgt_in, b.tgt_out[:, -1:]], 1) for b in batches])
    return at.Batch(src, tgt, PAD)


# --- Batch ------------------------------------------------------------------------------


def test_batch_shifts_target_and_builds_masks():
    """tgt_in drops the last token, tgt_out the first; masks are (B,1,S) and (B,T,T)."""
    src = torch.tensor([[1, 5, 6, 2], [1, 7, 2, PAD]])
    tgt = torch.tensor([[1, 8, 9, 10, 2], [1, 8, 2, PAD, PAD]])
    batch = at.Batch(src, tgt, PAD)
    assert torch.equal(batch.tgt_in, tgt[:, :-1]) and torch.equal(batch.tgt_out, tgt[:, 1:])
    assert batch.src_mask.shape == (2, 1, 4) and batch.src_mask.dtype == torch.bool
    assert batch.src_mask[:, 0].tolist() == [[True] * 4, [True, True, True, False]]
    assert batch.tgt_mask.shape == (2, 4, 4)
    assert torch.equal(batch.tgt_mask[0], torch.ones(4, 4, dtype=torch.bool).tril())
    # the second target's input is <s> 8 2 <pad>: nobody may look at the padding key
    assert batch.tgt_mask[1, :, 3].tolist() == [False] * 4
    assert batch.tgt_mask[1, 2].tolist() == [True, True, True, False]
    assert batch.ntokens == 4 + 2  # tgt_out is [8 9 10 2] and [8 2 <pad> <pad>]


# --- label smoothing --------------------------------------------------------------------


def reference_label_smoothing(log_probs, target, vocab_size, pad_id, eps):
    """Summed KL(q || p), written out from the definition, one row at a time."""
    total = 0.0
    for row, answer in zip(log_probs.tolist(), target.tolist(), strict=True):
        if answer == pad_id:
            continue  # an all-zero target row contributes nothing
        q = [0.0 if w == pad_id else eps / (vocab_size - 2) for w in range(vocab_size)]
        q[answer] = 1.0 - eps
        cross_entropy = -sum(qw * lp for qw, lp in zip(q, row, strict=True))
        entropy = -sum(qw * math.log(qw) for qw in q if qw > 0)  # 0 log 0 = 0
        total += cross_entropy - entropy
    return total


@pytest.mark.numerics
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
def test_label_smoothing_equals_kl_from_the_definition(eps):
    """The module's loss equals cross-entropy minus entropy of the smoothed target."""
    criterion = at.LabelSmoothing(vocab_size=7, pad_id=PAD, smoothing=eps)
    log_probs = F.log_softmax(torch.randn(6, 7) * 3, dim=-1)
    target = torch.tensor([3, PAD, 1, 6, PAD, 2])
    expected = reference_label_smoothing(log_probs, target, 7, PAD, eps)
    assert expected > 0
    assert math.isclose(criterion(log_probs, target).item(), expected, rel_tol=1e-5)


@pytest.mark.numerics
def test_label_smoothing_is_zero_for_a_perfect_prediction():
    """Predicting exactly the smoothed target costs nothing (the entropy term's job)."""
    criterion = at.LabelSmoothing(vocab_size=6, pad_id=PAD, smoothing=0.2)
    target = torch.tensor([4, 1, PAD, 5])
    smoothed = criterion.smoothed_target(target)
    assert torch.allclose(smoothed[target != PAD].sum(-1), torch.ones(3))
    # The perfect prediction gives padding probability 0; stand in a tiny one, since
    # log(0) = -inf would make the KL's 0 * (-inf) undefined.
    log_probs = smoothed.clamp_min(1e-30).log()
    assert torch.allclose(criterion(log_probs, target), torch.tensor(0.0), atol=1e-6)
    assert criterion(F.log_softmax(torch.randn(4, 6), -1), target) > 0.01


def test_label_smoothing_is_finite_for_very_confident_logits():
    """Confident predictions, right or wrong, give a large but finite loss."""
    criterion = at.LabelSmoothing(vocab_size=5, pad_id=PAD, smoothing=0.1)
    logits = torch.zeros(3, 5)
    logits[0, 2] = 1e4  # sure and right
    logits[1, 3] = 1e4  # sure and wrong
    logits[2] = torch.tensor([0.0, -1e30, 1e30, 0.0, 0.0])  # as confident as floats allow
    loss = criterion(F.log_softmax(logits, dim=-1), torch.tensor([2, 2, 2]))
    assert torch.isfinite(loss) and loss > 1e3


@pytest.mark.numerics
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.4])
def test_fast_label_smoothing_equals_the_kl_version(eps):
    """The closed form gives the same loss and the same gradient as KLDivLoss."""
    logits = torch.randn(12, V, requires_grad=True)
    target = torch.randint(0, V, (12,))
    target[::4] = PAD
    grads = []
    for criterion in (at.LabelSmoothing(V, PAD, eps), at.FastLabelSmoothing(V, PAD, eps)):
        loss = criterion(F.log_softmax(logits, dim=-1), target)
        (grad,) = torch.autograd.grad(loss, logits)
        grads.append((loss.detach(), grad))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-5)


# --- learning-rate schedule and optimizer ----------------------------------------------


@pytest.mark.parametrize("d_model, warmup, factor", [(512, 4000, 1.0), (32, 40, 2.0)])
def test_rate_matches_the_papers_formula(d_model, warmup, factor):
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)."""
    for step in (1, 10, warmup - 1, warmup, warmup + 1, 10 * warmup):
        expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5) * factor
        got = at.rate(step, d_model=d_model, warmup=warmup, factor=factor)
        assert math.isclose(got, expected, rel_tol=1e-12), step


def test_rate_peaks_at_the_end_of_warmup():
    """Over steps 1 .. 3 * warmup the largest learning rate is at step == warmup."""
    warmup = 50
    rates = [at.rate(s, d_model=64, warmup=warmup) for s in range(1, 3 * warmup + 1)]
    assert rates.index(max(rates)) + 1 == warmup


def test_make_optimizer_follows_rate():
    """Adam(0.9, 0.98, 1e-9); after k schedule steps the learning rate is rate(k + 1)."""
    settings = at.Settings(name="t", d_model=32, warmup=5, lr_factor=2.0)
    optimizer, schedule = at.make_optimizer(nn.Linear(2, 2), settings)
    assert isinstance(optimizer, torch.optim.Adam)
    assert isinstance(schedule, torch.optim.lr_scheduler.LambdaLR)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    for k in range(12):
        expected = at.rate(k + 1, d_model=32, warmup=5, factor=2.0)
        assert math.isclose(group["lr"], expected, rel_tol=1e-9), k
        optimizer.step()  # no gradients: a no-op that keeps LambdaLR from warning
        schedule.step()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_epochs_rate_follows_the_data_seen_and_keeps_the_peak(world_size):
    """ddp_epoch advances the schedule W times per optimizer step: its step s gets the rate
    of a single process after s * W steps, the same amount of data. The warm-up ends after
    the same data, and the peak is the single process's, not sqrt(W) times it."""
    warmup = 41  # (warmup - 1) divides by W, so a W-rank step lands on the peak itself
    settings = at.Settings(name="t", d_model=64, warmup=warmup)
    model = tiny_model()
    optimizer, schedule = at.make_optimizer(model, settings)
    lrs = []
    optimizer.register_step_pre_hook(lambda opt, *_: lrs.append(opt.param_groups[0]["lr"]))
    steps = 3 * warmup // world_size
    batches = [random_batch(batch_size=1, length=1) for _ in range(steps)]
    criterion = at.LabelSmoothing(V, PAD, 0.1)
    at.ddp_epoch(batches, model, criterion, optimizer, schedule, world_size=world_size)
    assert len(lrs) == steps and schedule.last_epoch == steps * world_size
    for s in range(steps):
        single = at.rate(s * world_size + 1, d_model=64, warmup=warmup)  # make_optimizer's
        assert math.isclose(lrs[s], single, rel_tol=1e-12), s
    assert lrs.index(max(lrs)) == (warmup - 1) // world_size
    assert math.isclose(max(lrs), 64**-0.5 * warmup**-0.5, rel_tol=1e-12)


# --- run_epoch and gradient accumulation -----------------------------------------------


def sgd(model, lr=0.5):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def train(model, batches, make_opt, accum_iter):
    optimizer, schedule = make_opt(model)
    criterion = at.LabelSmoothing(V, PAD, smoothing=0.1)
    at.run_epoch(
        batches,
        model,
        criterion,
        optimizer=optimizer,
        schedule=schedule,
        accum_iter=accum_iter,
    )
    return schedule


def assert_same_parameters(a, b, atol=1e-6):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=atol), name


def largest_change(before, after):
    pairs = zip(before.parameters(), after.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


# The comparisons of two trainings below take SGD steps, which are linear in the gradients:
# two ways of computing the same gradient (micro-batches or one batch) round differently,
# and SGD moves the weights by lr times that rounding, a few 1e-8 here. Adam would not do:
# it divides each update by the gradient's own running size, so a weight whose true
# gradient is 0 (the key projection's bias, which softmax cancels) gets its rounding noise
# blown up into a full step of size lr, in a direction that depends on the CPU's kernels.


@pytest.mark.numerics
def test_accumulated_micro_batches_equal_one_big_batch():
    """k micro-batches with accum_iter=k make the same update as their concatenation."""
    micro = [random_batch() for _ in range(3)]
    start = tiny_model()
    accumulated, whole = copy.deepcopy(start), copy.deepcopy(start)
    assert train(accumulated, micro, sgd, accum_iter=3).last_epoch == 1
    assert train(whole, [concat(micro)], sgd, accum_iter=1).last_epoch == 1
    assert largest_change(start, whole) > 1e-3, "the step must move the parameters"
    assert_same_parameters(accumulated, whole)


def padded_union(batches):
    """One batch holding the sentence pairs of batches of any lengths, padded."""
    sources = [src for b in batches for src in b.src]
    # the full target is tgt_in followed by the last token of tgt_out
    targets = [
        torch.cat([b.tgt_in[i], b.tgt_out[i, -1:]]) for b in batches for i in range(len(b.src))
    ]
    src = nn.utils.rnn.pad_sequence(sources, batch_first=True, padding_value=PAD)
    tgt = nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=PAD)
    return at.Batch(src, tgt, PAD)


def unequal_micro_batches():
    """Two micro-batches with 11 and 2 real target tokens, the shape of the review's check."""
    long = random_batch(batch_size=1, length=10)  # 10 words + </s> = 11 target tokens
    short = random_batch(batch_size=1, length=1)  # 1 word + </s> = 2
    return [long, short]


@pytest.mark.numerics
def test_micro_batches_of_unequal_size_equal_one_big_batch():
    """Accumulating micro-batches of 11 and 2 real target tokens makes the update of one
    padded batch of all the pairs: the loss is divided by the step's 13 tokens, not
    averaged over the two micro-batch means."""
    micro = unequal_micro_batches()
    assert [b.ntokens for b in micro] == [11, 2]
    whole_batch = padded_union(micro)
    assert whole_batch.ntokens == 13 and whole_batch.src.size(1) > micro[1].src.size(1)
    start = tiny_model()
    accumulated, whole = copy.deepcopy(start), copy.deepcopy(start)
    assert train(accumulated, micro, sgd, accum_iter=2).last_epoch == 1
    assert train(whole, [whole_batch], sgd, accum_iter=1).last_epoch == 1
    assert largest_change(start, whole) > 1e-3, "the step must move the parameters"
    assert_same_parameters(accumulated, whole)


def test_tokens_per_step_sums_each_group_including_a_short_last_one():
    batches = [random_batch(1, n) for n in (3, 1, 4, 2, 5)]  # n + 1 target tokens each
    assert at.tokens_per_step(batches, accum_iter=2) == [4 + 2, 5 + 3, 6]
    assert at.tokens_per_step(batches, accum_iter=1) == [4, 2, 5, 3, 6]


@pytest.mark.numerics
def test_a_rank_divides_its_loss_by_its_share_of_all_ranks_tokens(monkeypatch):
    """ddp_epoch divides a rank's summed loss by the step's real target tokens on all W
    ranks over W, so that DDP's average of the ranks' gradients is the gradient of the
    mean over all of them. This rank holds 13 tokens (11 + 2) and a stand-in for the
    other rank's all-reduce adds 39: the gradient is 13 / (52 / 2), half of that of a
    process training on these 13 tokens alone. Dividing by the rank's own tokens (a mean
    of means) would give all of it, forgetting the W a quarter."""
    shared = []

    def sum_over_ranks(values, device):
        shared.append(list(values))
        return [tokens + 39 for tokens in values]

    monkeypatch.setattr(at, "sum_over_ranks", sum_over_ranks)
    micro = unequal_micro_batches()
    start = tiny_model()
    grads = []
    for epoch in (at.run_epoch, functools.partial(at.ddp_epoch, world_size=2)):
        model = copy.deepcopy(start)
        model.no_sync = contextlib.nullcontext  # DDP's; a plain model has nothing to skip
        optimizer, schedule = sgd(model, lr=0.0)  # lr 0: keep the gradient, move nothing
        optimizer.zero_grad = lambda set_to_none=True: None  # keep .grad for the check
        criterion = at.LabelSmoothing(V, PAD, 0.1)
        epoch(micro, model, criterion, optimizer=optimizer, schedule=schedule, accum_iter=2)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert shared[0] == [13], "one all-reduce of the step token counts, before the epoch"
    assert len(shared) == 2 and shared[1][1] == 13, "and one of the epoch's loss and tokens"
    assert grads[0].abs().max() > 1e-3
    assert torch.allclose(grads[1], grads[0] / 2, atol=1e-8)


@pytest.mark.numerics
def test_short_last_group_gets_its_own_full_step():
    """3 micro-batches, accum_iter=2: a step on the first two, then one on the third alone."""
    micro = [random_batch() for _ in range(3)]
    start = tiny_model()
    accumulated, by_hand = copy.deepcopy(start), copy.deepcopy(start)
    assert train(accumulated, micro, sgd, accum_iter=2).last_epoch == 2
    optimizer, schedule = sgd(by_hand)
    for group in ([concat(micro[:2])], micro[2:]):
        at.run_epoch(
            group, by_hand, at.LabelSmoothing(V, PAD, 0.1), optimizer=optimizer, schedule=schedule
        )
    assert largest_change(start, by_hand) > 1e-3
    assert_same_parameters(accumulated, by_hand)


def test_step_counting_with_accumulation():
    """5 micro-batches, accum_iter=2: 3 optimizer and 3 schedule steps, the last one short."""
    model = tiny_model()
    optimizer, schedule = sgd(model, lr=0.01)
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(schedule.last_epoch))
    batches = [random_batch() for _ in range(5)]
    at.run_epoch(
        batches,
        model,
        at.LabelSmoothing(V, PAD, 0.1),
        optimizer=optimizer,
        schedule=schedule,
        accum_iter=2,
    )
    assert steps == [0, 1, 2], "one schedule step after each optimizer step"
    assert schedule.last_epoch == 3
    assert all(p.grad is None for p in model.parameters()), "no gradient is left over"


def test_run_epochs_options_act_on_every_step():
    """autocast wraps every forward pass; the optimizer steps after micro-batches 2, 4 and
    5; clip_norm bounds every update (SGD with lr 1 moves the weights by the clipped
    gradient)."""
    batches = [random_batch() for _ in range(5)]
    start = tiny_model()
    entered, moved = [], []

    @contextlib.contextmanager
    def autocast():
        entered.append(torch.is_grad_enabled())
        yield

    for clip_norm in (1e-3, None):
        model = copy.deepcopy(start)
        optimizer, schedule = sgd(model, lr=1.0)
        stepped = []  # how many forward passes came before each optimizer step
        optimizer.register_step_post_hook(lambda *_, out=stepped: out.append(len(entered)))
        at.run_epoch(
            batches,
            model,
            at.LabelSmoothing(V, PAD, 0.1),
            optimizer,
            schedule,
            accum_iter=2,
            clip_norm=clip_norm,
            autocast=autocast,
        )
        pairs = zip(start.parameters(), model.parameters(), strict=True)
        moved.append(torch.cat([(p - q).flatten() for p, q in pairs]).norm().item())
        if clip_norm is not None:
            assert entered == [True] * 5, "one forward pass per micro-batch, with gradients"
            assert stepped == [2, 4, 5] and schedule.last_epoch == 3
    assert 0 < moved[0] <= 3 * 1e-3 * (1 + 1e-4), "three steps of at most clip_norm each"
    assert moved[1] > 10 * moved[0], "the gradients were large enough to be clipped"


def test_evaluation_changes_nothing_and_keeps_no_graph():
    """Without an optimizer: a float loss, no_grad, eval mode, no .grad, same parameters."""
    model = tiny_model(dropout=0.3)
    before = copy.deepcopy(model)
    grad_enabled = []
    model.register_forward_hook(lambda *_: grad_enabled.append(torch.is_grad_enabled()))
    batches = [random_batch() for _ in range(2)]
    loss = at.evaluate(batches, model, at.LabelSmoothing(V, PAD, 0.1))
    assert isinstance(loss, float) and math.isfinite(loss) and loss > 0
    assert grad_enabled == [False, False]
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert_same_parameters(model, before, atol=0.0)
    again = at.evaluate(batches, model, at.LabelSmoothing(V, PAD, 0.1))
    assert again == loss, "eval mode: dropout is off, so the loss is deterministic"


@pytest.mark.numerics
def test_bf16_autocast_stays_close_to_fp32():
    """bf16 autocast (used on CUDA) keeps the loss within bf16's precision of fp32's.
    CPU autocast runs the same bf16 matrix products, so the check runs here."""
    model = tiny_model().eval()
    criterion = at.LabelSmoothing(V, PAD, 0.1)
    batch = random_batch(batch_size=8, length=10)
    with torch.no_grad():
        exact = at.batch_loss(model, criterion, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = at.batch_loss(model, criterion, batch)
    assert low.dtype == torch.float32  # the loss itself is computed in float32
    assert not torch.equal(low, exact)  # bf16 really was used ...
    assert torch.allclose(low, exact, rtol=2e-2)  # ... and stays within ~1% of fp32

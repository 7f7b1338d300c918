"""A short run: the linear schedule, clipping, precision and averaging."""

import dataclasses
import math

import pytest
import torch
from conftest import MIRROR, prepared_data
from torch import nn

import annotated_transformer as at
import trainer
from plumbing import read_checkpoint

# the smoke preset (linear schedule, clipping) shrunk further; no averaging unless asked
SMALL = dataclasses.replace(
    at.SMOKE, name="small", d_model=16, d_ff=32, train_pairs=200, eval_pairs=20, batch_tokens=400
)
SMALL = dataclasses.replace(SMALL, warmup=4, average_last=1, beam_size=3)
LESSON = trainer.Lesson.of(at)
CPU = torch.device("cpu")


@pytest.fixture
def data(tmp_path, monkeypatch):
    return prepared_data(SMALL, tmp_path, monkeypatch)


# --- the schedule ------------------------------------------------------------------------


def test_linear_rate_keeps_the_papers_warmup_and_peak_then_falls_to_zero():
    d, warmup, total = 64, 40, 400
    for step in (1, 20, 40):
        paper = at.rate(step, d_model=d, warmup=warmup)
        assert math.isclose(at.linear_rate(step, d_model=d, warmup=warmup, total=total), paper)
    # values[i] is the rate of step i + 1
    values = [at.linear_rate(s, d_model=d, warmup=warmup, total=total) for s in range(1, 403)]
    assert values.index(max(values)) + 1 == warmup
    after_peak = values[warmup - 1 : total]
    assert all(a > b for a, b in zip(after_peak, after_peak[1:], strict=False))
    assert values[total - 1] > 0  # the last planned step still learns a little
    assert values[total] == values[total + 1] == 0.0  # and nothing after it


def test_a_linear_schedule_needs_room_after_the_warmup():
    settings = at.Settings(name="t", d_model=16, warmup=50, schedule="linear")
    for total in (None, 50):
        with pytest.raises(ValueError, match="lower warmup or raise epochs"):
            at.make_optimizer(nn.Linear(2, 2), settings, total_steps=total)
    at.make_optimizer(nn.Linear(2, 2), settings, total_steps=51)  # one step after it will do


def test_planned_steps_are_the_steps_training_takes_and_the_rate_ends_at_zero(data, tmp_path):
    trained = trainer.load_or_train(LESSON, SMALL, data, tmp_path, device=CPU, show=False)
    last = read_checkpoint(trained.folder / "last.pt")
    planned = trainer.planned_steps(LESSON, SMALL, data.train)
    assert planned > SMALL.warmup
    assert last["state"]["step"] == planned
    assert last["schedule"]["_last_lr"] == [0.0]  # the rate after the last step


def test_planned_steps_with_ranks_count_as_one_process_does():
    pairs = [([1, 5, 2], [1, 6, 7, 2])] * 300
    settings = dataclasses.replace(SMALL, accum_iter=1, epochs=3)
    one = trainer.planned_steps(LESSON, settings, pairs)
    two = trainer.planned_steps(LESSON, settings, pairs, world_size=2)
    assert two % 2 == 0 and abs(two - one) <= 2 * settings.epochs  # rounding per epoch only


# --- clipping ----------------------------------------------------------------------------


def one_sgd_step(grads: list[torch.Tensor], clip_norm) -> torch.Tensor:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer = torch.optim.SGD(params, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    at.optimizer_step(optimizer, schedule, at.TrainState(), clip_norm)
    return torch.cat([p.detach() for p in params])  # the update, since they started at 0


@pytest.mark.numerics
def test_clipping_scales_all_gradients_together_to_the_norm():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 0.0])]  # norm 5 together
    update = one_sgd_step(grads, clip_norm=1.0)
    assert math.isclose(update.norm().item(), 1.0, rel_tol=1e-5)
    assert torch.allclose(update, -torch.tensor([3.0, 0.0, 0.0, 4.0, 0.0]) / 5)  # same direction
    small = [torch.tensor([0.3, 0.0]), torch.tensor([0.0, 0.4, 0.0])]  # norm 0.5: untouched
    assert torch.allclose(one_sgd_step(small, clip_norm=1.0), -torch.cat(small))
    assert torch.allclose(one_sgd_step(grads, clip_norm=None), -torch.cat(grads))


# --- precision ---------------------------------------------------------------------------


def tiny_batch():
    src = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 9, 2, 0]])
    return at.Batch(src, src, 0)


def test_precision_follows_the_settings_the_device_and_a_measurement(capsys):
    model = at.make_model(11, 11, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2))
    criterion = at.LabelSmoothing(11, 0, 0.1)
    batch = tiny_batch()
    fp32, bf16, auto = (at.Settings(name="t", precision=p) for p in ("fp32", "bf16", "auto"))

    def choose(settings, device=CPU, world_size=1):
        device = torch.device(device)
        return trainer.choose_precision(
            settings, device, LESSON, model, batch, criterion, world_size
        )

    assert at.Settings(name="t").precision == "fp32"  # the default: the same numbers anywhere
    assert choose(fp32) == choose(fp32, "cuda") == "fp32"  # asked for: never changed
    assert choose(bf16) == choose(bf16, "cuda") == "bf16"
    assert choose(auto, "cuda") == "bf16"  # no measurement: bf16 pays off on CUDA
    assert choose(auto, "mps") == choose(bf16, "mps") == "fp32"  # no bf16 autocast there
    assert choose(auto, world_size=2) == "fp32"  # CPU ranks would have to agree
    assert capsys.readouterr().out == ""  # none of these needed a measurement
    chosen = choose(auto)
    printed = capsys.readouterr().out
    assert chosen in ("fp32", "bf16") and "one validation batch, forward and backward:" in printed
    assert printed.rstrip().endswith(f"training in {'bf16' if chosen == 'bf16' else 'float32'}")


def test_calibration_draws_no_random_numbers_and_leaves_no_gradient():
    at.set_seed(0)
    model = at.make_model(11, 11, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.5))
    before = torch.get_rng_state()
    criterion = at.LabelSmoothing(11, 0)
    pays, fp32, bf16 = trainer.bf16_pays_off(LESSON, model, tiny_batch(), criterion, repeats=1)
    assert fp32 > 0 and bf16 > 0 and pays == (fp32 > 1.2 * bf16)  # the default margin
    assert torch.equal(before, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_cpu_autocast_uses_our_attention_not_the_fused_kernel(monkeypatch):
    mha = at.MultiHeadAttention(2, 16, 0.0, use_sdpa=True).eval()
    x = torch.randn(2, 5, 16)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused kernel was called")

    monkeypatch.setattr(at.F, "scaled_dot_product_attention", refuse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(query=x, key=x, value=x)
    assert out.dtype == torch.bfloat16
    with pytest.raises(AssertionError, match="fused kernel"):
        mha(query=x, key=x, value=x)  # outside autocast, use_sdpa does call it


def test_autocast_for_runs_the_products_in_bf16_only_when_asked():
    a = torch.randn(4, 4)
    for precision, dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        with trainer.autocast_for(CPU, precision)():  # a factory: a fresh context each time
            assert (a @ a).dtype == dtype, precision
    assert (a @ a).dtype == torch.float32  # and it ends with its block


# --- averaging ---------------------------------------------------------------------------


def test_average_weights_is_the_elementwise_mean():
    dicts = [{"w": torch.tensor([1.0, 2.0]), "b": torch.tensor(3.0)} for _ in range(3)]
    dicts[1]["w"] = torch.tensor([4.0, -1.0])
    mean = trainer.average_weights(dicts)
    assert torch.allclose(mean["w"], torch.tensor([2.0, 1.0])) and mean["b"] == 3.0


def test_the_final_model_is_the_average_of_the_last_epochs(data, tmp_path):
    settings = dataclasses.replace(SMALL, epochs=3, average_last=2)
    trained = trainer.load_or_train(LESSON, settings, data, tmp_path, device=CPU, show=False)
    model, history, folder = trained.model, trained.history, trained.folder
    assert sorted(p.name for p in folder.glob("epoch-*.pt")) == ["epoch-1.pt", "epoch-2.pt"]
    saved = [read_checkpoint(folder / f"epoch-{e}.pt")["model"] for e in (1, 2)]
    assert not torch.equal(saved[0]["generator.proj.weight"], saved[1]["generator.proj.weight"])
    for name, value in model.state_dict().items():
        assert torch.allclose(value, (saved[0][name] + saved[1][name]) / 2, atol=1e-6), name
    # each recorded validation score is that of the weights it names: scored again here,
    # on the same path and machine, they come out to the last bit
    en = data.vocabs["en"]
    criterion = at.FastLabelSmoothing(len(en), en.pad_id, settings.label_smoothing)
    val = trainer.validation_batches(LESSON, data, settings, CPU)
    averaged = history[-1]["averaged"]
    assert averaged["epochs"] == [1, 2]
    assert averaged["val_loss"] == at.evaluate(val, model, criterion)
    assert averaged["val_bleu"] == at.validation_bleu(model, data)
    model.load_state_dict(saved[1])
    assert history[-1]["val_loss"] == at.evaluate(val, model, criterion)
    assert history[-1]["val_loss"] != averaged["val_loss"]


def test_every_presets_warmup_ends_well_before_its_run(tmp_path, monkeypatch):
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    monkeypatch.setenv("MULTI30K_DIR", str(MIRROR))
    # the presets keep the same training pairs (word vocabularies, the same longest pair)
    assert len({(s.bpe_merges, s.max_train_len) for s in at.PRESETS.values()}) == 1
    pairs = at.prepare_data(at.get_settings("cpu"), tmp_path).train
    assert len(pairs) > 28_000
    for settings in at.PRESETS.values():
        ours = pairs[: settings.train_pairs]
        # a run planned to the clock is at least MIN_USEFUL_EPOCHS long, or it warns
        epochs = trainer.MIN_USEFUL_EPOCHS if settings.train_minutes else settings.epochs
        run = dataclasses.replace(settings, epochs=epochs)
        steps = trainer.planned_steps(LESSON, run, ours)
        if settings.train_minutes:  # a planned run fits its warm-up to its plan
            settings = trainer.fit_warmup(settings, steps)
        # (a planned run of MIN_USEFUL_EPOCHS ends its warm-up before it ends)
        assert settings.warmup < (steps if settings.train_minutes else steps / 3), settings.name
        at.make_optimizer(nn.Linear(2, 2), settings, total_steps=steps)


@pytest.mark.parametrize("steps", [100, 1142, 1143, 5000])
def test_fit_warmup_cuts_a_short_plans_warmup_and_keeps_the_peak(steps):
    preset = at.Settings(name="t", d_model=256, warmup=800, lr_factor=0.7071, schedule="linear")
    fitted = trainer.fit_warmup(preset, steps)
    assert fitted.warmup == min(800, int(0.7 * steps)) and fitted.warmup < steps
    peak = at.rate(800, d_model=256, warmup=800, factor=0.7071)
    rates = [
        at.linear_rate(s, d_model=256, warmup=fitted.warmup, total=steps, factor=fitted.lr_factor)
        for s in range(1, steps + 2)  # the rate after the last step too
    ]
    assert math.isclose(max(rates), peak, rel_tol=1e-12) and rates[-1] == 0.0
    assert rates.index(max(rates)) + 1 == fitted.warmup


def test_translate_never_writes_unk_unless_allowed(data):
    at.set_seed(0)
    model = at.model_for(SMALL, data.vocabs).eval()
    en = data.vocabs["en"]
    with torch.no_grad():
        model.generator.proj.bias[en.unk_id] = 100.0  # <unk> is by far the likeliest word
    sources = [src for src, _ in data.val[:6]]
    for beam in (1, 3):
        allowed = at.translate(model, sources, data.vocabs, beam_size=beam, allow_unk=True)
        assert all(tokens and set(tokens) == {"<unk>"} for tokens in allowed)
        banned = at.translate(model, sources, data.vocabs, beam_size=beam)
        assert all("<unk>" not in tokens for tokens in banned)
        # the ban works on both decoders (their words are not compared: an untrained
        # model's near ties may round one way on one and the other way on the other)
        plain = at.translate(model, sources, data.vocabs, beam_size=beam, cached=False)
        assert all(tokens and "<unk>" not in tokens for tokens in plain)

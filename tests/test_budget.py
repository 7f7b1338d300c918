"""A short run: the linear schedule, clipping, precision and averaging."""

import dataclasses
import math

import pytest
import torch
from conftest import CPU, assert_same_weights, quick_settings, tiny_model, train_as_the_notebook
from torch import nn

import annotated_transformer as at
import trainer
from plumbing import read_checkpoint, save_checkpoint

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


def test_a_planned_end_within_the_warmup_is_refused_when_the_warmup_ends():
    """A run planned to the clock knows its end only after its first steps, so the check
    waits for the end of the warm-up, then refuses as a number would."""
    settings = at.Settings(name="t", d_model=16, warmup=3, schedule="linear")
    optimizer, schedule = at.make_optimizer(nn.Linear(2, 2), settings, total_steps=lambda: 3)
    for _ in range(2):  # steps 2 and 3 are still warming up
        optimizer.step()
        schedule.step()
    with pytest.raises(ValueError, match=r"more planned steps \(3\) than warm-up steps \(3\)"):
        schedule.step()


@pytest.mark.slow
def test_a_fixed_run_takes_its_planned_steps_and_ends_its_rate_at_zero(quick_data, tmp_path):
    settings = dataclasses.replace(quick_settings(), epochs=2)
    _, history, folder = train_as_the_notebook(settings, quick_data, tmp_path)
    plan, last = history[-1]["plan"], read_checkpoint(folder / "last.pt")
    en = quick_data.vocabs["en"]
    batches = at.batches_for(quick_data.train, en.pad_id, settings, CPU)
    assert plan["steps"] == 2 * math.ceil(len(batches) / settings.accum_iter) > settings.warmup
    assert last["state"]["step"] == plan["steps"]
    assert last["schedule"]["_last_lr"] == [0.0]  # the rate after the last step


def test_every_presets_warmup_ends_well_before_its_run(tmp_path, multi30k_env):
    """A third of a fixed run, or the first epoch of a run planned to the clock (one that
    fits fewer than MIN_USEFUL_EPOCHS epochs warns)."""
    # the presets keep the same training pairs (word vocabularies, the same longest pair)
    assert len({(s.bpe_merges, s.max_train_len) for s in at.PRESETS.values()}) == 1
    pairs = at.prepare_data(at.get_settings("cpu"), tmp_path).train
    assert len(pairs) > 28_000
    for settings in at.PRESETS.values():
        batches = at.bucket_batches(pairs[: settings.train_pairs], settings.batch_tokens,
                                    seed=settings.seed, epoch=0)  # fmt: skip
        epoch_steps = math.ceil(len(batches) / settings.accum_iter)
        epochs = trainer.MIN_USEFUL_EPOCHS if settings.train_minutes else settings.epochs
        assert settings.warmup < epochs * epoch_steps / 3, settings.name
        at.make_optimizer(nn.Linear(2, 2), settings, total_steps=epochs * epoch_steps)


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


def test_precision_follows_the_settings_the_device_and_a_measurement(capsys, monkeypatch):
    model, batch = tiny_model(dropout=0.1), tiny_batch()
    fp32, bf16, auto = (at.Settings(name="t", precision=p) for p in ("fp32", "bf16", "auto"))

    def choose(settings, device="cpu", world_size=1):
        """The choice alone; trainer.choose_precision also says why."""
        chosen, why = trainer.choose_precision(
            settings, torch.device(device), model, batch, world_size
        )
        assert why
        return chosen

    assert at.Settings(name="t").precision == "fp32"  # the default: the same numbers anywhere
    assert choose(fp32) == choose(fp32, "cuda") == "fp32"  # asked for: never changed
    assert choose(bf16) == choose(bf16, "cuda") == "bf16"
    assert choose(auto, "cuda") == "bf16"  # no measurement: bf16 pays off on CUDA
    assert choose(auto, "mps") == choose(bf16, "mps") == "fp32"  # no bf16 autocast there
    assert choose(auto, world_size=2) == "fp32"  # CPU ranks would have to agree
    assert capsys.readouterr().out == ""  # none of these needed a measurement
    for pays, chosen in [(True, "bf16"), (False, "fp32")]:
        monkeypatch.setattr(trainer, "bf16_pays_off", lambda *args, pays=pays: (pays, 0.5, 0.25))
        device = torch.device("cpu")
        assert trainer.choose_precision(auto, device, model, batch) == (
            chosen,  # on a CPU, the measurement decides, and the reason gives its times
            "one batch took 0.50 s in float32 and 0.25 s in bf16 here",
        )


def test_calibration_draws_no_random_numbers_and_leaves_no_gradient():
    at.set_seed(0)
    model = tiny_model(dropout=0.5)
    before = torch.get_rng_state()
    pays, fp32, bf16 = trainer.bf16_pays_off(model, tiny_batch(), repeats=1)
    assert fp32 > 0 and bf16 > 0 and pays == (fp32 > 1.2 * bf16)  # the default margin
    assert torch.equal(before, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_autocast_for_runs_the_products_in_bf16_only_when_asked():
    a = torch.randn(4, 4)
    for precision, dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        with trainer.autocast_for(CPU, precision)():  # a factory: a fresh context each time
            assert (a @ a).dtype == dtype, precision
    assert (a @ a).dtype == torch.float32  # and it ends with its block


# --- averaging ---------------------------------------------------------------------------


def test_averaged_weights_are_the_elementwise_mean_of_the_last_epochs(tmp_path):
    settings = dataclasses.replace(quick_settings(), average_last=2)
    run = trainer.Run(settings, tmp_path, trainer.Plan(3, "fp32"))
    run.history = [{}, {}, {}]  # after three epochs
    weights = {0: [9.0, 9.0], 1: [1.0, 2.0], 2: [4.0, -1.0]}  # epoch 0 falls outside
    for epoch, w in weights.items():
        save_checkpoint(tmp_path / f"epoch-{epoch}.pt", model={"w": torch.tensor(w)})
    averaged = run.averaged_weights()
    assert averaged["epochs"] == [1, 2]
    torch.testing.assert_close(averaged["weights"]["w"], torch.tensor([2.5, 0.5]))
    assert run.history == [{}, {}, {}]  # averaging returns values, and edits no record


@pytest.mark.slow
def test_the_final_model_is_the_average_of_the_last_epochs(quick_data, tmp_path):
    settings = dataclasses.replace(quick_settings(), epochs=3, average_last=2)
    model, history, folder = train_as_the_notebook(settings, quick_data, tmp_path)
    assert sorted(p.name for p in folder.glob("epoch-*.pt")) == ["epoch-1.pt", "epoch-2.pt"]
    saved = [read_checkpoint(folder / f"epoch-{e}.pt")["model"] for e in (1, 2)]
    assert not torch.equal(saved[0]["generator.proj.weight"], saved[1]["generator.proj.weight"])
    for name, value in model.state_dict().items():
        assert torch.allclose(value, (saved[0][name] + saved[1][name]) / 2, atol=1e-6), name
    final = read_checkpoint(folder / "final.pt")["model"]
    assert_same_weights(final, model)
    # each recorded validation score is that of the weights it names: scored again here,
    # on the same path and machine, they come out to the last bit
    en = quick_data.vocabs["en"]
    criterion = at.FastLabelSmoothing(len(en), en.pad_id, settings.label_smoothing)
    val = at.batches_for(quick_data.val, en.pad_id, settings, CPU)
    averaged = history[-1]["averaged"]
    assert averaged["epochs"] == [1, 2]
    assert averaged["val_loss"] == at.evaluate(val, model, criterion)
    assert averaged["val_bleu"] == at.validation_bleu(model, quick_data)
    model.load_state_dict(saved[1])
    assert history[-1]["val_loss"] == at.evaluate(val, model, criterion)
    assert history[-1]["val_loss"] != averaged["val_loss"]

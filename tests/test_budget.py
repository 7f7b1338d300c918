"""A short run: the linear schedule, clipping, precision and averaging."""

import dataclasses
import math

import pytest
import torch
from conftest import CPU, assert_same_weights, quick_settings, train_as_the_notebook
from torch import nn

import annotated_transformer as at
from plumbing import read_checkpoint

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


def test_every_preset_names_a_whole_number_of_epochs_and_nothing_else_sets_the_length():
    assert all(type(p.epochs) is int and p.epochs >= 1 for p in at.PRESETS.values())
    fields = {f.name for f in dataclasses.fields(at.Settings)}
    assert not fields & {"train_minutes", "checkpoint_steps"}  # no clock, no mid-epoch files
    for wrong in (None, 0, 2.5):
        with pytest.raises(ValueError, match=f"epochs={wrong!r}: train a whole number of epochs"):
            at.Settings(name="t", epochs=wrong)


def test_the_runs_steps_count_every_ranks_steps(quick_data):
    """With W ranks, each steps the schedule W times per optimizer step (ddp_epoch), so the
    run's end counts W steps for each of a rank's own."""
    settings = dataclasses.replace(quick_settings(), accum_iter=2, epochs=3)
    batches = at.bucket_batches(
        quick_data.train, settings.batch_tokens, seed=settings.seed, epoch=0
    )
    one = at.total_steps(quick_data.train, settings)
    assert one == 3 * math.ceil(len(batches) / 2)
    two = at.total_steps(quick_data.train, settings, at.DDPProcesses(rank=1, world_size=2))
    share = at.shard_batches(batches, 1, 2)
    assert two == 3 * math.ceil(len(share) / 2) * 2


def test_a_linear_schedule_needs_room_after_the_warmup():
    settings = at.Settings(name="t", d_model=16, warmup=50)
    with pytest.raises(ValueError, match="lower warmup or raise epochs"):
        at.make_optimizer(nn.Linear(2, 2), settings, total_steps=50)
    at.make_optimizer(nn.Linear(2, 2), settings, total_steps=51)  # one step after it will do


def test_a_run_of_no_set_length_follows_the_papers_rate():
    settings = at.Settings(name="t", d_model=16, warmup=50)
    _, schedule = at.make_optimizer(nn.Linear(2, 2), settings)  # as the copy task trains
    rate_of = schedule.lr_lambdas[0]
    for step in (0, 49, 50, 1000):  # LambdaLR counts from 0, the paper from 1
        assert rate_of(step) == at.rate(step + 1, d_model=16, warmup=50)


@pytest.mark.slow
def test_a_run_takes_the_steps_known_before_it_and_ends_its_rate_at_zero(quick_data, tmp_path):
    settings = dataclasses.replace(quick_settings(), epochs=2)
    steps = at.total_steps(quick_data.train, settings)  # known before the first step
    _, history, folder = train_as_the_notebook(settings, quick_data, tmp_path)
    last = read_checkpoint(folder / "last.pt")
    en = quick_data.vocabs["en"]
    for epoch in range(2):  # every epoch holds as many batches: they are cut by length
        batches = at.batches_for(quick_data.train, en.pad_id, settings, CPU, epoch)
        assert steps == 2 * math.ceil(len(batches) / settings.accum_iter) > settings.warmup
    assert [h["step"] for h in history] == [steps // 2, steps] and last["schedule"][
        "last_epoch"
    ] == steps
    assert history[0]["rate"] > 0 and history[-1]["rate"] == 0.0  # the rate after the last step
    assert last["schedule"]["_last_lr"] == [0.0]


def test_an_epochs_batches_are_as_many_in_every_epoch(quick_data):
    """total_steps counts epoch 0's batches: the batches are cut by lengths alone, and
    every epoch's shuffle keeps the multiset of lengths, so every epoch has as many."""
    pairs = quick_data.train
    counts = {len(at.bucket_batches(pairs, 400, seed=s, epoch=e)) for s in (1, 2) for e in range(6)}
    assert len(counts) == 1


def test_every_presets_warmup_ends_well_before_its_run(tmp_path, multi30k_env):
    """Within the first third of the run's steps."""
    pairs = at.prepare_data(at.get_settings("cpu"), tmp_path).train
    assert len(pairs) > 28_000
    for settings in at.PRESETS.values():
        batches = at.bucket_batches(pairs[: settings.train_pairs], settings.batch_tokens,
                                    seed=settings.seed, epoch=0)  # fmt: skip
        epoch_steps = math.ceil(len(batches) / settings.accum_iter)
        assert settings.warmup < settings.epochs * epoch_steps / 3, settings.name
        at.make_optimizer(nn.Linear(2, 2), settings, total_steps=settings.epochs * epoch_steps)


# --- clipping ----------------------------------------------------------------------------


def one_sgd_step(grads: list[torch.Tensor], clip_norm) -> torch.Tensor:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    optimizer = torch.optim.SGD(params, lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    at.optimizer_step(optimizer, schedule, clip_norm)
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


def test_precision_is_a_setting_and_a_wrong_one_stops_at_once():
    assert at.Settings(name="t").precision == "fp32"  # the default: the same numbers anywhere
    assert {at.PRESETS[p].precision for p in ("smoke", "cpu")} == {
        "fp32"
    }  # every CPU: one translator
    with pytest.raises(ValueError, match="precision='auto': use one of fp32, bf16"):
        at.Settings(name="t", precision="auto")


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_train_runs_the_products_in_bf16_only_when_asked(precision, dtype, quick_data, tmp_path):
    a, seen = torch.randn(4, 4), []

    class Watching(at.Processes):  # one process, which looks inside the epoch's autocast
        def epoch(self, batches, model, criterion, optimizer, schedule, **options):
            with options["autocast"]():  # a factory: a fresh context each epoch
                seen.append((a @ a).dtype)
            return super().epoch(batches, model, criterion, optimizer, schedule, **options)

    settings = dataclasses.replace(quick_settings(), precision=precision)
    at.train(settings, quick_data, tmp_path / "run", device=CPU, processes=Watching())
    assert seen == [dtype] and (a @ a).dtype == torch.float32  # and it ends with its block


# --- averaging ---------------------------------------------------------------------------


def test_averaged_weights_are_the_elementwise_mean_of_the_last_epochs():
    model = nn.Linear(2, 1, bias=False)
    average = torch.optim.swa_utils.AveragedModel(model, use_buffers=True)  # as train keeps it
    for weights in ([1.0, 2.0], [4.0, -1.0]):  # the last two epochs' weights
        model.load_state_dict({"weight": torch.tensor([weights])})
        average.update_parameters(model)
    history = [{"epoch": e} for e in range(3)]
    new = at.average_last_epochs(model, history, average, lambda: {"val_loss": 1.5})
    torch.testing.assert_close(model.weight, torch.tensor([[2.5, 0.5]]))
    assert new[-1]["averaged"] == {"epochs": [1, 2], "val_loss": 1.5}
    assert history == [{"epoch": e} for e in range(3)]  # a new history; the old one unedited


def averaged_epochs(monkeypatch) -> list[dict]:
    """The weights of each epoch that train adds to its average, recorded as it adds them
    (torch's AveragedModel is not the lesson's code: the run's folder stays as it was)."""
    seen, add = [], torch.optim.swa_utils.AveragedModel.update_parameters

    def recorded(average, model):
        seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return add(average, model)

    monkeypatch.setattr(torch.optim.swa_utils.AveragedModel, "update_parameters", recorded)
    return seen


@pytest.mark.slow
def test_the_final_model_is_the_average_of_the_last_epochs(quick_data, tmp_path, monkeypatch):
    settings = dataclasses.replace(quick_settings(), epochs=3, average_last=2)
    saved = averaged_epochs(monkeypatch)
    model, history, folder = train_as_the_notebook(settings, quick_data, tmp_path)
    assert len(saved) == 2  # epochs 1 and 2
    assert not torch.equal(saved[0]["generator.proj.weight"], saved[1]["generator.proj.weight"])
    for name, value in model.state_dict().items():
        assert torch.allclose(value, (saved[0][name] + saved[1][name]) / 2, atol=1e-6), name
    last = read_checkpoint(folder / "last.pt")  # the averaged weights, beside their record
    assert_same_weights(last["model"], model)
    assert last["history"] == history and history[-1]["averaged"]["epochs"] == [1, 2]
    # each recorded validation score is that of the weights it names: scored again here,
    # on the same path and machine, they come out to the last bit
    en = quick_data.vocabs["en"]
    criterion = at.FastLabelSmoothing(len(en), en.pad_id)
    val = at.batches_for(quick_data.val, en.pad_id, settings, CPU)
    averaged = history[-1]["averaged"]
    assert averaged["epochs"] == [1, 2]
    assert averaged["val_loss"] == at.evaluate(val, model, criterion)
    assert averaged["val_bleu"] == at.validation_bleu(model, quick_data)
    model.load_state_dict(saved[1])
    assert history[-1]["val_loss"] == at.evaluate(val, model, criterion)
    assert history[-1]["val_loss"] != averaged["val_loss"]
    # run again, the finished run loads last.pt's averaged weights and averages no more
    again, again_history, _ = train_as_the_notebook(settings, quick_data, tmp_path)
    assert len(saved) == 2 and again_history == history
    assert_same_weights(again, last["model"])

"""The run planned to the clock: timing the first steps, planning, re-planning, and a
linear schedule that follows the plan to zero.

The clock is fake everywhere: trainer's `time` module is replaced by one whose
perf_counter moves only when a test moves it, so no assert hangs on this machine's speed.
"""

import dataclasses
import time
from types import SimpleNamespace

import pytest
from conftest import CPU, quick_settings, train_as_the_notebook
from torch import nn

import annotated_transformer as at
import trainer
from plumbing import read_checkpoint

# a planned run of a minute; its model never runs here, so its size does not matter
PLANNED = at.Settings(name="planning", train_minutes=1.0, checkpoint_steps=0, accum_iter=1)


class Clock:
    """trainer's `time` module with a perf_counter that moves only when told to."""

    def __init__(self):
        self.now = 1000.0

    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(trainer, "time", clock)
    return clock


def refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} must not run here")

    return refused


def new_run(settings, folder) -> trainer.Run:
    """A new run as the notebook's `train` starts it (float32: nothing to measure)."""
    return trainer.start(settings, folder, nn.Linear(1, 1), batch=None)


def first_epoch(run, clock, *, steps=50, seconds=0.125, first_seconds=None, tokens=100):
    """The loop's calls on `run` over an epoch of `steps` optimizer steps of `tokens` real
    target tokens each, the clock moving `seconds` a step (`first_seconds` for the first
    two, which warm up). Returns the plan as it was after each step."""
    state = at.TrainState()
    run.state = state  # the loop's TrainState (no model, optimizer or schedule here)
    accum = run.settings.accum_iter
    run.start_epoch([SimpleNamespace(ntokens=tokens // accum)] * (steps * accum))
    plans = []
    for step in range(1, steps + 1):
        clock.now += first_seconds if first_seconds and step <= 2 else seconds
        state.step = step
        run.step_done(step * accum, 2.0 * step * tokens, step * tokens)
        plans.append(run.plan)
    return plans


# --- the plan: timed steps, then as many epochs as fit ----------------------------------


def test_a_planned_run_times_steps_3_to_23_then_fits_the_epochs_to_the_minutes(
    clock, tmp_path, capsys
):
    run = new_run(PLANNED, tmp_path)
    assert run.plan.train_minutes == 1.0 and not run.plan.timed
    # steps 1 and 2 are slow, as a first step is; steps 3 to 23 take 0.125 s for 100 tokens
    plans = first_epoch(run, clock, steps=50, first_seconds=10.0)
    assert not plans[21].timed and plans[22].timed and plans[-1] == plans[22]  # after step 23
    plan = run.plan
    assert plan.tokens_per_second == 2000 / 2.5  # 20 steps: the slow ones left out
    assert plan.epoch_seconds == 5000 / plan.tokens_per_second == 6.25  # training only
    assert plan.epochs == 9  # 9 epochs of 6.25 s fit in 60 s; 10 would not
    assert plan.epoch_steps == 50 and plan.steps == 450 == run.planned_steps()
    assert plan.precision == "fp32"
    out = capsys.readouterr().out
    assert "steps 3 to 23: 800 target tokens/s" in out
    assert (
        "plan: epochs take 6 s here, so 9 epochs in all; the rate reaches zero at step 450, about"
        in out
    )
    assert "warning" not in out


def test_a_first_epoch_shorter_than_the_timed_steps_plans_at_its_end(clock, tmp_path):
    run = new_run(PLANNED, tmp_path)
    plans = first_epoch(run, clock, steps=12, first_seconds=10.0)
    assert not plans[-2].timed and plans[-1].timed  # planned from steps 3 to 12
    assert run.plan.tokens_per_second == 900 / 1.125
    assert run.plan.epochs == 40 and run.plan.steps == 40 * 12  # epochs of 1.5 s


def test_a_faster_machine_plans_more_epochs(clock, tmp_path):
    epochs = []
    for seconds in (0.5, 0.125, 0.03125):
        run = new_run(PLANNED, tmp_path)
        first_epoch(run, clock, seconds=seconds)
        epochs.append(run.plan.epochs)
    assert epochs == [2, 9, 38]


@pytest.mark.parametrize("seconds, epochs", [(2.0, 1), (0.5, 2)])
def test_a_machine_too_slow_for_the_budget_is_told_so_in_one_line(
    clock, tmp_path, capsys, seconds, epochs
):
    run = new_run(PLANNED, tmp_path)
    first_epoch(run, clock, seconds=seconds)  # epochs of 100 s, then of 25 s
    assert run.plan.epochs == epochs  # at least one epoch, even over the budget
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert warning == [
        f"warning: only {epochs} epoch(s) fit in 1 minutes here; "
        "raise train_minutes, or expect a weak translator"
    ]


def test_a_fixed_run_measures_nothing(clock, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer.Run, "time_first_steps", refuse("timing a fixed run"))
    fixed = dataclasses.replace(PLANNED, train_minutes=None, epochs=4)
    run = new_run(fixed, tmp_path)
    first_epoch(run, clock)
    fixed_plan = trainer.Plan(4, "fp32", 50, why_precision="float32, as the settings ask")
    assert run.plan == fixed_plan
    run.history.append({"seconds": 500.0, "validation_seconds": 1.0})
    run.plan = trainer.replanned(run.plan, run.history, 1)  # a fixed run ignores the clock
    assert run.plan == fixed_plan
    assert capsys.readouterr().out == "precision: fp32 (float32, as the settings ask)\n"


def test_a_planned_run_on_several_processes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="set epochs to train on several"):
        trainer.start(PLANNED, tmp_path, nn.Linear(1, 1), batch=None, world_size=2)


def test_the_plans_steps_count_every_ranks_steps():
    """With W ranks, each steps the schedule W times per optimizer step (ddp_epoch), so a
    rank's plan counts W steps for each of its own."""
    fixed = dataclasses.replace(PLANNED, train_minutes=None, accum_iter=2, epochs=3)
    run = trainer.Run(fixed, "unused", trainer.Plan(3, "fp32"), rank=1, world_size=2)
    run.start_epoch([SimpleNamespace(ntokens=10)] * 5)  # this rank's share: 3 steps
    assert run.plan.epoch_steps == 6 and run.planned_steps() == 18


# --- re-planning after each epoch -------------------------------------------------------


def run_after(epochs_done: int, epoch_seconds: float, settings=PLANNED) -> trainer.Run:
    """A run planned to 6 epochs of 10 steps and 10 s, after `epochs_done` epochs that took
    `epoch_seconds` each, 1 s of it validation."""
    plan = trainer.Plan(6, "fp32", 10, train_minutes=1.0, epoch_seconds=10.0, timed=True)
    run = trainer.Run(settings, "unused", plan)
    run.history = [{"seconds": epoch_seconds - 1.0, "validation_seconds": 1.0}] * epochs_done
    return run


@pytest.mark.parametrize(
    ("epoch_seconds", "epochs"),
    [
        (15.0, 4),  # 30 s spent, 30 left: two more epochs
        (10.0, 6),  # as planned: the plan stays
        (5.0, 12),  # faster than the first steps said: 50 s left, ten more
        (25.0, 3),  # 10 s left: one more, so the rate still reaches zero
        (45.0, 3),  # already over the budget: one more all the same
    ],
)
def test_a_replan_fits_the_epochs_left_to_the_minutes_left(capsys, epoch_seconds, epochs):
    run = run_after(2, epoch_seconds)
    run.plan = trainer.replanned(run.plan, run.history, run.settings.average_last)
    assert run.plan.epochs == epochs and run.plan.steps == 10 * epochs
    assert run.plan.epoch_seconds == epoch_seconds  # measured, validation included
    out = capsys.readouterr().out
    if epochs == 6:
        assert run.plan.replans == () and out == ""
        return
    assert run.plan.replans == (
        {"after_epoch": 1, "epoch_seconds": epoch_seconds, "was": 6, "epochs": epochs,
         "steps": 10 * epochs},
    )  # fmt: skip
    assert f"re-plan (was 6 epochs): epochs take {epoch_seconds:.0f} s here, so {epochs}" in out


def test_a_replan_keeps_time_to_score_the_averaged_model():
    """A run that averages its last epochs validates once more at its end."""
    averaging = dataclasses.replace(PLANNED, average_last=2)
    run = run_after(2, 10.0, averaging)  # 20 s spent, 1 s kept: 39 s fit 3 more, not 4
    run.plan = trainer.replanned(run.plan, run.history, run.settings.average_last)
    assert run.plan.epochs == 5


def test_a_run_at_its_planned_end_is_not_extended():
    run = run_after(6, 1.0)  # fast epochs: 54 s left, but the run has ended
    run.plan = trainer.replanned(run.plan, run.history, run.settings.average_last)
    assert run.plan.epochs == 6 and run.plan.replans == ()


def test_a_replan_moves_the_schedules_end_without_replacing_it():
    """make_optimizer reads the run's planned steps at every step, so a re-plan moves where
    the linear rate reaches zero, in the same LambdaLR."""
    settings = dataclasses.replace(PLANNED, d_model=16, warmup=4, schedule="linear")
    run = run_after(2, 15.0, settings)
    optimizer, schedule = at.make_optimizer(
        nn.Linear(2, 2), settings, total_steps=run.planned_steps
    )
    for _ in range(20):  # the two epochs done
        optimizer.step()  # no gradients: a no-op that keeps LambdaLR from warning
        schedule.step()
    rate_at, sizes = schedule.lr_lambdas[0], {"d_model": 16, "warmup": 4}
    assert rate_at(20) == at.linear_rate(21, total=60, **sizes)  # 6 epochs: 60 steps
    run.plan = trainer.replanned(run.plan, run.history, 1)  # 4 epochs now
    assert schedule.lr_lambdas[0] is rate_at
    assert rate_at(20) == at.linear_rate(21, total=40, **sizes) > 0
    assert rate_at(39) > 0 and rate_at(40) == 0.0  # the last planned step learns; after, none


# --- the whole planned path, as `make run` takes it ---------------------------------------


def ticking(clock: Clock, seconds_per_token: float, validation_seconds: float, rates: list):
    """The lesson's run_epoch and evaluate on the fake clock: training moves it by the
    step's real target tokens, validation by `validation_seconds`. Each rate that the
    schedule sets for the step to come is recorded."""
    real_epoch, real_evaluate = at.run_epoch, at.evaluate

    def run_epoch(batches, model, criterion, optimizer, schedule, *, on_step, **options):
        counted = [0]

        def step_done(done, loss, tokens):
            clock.now += seconds_per_token * (tokens - counted[0])
            counted[0] = tokens
            rates.append(schedule.get_last_lr()[0])
            on_step(done, loss, tokens)

        return real_epoch(batches, model, criterion, optimizer, schedule, on_step=step_done,
                          **options)  # fmt: skip

    def evaluate(*args, **kwargs):
        clock.now += validation_seconds
        return real_evaluate(*args, **kwargs)

    return run_epoch, evaluate


@pytest.mark.slow
def test_a_planned_run_plans_replans_and_ends_its_rate_at_zero(
    quick_data, tmp_path, clock, monkeypatch, capsys
):
    """The notebook's `train` with `train_minutes`, on a clock where an epoch trains in
    10 s and validates in 10 s: its first steps plan 4 epochs in 45 s (training only),
    the first epoch's 20 s re-plan the run to 2, and the rate reaches zero at the last
    step of the second. A run started again finds the plan it ended with."""
    settings = dataclasses.replace(quick_settings(), train_minutes=0.75, epochs=None)
    en = quick_data.vocabs["en"]
    batches = at.batches_for(quick_data.train, en.pad_id, settings, CPU)
    epoch_steps = len(batches) // settings.accum_iter
    assert len(batches) % settings.accum_iter == 0 and epoch_steps > trainer.TIMED_STEPS[0]
    rates = []
    run_epoch, evaluate = ticking(clock, 10.0 / sum(b.ntokens for b in batches), 10.0, rates)
    monkeypatch.setattr(at, "run_epoch", run_epoch)
    monkeypatch.setattr(at, "evaluate", evaluate)

    _, history, folder = train_as_the_notebook(settings, quick_data, tmp_path)
    out = capsys.readouterr().out
    assert "plan: epochs take 10 s here, so 4 epochs in all" in out
    assert "re-plan (was 4 epochs): epochs take 20 s here, so 2 epochs in all" in out
    plan = history[-1]["plan"]
    assert plan["epochs"] == len(history) == 2 and plan["made"] and plan["timed"]
    assert plan["steps"] == 2 * epoch_steps and plan["epoch_steps"] == epoch_steps
    (change,) = plan["replans"]
    assert change["after_epoch"] == 0 and (change["was"], change["epochs"]) == (4, 2)
    assert plan["tokens_per_second"] == pytest.approx(sum(b.ntokens for b in batches) / 10.0)
    # the rate set after each step: positive to the last planned step, zero after it
    assert len(rates) == plan["steps"] and rates[-1] == 0.0 and min(rates[:-1]) > 0
    last = read_checkpoint(folder / "last.pt")
    assert last["state"]["step"] == plan["steps"] and last["schedule"]["_last_lr"] == [0.0]

    # started again (on a machine of another speed, say): the plan it ended with, done
    again = trainer.start(settings, folder, nn.Linear(1, 1), batch=None)
    assert dataclasses.asdict(again.plan) == {
        k: v for k, v in plan.items() if k not in ("steps", "warmup")
    }
    assert next(again.epochs(), None) is None


# --- epochs or train_minutes: exactly one decides -----------------------------------------


def test_a_copy_of_the_cpu_preset_that_sets_epochs_stops_with_the_fix(tmp_path, capsys):
    """The cpu preset trains to the clock; a copy that also sets epochs would be ignored
    in silence, so it stops at once, in one line that names the fix. The fix trains
    exactly the epochs asked for, with nothing timed."""
    with pytest.raises(ValueError) as error:
        dataclasses.replace(at.CPU, epochs=3)
    message = str(error.value)
    assert "\n" not in message and "epochs=3 and train_minutes=16 both set" in message
    assert "dataclasses.replace(settings, epochs=3, train_minutes=None)" in message
    fixed = dataclasses.replace(at.CPU, epochs=3, train_minutes=None, precision="fp32")
    run = new_run(fixed, tmp_path)
    assert run.plan.epochs == 3 and run.plan.train_minutes is None
    assert "planning" not in capsys.readouterr().out
    assert run.planned_steps() == 0  # known once the first epoch counts its steps


def test_settings_that_set_neither_cannot_train(tmp_path):
    with pytest.raises(ValueError, match="set exactly one of epochs and train_minutes"):
        new_run(at.Settings(name="neither"), tmp_path)

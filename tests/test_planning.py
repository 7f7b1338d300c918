"""The run planned to the clock: measuring, planning, re-planning, precision."""

import dataclasses
import json
import math
import time

import pytest
import torch
from conftest import prepared_data

import annotated_transformer as at
import trainer

# the smoke preset shrunk: one quick epoch is a few batches of 200 pairs
SMALL = dataclasses.replace(
    at.SMOKE,
    name="planning",
    d_model=16,
    d_ff=32,
    train_pairs=200,
    eval_pairs=20,
    batch_tokens=400,
    warmup=4,
    average_last=1,
)
CPU = torch.device("cpu")
LESSON = trainer.Lesson.of(at)


@pytest.fixture
def data(tmp_path, monkeypatch):
    return prepared_data(SMALL, tmp_path, monkeypatch)


def new_run(settings, data, data_dir) -> trainer.Run:
    return trainer.new_run(LESSON, settings, data, data_dir, CPU, show=False)


def make_plan(settings, data, data_dir):
    """plan_run on the CPU with a fresh probe, as a new run makes its plan."""
    return trainer.plan_run(new_run(settings, data, data_dir), at.model_for(settings, data.vocabs))


def fake_speed(tokens_per_second: float, validation_seconds: float):
    """measure_speed as a fake clock would report it; the real one times real batches."""

    def measure(*args, **kwargs):
        return {"tokens_per_second": tokens_per_second, "validation_seconds": validation_seconds}

    return measure


def refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} must not run here")

    return refused


def test_measure_speed_times_real_training_steps_and_a_validation_pass(data, tmp_path):
    model = at.model_for(SMALL, data.vocabs)
    before = [p.detach().clone() for p in model.parameters()]
    speed = trainer.measure_speed(new_run(SMALL, data, tmp_path), model, steps=2)
    assert speed["tokens_per_second"] > 0 and speed["validation_seconds"] > 0
    # it trained the throwaway model it was given: the weights moved
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_plan_fits_the_epochs_to_the_minutes(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trainer, "measure_speed", fake_speed(100.0, 2.0))
    settings = dataclasses.replace(SMALL, train_minutes=1.0, average_last=2, precision="fp32")
    epoch_tokens = sum(len(tgt) - 1 for _, tgt in data.train)
    epoch_seconds = epoch_tokens / 100.0 + 2.0
    plan = make_plan(settings, data, tmp_path)
    assert plan["epochs"] == max(1, int((60.0 - 2.0) // epoch_seconds))
    assert plan["epochs"] * epoch_seconds + 2.0 <= 60.0 or plan["epochs"] == 1
    fitted = dataclasses.replace(settings, epochs=plan["epochs"])
    assert plan["steps"] == trainer.planned_steps(LESSON, fitted, data.train)
    assert "ending about" in capsys.readouterr().out


def test_a_faster_machine_plans_more_epochs(data, tmp_path, monkeypatch):
    settings = dataclasses.replace(SMALL, train_minutes=2.0, precision="fp32")
    epochs = []
    for speed in (50.0, 100.0, 400.0):
        monkeypatch.setattr(trainer, "measure_speed", fake_speed(speed, 1.0))
        epochs.append(make_plan(settings, data, tmp_path)["epochs"])
    assert epochs == sorted(epochs) and epochs[0] < epochs[-1]


def test_a_machine_too_slow_for_the_budget_is_told_so_in_one_line(
    data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(trainer, "measure_speed", fake_speed(1.0, 1.0))
    settings = dataclasses.replace(SMALL, train_minutes=1.0, precision="fp32")
    plan = make_plan(settings, data, tmp_path)
    assert plan["epochs"] == 1
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warning) == 1 and "1 epoch(s) fit in 1 minutes" in warning[0]


def test_a_fixed_run_measures_nothing(data, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer, "measure_speed", refuse("measuring a run of fixed epochs"))
    plan = make_plan(SMALL, data, tmp_path)
    steps = trainer.planned_steps(LESSON, SMALL, data.train)
    assert plan == {"epochs": SMALL.epochs, "steps": steps, "precision": "fp32"}


# --- re-planning after each epoch ------------------------------------------------------


def schedule_at(settings, pairs, plan: dict, epochs_done: int):
    """A planned run's schedule, stepped to the end of its first `epochs_done` epochs."""
    model = at.make_model(8, 8, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2))
    optimizer, schedule = at.make_optimizer(model, settings, total_steps=plan["steps"])
    done = dataclasses.replace(settings, epochs=epochs_done)
    for _ in range(trainer.planned_steps(LESSON, done, pairs)):
        optimizer.step()  # no gradients: a no-op that keeps LambdaLR from warning
        schedule.step()
    return schedule


@pytest.mark.parametrize(
    ("epoch_seconds", "epochs"),
    [
        (15.0, 4),  # 30 s spent, 30 left: two more epochs
        (10.0, 6),  # as planned: the plan and the schedule stay
        (5.0, 12),  # faster than the probe said: 50 s left, ten more
        (25.0, 3),  # 10 s left: one more, so the rate still reaches zero
        (45.0, 3),  # already over the budget: one more all the same
    ],
)
def test_a_replan_fits_the_epochs_left_to_the_minutes_left(data, epoch_seconds, epochs):
    settings = dataclasses.replace(SMALL, train_minutes=1.0, warmup=2, schedule="linear")
    six = trainer.planned_steps(LESSON, dataclasses.replace(settings, epochs=6), data.train)
    plan = {"epochs": 6, "steps": six, "warmup": 2, "validation_seconds": 1.0}
    schedule = schedule_at(settings, data.train, plan, 2)
    step, before = schedule.last_epoch, schedule.lr_lambdas[0]
    rate = before(step)
    history = [{"seconds": epoch_seconds - 1.0, "validation_seconds": 1.0}] * 2  # a fake clock
    new = trainer.replan(plan, settings, history, schedule, LESSON, data.train)
    assert new["epochs"] == epochs
    if epochs == plan["epochs"]:
        assert new is plan and schedule.lr_lambdas[0] is before
        return
    fitted = dataclasses.replace(settings, epochs=epochs)
    steps = trainer.planned_steps(LESSON, fitted, data.train)
    assert new["steps"] == steps and new["replans"][-1]["after_epoch"] == 1
    assert new["decay"] == {"from_step": step, "from_rate": rate, "to_step": steps}
    # the rate goes on from where it was, in a straight line to zero at the new end
    after = schedule.lr_lambdas[0]
    assert after(step) == rate and after(steps) == 0.0 and after(steps + 5) == 0.0
    middle = (step + steps) / 2
    assert math.isclose(after(middle), rate / 2)


def test_a_run_still_warming_up_or_at_its_end_keeps_its_plan(data):
    settings = dataclasses.replace(SMALL, train_minutes=1.0, warmup=2, schedule="linear")
    steps = trainer.planned_steps(LESSON, dataclasses.replace(settings, epochs=3), data.train)
    history = [{"seconds": 50.0, "validation_seconds": 1.0}]
    warming = {"epochs": 3, "steps": steps, "warmup": steps, "validation_seconds": 1.0}
    schedule = schedule_at(settings, data.train, warming, 1)
    assert trainer.replan(warming, settings, history, schedule, LESSON, data.train) is warming
    ending = warming | {"warmup": 2}
    schedule = schedule_at(settings, data.train, ending, 3)
    assert trainer.replan(ending, settings, history * 3, schedule, LESSON, data.train) is ending


# --- the whole planned path, as `make run` takes it ---------------------------------------


class Clock:
    """trainer's `time` module, with a perf_counter that runs at the real speed until
    `slow_down()`, then a thousand times slow, so that every later epoch overruns."""

    def __init__(self):
        self.speed, self.real_start = 1.0, time.perf_counter()
        self.start = self.real_start

    def __getattr__(self, name):
        return getattr(time, name)

    def perf_counter(self) -> float:
        return self.start + self.speed * (time.perf_counter() - self.real_start)

    def slow_down(self) -> None:
        self.start, self.real_start = self.perf_counter(), time.perf_counter()
        self.speed = 1000.0


def recording_rates(lesson, rates: list):
    """`lesson` with a run_epoch that records the learning rate after every training step."""

    def run_epoch(*args, on_step=None, **kwargs):
        schedule = args[4]

        def step_and_record(*step):
            rates.append(schedule.get_last_lr()[0])  # the rate of the step to come
            on_step(*step)

        return lesson.run_epoch(*args, on_step=on_step and step_and_record, **kwargs)

    return dataclasses.replace(lesson, run_epoch=run_epoch)


def test_a_planned_run_measures_plans_replans_and_ends_its_rate_at_zero(
    data, tmp_path, monkeypatch, capsys
):
    """The real path of a `train_minutes` run: choose_precision times bf16 against
    float32 on this CPU with the real model, plan_run times real training steps and a
    validation pass, and after the first epoch past the warm-up the run re-plans (a
    clock made slow once the plan is made says that every epoch overran). The rate
    falls to zero exactly at the last planned step; a resumed run keeps the plan."""
    settings = dataclasses.replace(SMALL, train_minutes=0.1, precision="auto", warmup=2)
    clock, plan_run = Clock(), trainer.plan_run

    def plan_then_slow_down(*args):
        plan = plan_run(*args)
        clock.slow_down()
        return plan

    monkeypatch.setattr(trainer, "time", clock)
    monkeypatch.setattr(trainer, "plan_run", plan_then_slow_down)
    rates = []
    lesson = recording_rates(LESSON, rates)
    trained = trainer.load_or_train(lesson, settings, data, tmp_path, device=CPU, show=False)
    out = capsys.readouterr().out
    assert "one validation batch, forward and backward:" in out  # choose_precision measured
    assert "plan:" in out and "re-plan:" in out

    plan = trained.history[-1]["plan"]
    assert plan["tokens_per_second"] > 0 and plan["validation_seconds"] > 0  # measured
    assert plan["precision"] in ("bf16", "fp32") and plan["made"]
    (change,) = plan["replans"]  # after the first epoch past the warm-up: one more
    assert change["after_epoch"] == 0 and change["was"] > plan["epochs"] == 2
    assert len(trained.history) == plan["epochs"]
    fitted = dataclasses.replace(settings, epochs=plan["epochs"])
    assert plan["steps"] == trainer.planned_steps(LESSON, fitted, data.train)
    assert plan["decay"]["to_step"] == plan["steps"]
    # the rate after each step: positive to the last planned step, zero after it
    assert len(rates) == plan["steps"] and rates[-1] == 0.0 and min(rates[:-1]) > 0
    last = trainer.read_checkpoint(trained.folder / "last.pt")
    assert last["state"]["step"] == plan["steps"] and last["schedule"]["_last_lr"] == [0.0]
    assert json.loads((trained.folder / "plan.json").read_text()) == plan

    # resumed (on a machine of another speed, say): no measuring, the plan it ended with
    monkeypatch.setattr(trainer, "measure_speed", refuse("measuring a resumed run"))
    monkeypatch.setattr(trainer, "bf16_pays_off", refuse("timing a resumed run's precision"))
    again = trainer.train_model(new_run(settings, data, tmp_path))
    assert again.plan == plan and again.precision == plan["precision"]

"""The bookkeeping of a real training run: the helpers that the notebook's `train` calls.

`train`, in Part 6 of the notebook, is Part 3's loop over epochs with calls to this module
in between. Read it top to bottom, in the order a run meets it:

1. **The precision.** `choose_precision` times bf16 against float32 on a CPU.
2. **The plan.** A frozen `Plan` holds the epochs and the optimizer steps at which the
   linear schedule reaches zero. With `train_minutes`, the run times its first steps,
   plans as many epochs as fit, and re-plans after each epoch with the epochs' real time.
3. **The run.** `start` resumes a stopped run from its `last.pt` or plans a new one; `Run`
   keeps the history, saves checkpoints and the final model. A resumed run goes on bit for
   bit on a CPU, but for later re-plans, which follow the clock.
4. **Loading** a finished run (`load_final`), and the record of a run (`run_record`).

A run's folder (`run_folder`, named by what training reaches) comes from plumbing.py, like
the files and random states. This module imports plumbing and nothing else of the project:
never the notebook or its `.py` twin (a test holds the import direction). DDP's worker
processes, which need the twin's `train`, start from tools/train_ddp.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from plumbing import (  # noqa: F401 (run_folder: the notebook and the tools call it here)
    CheckpointError,
    gather_from_ranks,
    gpu_report,
    peak_memory_gb,
    random_states,
    read_checkpoint,
    restore_random_states,
    run_folder,
    save_checkpoint,
    sum_over_ranks,
    what_changed,
)

# ---------------------------------------------------------------------------------------
# 1. Precision


def autocast_for(device: torch.device, precision: str):
    """A factory of contexts: bf16 autocast on CUDA or a CPU if precision is "bf16"."""
    if precision == "bf16" and device.type in ("cuda", "cpu"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def bf16_pays_off(model: nn.Module, batch, repeats: int = 3, margin: float = 1.2):
    """Time forward and backward of one batch in float32 and in bf16, alternately.

    Returns (pays, fp32 seconds, bf16 seconds): pays when bf16's best time beats float32's
    by `margin`. Stops early where bf16 is far slower (no bf16 hardware). Runs in eval
    mode, so dropout draws no random numbers, and clears the gradients it made.
    """
    model.eval()
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for i in range(repeats + 1):  # the first round only warms up
        for precision, spent in times.items():
            start = time.perf_counter()
            with autocast_for(torch.device("cpu"), precision)():
                out = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
                log_probs = model.generator(out)
            log_probs.float().sum().backward()
            spent.append(time.perf_counter() - start)
        timed = {name: spent[1:] or spent for name, spent in times.items()}
        if min(timed["bf16"]) > (4 if i == 0 else 2) * min(timed["fp32"]):
            break
    model.zero_grad(set_to_none=True)
    fp32, bf16 = min(timed["fp32"]), min(timed["bf16"])
    return fp32 > margin * bf16, fp32, bf16


def choose_precision(settings, device, model: nn.Module, batch, world_size: int = 1):
    """("bf16" or "fp32", why) for a new run: measured on a CPU, bf16 on CUDA."""
    if settings.precision == "fp32" or device.type == "mps":
        return "fp32", "float32, as the settings ask" if device.type != "mps" else "on MPS"
    if settings.precision == "bf16" or device.type == "cuda":
        return "bf16", "bf16, as the settings ask" if device.type != "cuda" else "bf16 on CUDA"
    if world_size > 1:  # the ranks would have to agree; CPU processes stay in float32
        return "fp32", "float32: several CPU processes do not time bf16"
    pays, fp32, bf16 = bf16_pays_off(model, batch)
    why = f"one batch took {fp32:.2f} s in float32 and {bf16:.2f} s in bf16 here"
    return ("bf16" if pays else "fp32"), why


# ---------------------------------------------------------------------------------------
# 2. The plan

TIMED_STEPS = (3, 23)  # a planned run times optimizer steps 3 to 23 (the first two warm up)
NO_END_YET = 10**9  # the schedule's end while a planned run has yet to time its steps
MIN_USEFUL_EPOCHS = 3  # a planned run of fewer epochs gets a warning


@dataclass(frozen=True)
class Plan:
    """How long a run trains. A re-plan makes a new one."""

    epochs: int
    precision: str  # "fp32" or "bf16", chosen once
    epoch_steps: int = 0  # optimizer steps of one epoch, counted as one process counts them
    train_minutes: float | None = None  # the budget of a run planned to the clock
    tokens_per_second: float | None = None  # training speed over the first timed steps
    epoch_seconds: float | None = None  # an epoch's time: first estimated, then measured
    timed: bool = False  # whether a planned run has timed its first steps yet
    made: str = ""  # when the steps were timed, for a person reading the record
    replans: tuple = ()  # one dict per re-plan: after which epoch, epochs before and after
    why_precision: str = ""  # what decided the precision

    @property
    def steps(self) -> int:
        """The optimizer steps of the whole run: where the linear schedule reaches zero."""
        return self.epochs * self.epoch_steps


def epochs_that_fit(plan: Plan, epoch_seconds: float, done: int, spent: float) -> Plan:
    """The plan with as many epochs as fit the minutes left, at least one more than `done`."""
    left = 60 * plan.train_minutes - spent
    epochs = done + max(1, int(left // epoch_seconds))
    return dataclasses.replace(plan, epochs=epochs, epoch_seconds=epoch_seconds)


def say_plan(plan: Plan, done: int, label: str) -> None:
    """One line: the epochs planned, their steps and when training should end."""
    ends = time.time() + (plan.epochs - done) * plan.epoch_seconds
    ends_at = time.strftime("%H:%M", time.localtime(ends))
    print(f"{label}: epochs take {plan.epoch_seconds:.0f} s here, so {plan.epochs} epochs ", end="")
    print(f"in all; the rate reaches zero at step {plan.steps:,}, about {ends_at}")
    if plan.epochs < MIN_USEFUL_EPOCHS:
        print(
            f"warning: only {plan.epochs} epoch(s) fit in {plan.train_minutes:g} minutes here; "
            "raise train_minutes, or expect a weak translator"
        )


def replanned(plan: Plan, history: list[dict], average_last: int) -> Plan:
    """After an epoch of a planned run: the epochs left fitted to the minutes left."""
    done = len(history)
    if plan.train_minutes is None or done >= plan.epochs:
        return plan
    spent = sum(h["seconds"] + h["validation_seconds"] for h in history)
    averaging = history[-1]["validation_seconds"] if average_last > 1 else 0
    new = epochs_that_fit(plan, spent / done, done, spent + averaging)
    if new.epochs != plan.epochs:
        change = {"after_epoch": done - 1, "epoch_seconds": spent / done}
        change |= {"was": plan.epochs, "epochs": new.epochs, "steps": new.steps}
        new = dataclasses.replace(new, replans=(*new.replans, change))
        say_plan(new, done, f"re-plan (was {plan.epochs} epochs)")
    return new


def timed_plan(plan: Plan, seconds: float, tokens: int, epoch_tokens: int) -> Plan:
    """A planned run's first plan, from `tokens` trained in `seconds`."""
    per_epoch = epoch_tokens * seconds / max(tokens, 1)  # training only, as yet
    plan = epochs_that_fit(plan, per_epoch, done=0, spent=0.0)
    made = time.strftime("%Y-%m-%d %H:%M")
    plan = dataclasses.replace(plan, tokens_per_second=tokens / seconds, timed=True, made=made)
    say_plan(plan, 0, "plan")
    return plan


def decisions(history: list[dict], schedule: str) -> str:
    """What decided the maths of a finished run, in three lines."""
    plan = history[-1]["plan"]
    why = plan.get("why_precision") or "chosen at the start"
    budget = f"planned to {plan['train_minutes']:g} minutes" if plan["train_minutes"] else ""
    epochs = f"{len(history)} epochs, " + (budget or "as the settings ask")
    if plan.get("replans"):
        epochs += f" (re-planned {' → '.join(str(c['epochs']) for c in plan['replans'])})"
    end = "never (the paper's schedule)"
    if schedule == "linear":
        end = f"zero at step {plan['steps']:,}, the last step of epoch {plan['epochs'] - 1}"
    return f"precision: {plan['precision']} ({why})\nepochs: {epochs}\nlearning rate: {end}"


# ---------------------------------------------------------------------------------------
# 3. The run: checkpoints and exact resume


def seed_of_rank(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s dropout: its own stream, the same on every run."""
    return seed + 7919 * (rank + 1)


def read_last(folder: Path, world_size: int) -> dict | None:
    """The run's `last.pt`, or None. Every rank must see the same one, or none: a rank on
    another machine without a shared filesystem would start afresh and hang the job."""
    last = folder / "last.pt"
    checkpoint = read_checkpoint(last) if last.is_file() else None
    steps = gather_from_ranks(checkpoint["state"]["step"] if checkpoint else None)
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks see different checkpoints in {folder} (optimizer steps by rank, "
            f"None for none: {steps}): put data/ on a filesystem that every machine shares"
        )
    if checkpoint is not None and len(checkpoint["ranks"]) != world_size:
        raise CheckpointError(
            f"{last} was written by a run on {len(checkpoint['ranks'])} "
            f"process(es), not {world_size}: resume with as many, or retrain"
        )
    return checkpoint


def start(settings, folder: Path, model: nn.Module, batch, *, rank=0, world_size=1) -> Run:
    """A run of `settings` in `folder`: resumed from its last.pt, or new with a plan."""
    if (settings.epochs is None) == (settings.train_minutes is None):
        raise ValueError("set exactly one of epochs and train_minutes")
    checkpoint = read_last(folder, world_size)
    if checkpoint is not None:
        print(f"resuming from {folder / 'last.pt'}")
        return Run(settings, folder, Plan(**checkpoint["plan"]), rank, world_size, checkpoint)
    if settings.train_minutes is not None and world_size > 1:
        raise ValueError("train_minutes plans one process's run: set epochs to train on several")
    device = next(model.parameters()).device
    precision, why = choose_precision(settings, device, model, batch, world_size)
    print(f"precision: {precision} ({why})")
    plan = Plan(settings.epochs or 0, precision, train_minutes=settings.train_minutes)
    plan = dataclasses.replace(plan, why_precision=why)
    if plan.train_minutes is not None:
        print(f"planning {plan.train_minutes:g} minutes: timing the first steps, then the epochs")
    return Run(settings, folder, plan, rank, world_size, checkpoint)


def load_weights(model: nn.Module, weights: dict, path: Path) -> None:
    """model.load_state_dict, with one line that names the file where they do not fit."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        problem = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        raise CheckpointError(
            f"{path} does not fit this model ({problem[:120]}): it was trained with other "
            "settings or vocabularies; move it away, or pass retrain=True to run_folder"
        ) from None


def save_last(run: Run, ranks: list) -> None:
    """Write the run's last.pt: everything resuming needs, every rank's position."""
    save_checkpoint(
        run.folder / "last.pt", model=run.model.state_dict(),
        optimizer=run.optimizer.state_dict(), schedule=run.schedule.state_dict(),
        state=dataclasses.asdict(run.state), history=run.history,
        plan=dataclasses.asdict(run.plan), ranks=ranks,
    )  # fmt: skip


def with_plan(history: list[dict], plan: Plan, warmup: int, averaged: dict | None) -> list:
    """The history whose last record also holds the plan, and the averaged model if any."""
    last = history[-1] | {"plan": dataclasses.asdict(plan) | {"steps": plan.steps}}
    last["plan"]["warmup"] = warmup
    return [*history[:-1], last | ({"averaged": averaged} if averaged else {})]


def load_last(checkpoint: dict, run: Run, path: Path) -> None:
    """Put a last.pt back into the loop's objects, and this rank's random states."""
    load_weights(run.model, checkpoint["model"], path)
    run.optimizer.load_state_dict(checkpoint["optimizer"])
    run.schedule.load_state_dict(checkpoint["schedule"])
    for name, value in checkpoint["state"].items():
        setattr(run.state, name, value)
    restore_random_states(checkpoint["ranks"][run.rank]["random"])


def keep_for_average(folder: Path, model: nn.Module, epoch: int, average_last: int) -> None:
    """Keep the last `average_last` epochs' weights (a rolling set of files)."""
    save_checkpoint(folder / f"epoch-{epoch}.pt", model=model.state_dict())
    (folder / f"epoch-{epoch - average_last}.pt").unlink(missing_ok=True)


def average_of(paths: list[Path]) -> dict:
    """The element-wise mean of the weights saved in `paths`."""
    weights = [read_checkpoint(path)["model"] for path in paths]
    return {name: sum(w[name] for w in weights) / len(weights) for name in weights[0]}


def seed_dropout(seed: int, rank: int) -> None:
    """Seed a fresh run's dropout and batch order: each rank its own stream."""
    seed = seed_of_rank(seed, rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def progress_bar(batches: int, epoch: int, done: int, *, off: bool) -> tqdm:
    """The bar of an epoch's batches, updated at most every 5 seconds."""
    return tqdm(total=batches, desc=f"epoch {epoch}", mininterval=5, leave=False,
                disable=off, initial=done)  # fmt: skip


def epoch_record(run: Run, loss: float, tokens: int, validation_seconds: float) -> dict:
    """The history's record of the epoch that `run` has just trained, but its scores."""
    return {
        "epoch": run.epoch, "train_loss": loss / max(tokens, 1), "seconds": run.now.seconds,
        "validation_seconds": validation_seconds, "tokens": int(tokens),
        "precision": run.plan.precision, "rates": run.now.rates,
    }  # fmt: skip


def epoch_line(record: dict) -> str:
    """The one line printed after each epoch."""
    line = f"epoch {record['epoch']}: train loss {record['train_loss']:.3f}, "
    line += f"val loss {record['val_loss']:.3f}, val BLEU {record['val_bleu']:.1f}, "
    return line + f"{record['tokens'] / record['seconds']:,.0f} target tokens/s"


@dataclass
class Position:
    """Where an epoch stands: batches trained, their summed loss, target tokens, seconds,
    and the learning rate that each optimizer step took."""

    done: int = 0
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    rates: list = dataclasses.field(default_factory=list)


class Run:
    """One training run, as the loop sees it: its plan, its history, where it stands. The
    loop calls `resume`; per epoch, `start_epoch`, `step_done` and `end_epoch`; `finish`."""

    def __init__(self, settings, folder, plan, rank=0, world_size=1, checkpoint=None):
        self.settings, self.folder, self.plan = settings, Path(folder), plan
        self.rank, self.world_size, self.checkpoint = rank, world_size, checkpoint
        self.history: list[dict] = checkpoint["history"] if checkpoint else []
        own = checkpoint["ranks"][rank]["position"] if checkpoint else {}
        self.now = Position(**own)  # the epoch in progress
        self.before = Position()  # what was done before this session's run_epoch began
        self.model = self.optimizer = self.schedule = self.state = None  # the loop's
        self.bar = None  # the epoch's progress bar
        self.clock = 0.0  # perf_counter at the epoch's start, as if it never stopped
        self.timer: dict | None = None  # where a planned run started timing its steps
        self.batches = self.batch_tokens = 0  # the epoch's batches and their target tokens
        self.next_rate = 0.0  # the rate the next optimizer step will take

    @property
    def epoch(self) -> int:
        return len(self.history)

    def autocast(self):
        """The mixed-precision context of this run's training and validation."""
        return autocast_for(next(self.model.parameters()).device, self.plan.precision)()

    def untimed(self) -> bool:
        """Whether this is a planned run that has yet to time its first steps."""
        return self.plan.train_minutes is not None and not self.plan.timed

    def planned_steps(self) -> int:
        """Where the linear rate reaches zero (read at every step; far away until timed)."""
        return NO_END_YET if self.untimed() else self.plan.steps

    def resume(self, model, optimizer, schedule, state):
        """Load the last checkpoint into the loop's objects, or seed a fresh run's dropout."""
        self.model, self.optimizer, self.schedule, self.state = model, optimizer, schedule, state
        if self.checkpoint is None:
            seed_dropout(self.settings.seed, self.rank)  # the ranks' dropout differs
            return state
        load_last(self.checkpoint, self, self.folder / "last.pt")
        print(f"resumed at epoch {self.epoch}, batch {self.now.done}, step {state.step}")
        self.checkpoint = None  # read once
        return state

    def epochs(self) -> Iterator[int]:
        """The epochs left to train; a re-plan after one may change how many."""
        while self.epoch < self.plan.epochs or self.untimed():
            yield self.epoch

    def start_epoch(self, batches: list) -> list:
        """Start the clock and the bar; return the batches a resumed epoch has yet to train."""
        if not self.plan.epoch_steps:
            steps = math.ceil(len(batches) / self.settings.accum_iter) * self.world_size
            self.plan = dataclasses.replace(self.plan, epoch_steps=steps)
        self.batches, self.batch_tokens = len(batches), sum(b.ntokens for b in batches)
        self.bar = progress_bar(len(batches), self.epoch, self.now.done, off=self.rank != 0)
        self.clock = time.perf_counter() - self.now.seconds
        self.before = dataclasses.replace(self.now, rates=list(self.now.rates))
        self.next_rate = self.schedule.get_last_lr()[0] if self.schedule else 0.0
        return batches[self.now.done :]

    def step_done(self, micro_batches: int, loss: float, tokens: int) -> None:
        """After each optimizer step (run_epoch's `on_step`): the bar, the plan, a checkpoint."""
        self.now.done, self.now.loss = self.before.done + micro_batches, self.before.loss + loss
        self.now.tokens = self.before.tokens + tokens
        self.now.seconds = time.perf_counter() - self.clock
        self.now.rates.append(self.next_rate)  # the rate this step took
        self.next_rate = self.schedule.get_last_lr()[0] if self.schedule else 0.0
        self.bar.update(self.now.done - self.bar.n)
        self.bar.set_postfix(loss=f"{loss / max(tokens, 1):.3f}", refresh=False)
        if self.untimed():
            self.time_first_steps(self.state.step)
        every = self.settings.checkpoint_steps
        if every and self.state.step % every == 0 and self.now.done < self.batches:
            self.save()

    def time_first_steps(self, step: int) -> None:
        """In a planned run's first epoch: time steps TIMED_STEPS, then plan the epochs."""
        if step == TIMED_STEPS[0] or self.timer is None:
            self.timer = {"step": step, "clock": time.perf_counter(), "tokens": self.now.tokens}
        if step >= TIMED_STEPS[1] or self.now.done == self.batches:  # or a short epoch's end
            whole = {"step": 1, "clock": self.clock, "tokens": 0}  # if nothing was timed yet
            timer = whole if step == self.timer["step"] else self.timer
            seconds = max(time.perf_counter() - timer["clock"], 1e-9)
            tokens = self.now.tokens - timer["tokens"]
            print(f"steps {timer['step']} to {step}: {tokens / seconds:,.0f} target tokens/s")
            self.plan = timed_plan(self.plan, seconds, tokens, self.batch_tokens)

    def end_epoch(self, *, val_loss: float, val_bleu=None, watched=None) -> None:
        """Record the epoch, re-plan a planned run, keep weights to average, save last.pt."""
        self.bar.close()
        device = next(self.model.parameters()).device
        loss, tokens = sum_over_ranks([self.now.loss, self.now.tokens], device)
        validation = time.perf_counter() - self.clock - self.now.seconds
        scores = {"val_loss": val_loss, "val_bleu": val_bleu, "watched": watched}
        self.history.append(epoch_record(self, loss, tokens, validation) | scores)
        if self.rank == 0:
            print(epoch_line(self.history[-1]))
        if self.rank == 0 and torch.cuda.is_available():
            print(gpu_report())
        self.plan = replanned(self.plan, self.history, self.settings.average_last)
        if self.rank == 0 and self.settings.average_last > 1:
            keep_for_average(self.folder, self.model, self.epoch - 1, self.settings.average_last)
        self.now = Position()
        self.save()

    def save(self) -> None:
        """Write last.pt: everything resuming needs. Every rank calls it; rank 0 writes."""
        ranks = gather_from_ranks(
            {"position": dataclasses.asdict(self.now), "random": random_states()}
        )
        if self.rank == 0:
            save_last(self, ranks)

    def averaged_weights(self) -> dict | None:
        """{"epochs": the last epochs, "weights": their mean} (§6.1), or None."""
        if self.rank != 0 or self.settings.average_last < 2:
            return None
        last = list(range(max(self.epoch - self.settings.average_last, 0), self.epoch))
        return {
            "epochs": last,
            "weights": average_of([self.folder / f"epoch-{e}.pt" for e in last]),
        }

    def finish(self, averaged: dict | None = None) -> list[dict]:
        """Write final.pt (the model, the history, the plan, and `averaged`: the averaged
        model's epochs and scores, if any); return the history."""
        self.history = with_plan(self.history, self.plan, self.settings.warmup, averaged)
        if self.rank == 0:
            final = self.folder / "final.pt"
            save_checkpoint(final, model=self.model.state_dict(), history=self.history)
        return self.history


# ---------------------------------------------------------------------------------------
# 4. A finished run, and its record


def load_final(folder: Path, model: nn.Module) -> tuple[nn.Module, list] | None:
    """The finished model of the run in `folder`, loaded into `model`, or None."""
    final = Path(folder) / "final.pt"
    if not final.is_file():
        if not (Path(folder) / "last.pt").is_file():  # else `start` says it resumes
            changed = what_changed(folder)
            print(
                f"trained before with {changed}; training anew" if changed else "training", end=""
            )
            print(f" into {folder}")
        return None
    checkpoint = read_checkpoint(final)
    load_weights(model, checkpoint["model"], final)
    print(f"loaded {final}")
    return model, checkpoint["history"]


def run_record(model, history, settings, folder, test_results: dict, device) -> dict:
    """The fields of build/results.json: the run's own settings beside its own history."""
    train_seconds = sum(h["seconds"] for h in history)
    return {
        "preset": settings.name,
        "device": str(device),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "epochs": len(history),
        "train_seconds": train_seconds,
        "train_tokens_per_second": sum(h["tokens"] for h in history) / max(train_seconds, 1e-9),
        "val_loss": history[-1]["val_loss"],
        "val_bleu_history": [h["val_bleu"] for h in history],
        "watched": [h.get("watched") for h in history],
        "precision": history[-1].get("precision"),
        "plan": history[-1].get("plan"),  # the epochs and the speed measured to plan them
        "averaged": history[-1].get("averaged"),  # the model scored, if it averaged
        **test_results,
        "history": history,
        "settings": dataclasses.asdict(settings),
        "run_folder": str(folder),
        "peak_memory_gb": peak_memory_gb(),  # of this process (the kernel), so far
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }

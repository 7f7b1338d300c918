"""The helpers that the notebook's training loop calls: read it top to bottom.

The loop itself is the notebook's `train`: it builds the model, the loss, the optimizer
and the schedule, then for each epoch calls the lesson's `run_epoch`, `evaluate` and
`validation_bleu`. What a real run needs besides, and what teaches nothing about the
Transformer, is here, in the order a run meets it:

1. **Its folder.** `run_folder` names it by everything that shapes the trained model:
   the settings, the data, every definition of the lesson and this module's own code.
   `manifest.json` in the folder says what made it, so an edited cell or a changed
   setting trains anew beside the old model, and the message says what changed.
2. **The precision.** `choose_precision` times bf16 against float32 on a CPU.
3. **The plan.** A frozen `Plan` holds the epochs and the optimizer steps that the
   linear schedule counts down to. With `train_minutes`, the run times its own first
   steps, plans as many epochs as fit, and re-plans after each epoch with the epochs'
   real time. A re-plan returns a new `Plan`; the schedule reads the plan's steps.
4. **Checkpoints and exact resume.** `last.pt` is written every `checkpoint_steps`
   optimizer steps and after every epoch. A run started again goes on from its last
   checkpoint, bit for bit on a CPU but for later re-plans, which follow the clock. A
   run stopped before its first checkpoint starts over, with a fresh plan.
5. **Averaging** of the last epochs' weights (§6.1 of the paper), and `final.pt`.
6. **The record** of a run (build/results.json), and the processes of Part 10.

Nothing here calls the notebook: the loop calls these helpers, so the code a student
ran is the code that trains. Only DDP's new processes import the notebook's `.py` twin,
since they cannot see the notebook.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import os
import platform
import random
import textwrap
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from plumbing import (
    CheckpointError,
    fingerprint,
    free_port,
    gather_from_ranks,
    gpu_report,
    peak_memory_gb,
    prepare_cpu_memory,
    random_states,
    read_checkpoint,
    restore_random_states,
    save_checkpoint,
    sum_over_ranks,
    write_atomically,
)

# ---------------------------------------------------------------------------------------
# 1. The run's folder: named by what made the model


def lesson_code(namespace: dict) -> dict[str, str]:
    """A hash of every definition of the lesson, name by name.

    The lesson is what the notebook's `.py` twin defines at its top level (the exercises'
    answers and the demonstrations are not), plus any function or class of `namespace`
    that those use, taken from `namespace` as it is now: an edited cell counts. A name
    that `namespace` lacks yet (a cell below the training cell, not run so far) counts as
    the twin writes it, so a run is named alike before and after Run All. Syntax trees,
    not text, so a changed comment keeps the hash.
    """
    module = namespace.get("__name__")
    own = {
        name: value
        for name, value in namespace.items()
        if getattr(value, "__module__", None) == module
        and (inspect.isfunction(value) or isinstance(value, type))
    }
    twin_names = _twin_names()
    todo, twin = sorted(twin_names or own), None
    names: dict[str, str] = {}
    while todo:
        name = todo.pop()
        if name in names:
            continue
        if name in namespace:
            value, defined = namespace[name], name in own
        elif name in twin_names:  # a cell below the one running now: the twin's, as written
            twin = twin or vars(importlib.import_module("annotated_transformer"))
            value = twin[name]
            defined = getattr(value, "__module__", None) == "annotated_transformer" and (
                inspect.isfunction(value) or isinstance(value, type)
            )
        else:
            continue
        if defined:
            names[name] = fingerprint(_source_of(value))
            todo += sorted(n for n in _names_used(value) if n in own)
        elif name.isupper() and isinstance(value, int | float | str | bool | tuple):
            names[name] = repr(value)  # MAX_POSITIONS and the like
    return dict(sorted(names.items()))


def _twin_names() -> set[str]:
    """The top-level names that annotated_transformer.py defines, or none without it."""
    twin = Path(__file__).with_name("annotated_transformer.py")
    if not twin.is_file():
        return set()
    names = set()
    for node in ast.parse(twin.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _source_of(value) -> str:
    """A function's syntax tree; a class's bases, fields and methods. Never a blank."""
    if isinstance(value, type):
        fields = dataclasses.fields(value) if dataclasses.is_dataclass(value) else ()
        parts = [f"class {value.__qualname__}({[b.__qualname__ for b in value.__bases__]})"]
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        parts += [f"{f.name}: {f.type} = {defaults.get(f.name, '')!r}" for f in fields]
        for name, member in sorted(vars(value).items()):
            function = getattr(member, "__func__", member)  # a staticmethod's or classmethod's
            made = {"<string>", dataclasses.__file__}  # where @dataclass makes its methods
            if inspect.isfunction(function) and function.__code__.co_filename in made:
                parts.append(name)  # made from the fields above
            elif inspect.isfunction(function):
                parts.append(_source_of(function))
            elif isinstance(member, int | float | str | bool | tuple) and name[:2] != "__":
                parts.append(f"{name} = {member!r}")
        return "\n".join(parts)
    try:
        return ast.dump(ast.parse(textwrap.dedent(inspect.getsource(value))))
    except (OSError, TypeError, SyntaxError) as error:
        raise CheckpointError(
            f"cannot read the code of {value.__qualname__} ({error}): define it in a cell "
            "or a file, so that the run's folder can be named by it"
        ) from error


def _names_used(value) -> set[str]:
    """The global names that a function, or a class's methods, refer to."""
    if isinstance(value, type):
        members = [getattr(m, "__func__", m) for m in vars(value).values()]
        used = {b.__name__ for b in value.__bases__}
        return used.union(*(_names_used(m) for m in members if inspect.isfunction(m)))

    def names_in(code: types.CodeType) -> set[str]:
        inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
        return set(code.co_names).union(*(names_in(c) for c in inner))

    return names_in(value.__code__)


# The settings that do not change what training computes.
NOT_TRAINING = ("name", "beam_size", "length_penalty", "checkpoint_steps")


def manifest(settings, data, namespace: dict) -> dict:
    """What a run is made of: settings, data, the lesson's code and this module's code."""
    vocabs = data.vocabs
    return {
        "preset": settings.name,
        "settings": {
            k: v for k, v in dataclasses.asdict(settings).items() if k not in NOT_TRAINING
        },
        "data": {
            "vocabularies": fingerprint([vocabs["de"].itos, vocabs["en"].itos]),
            "training pairs": fingerprint(data.train),
        },
        "code": lesson_code(namespace),
        "trainer": fingerprint(ast.dump(ast.parse(Path(__file__).read_text(encoding="utf-8")))),
    }


def run_folder(settings, data, namespace: dict, data_dir: Path) -> Path:
    """data/checkpoints/<preset>-<8 hex digits of the manifest>, with its manifest.json."""
    made_of = manifest(settings, data, namespace)
    folder = Path(data_dir) / "checkpoints" / f"{settings.name}-{fingerprint(made_of)[:8]}"
    if not (folder / "manifest.json").is_file():
        write_atomically(folder / "manifest.json", json.dumps(made_of, indent=1).encode())
    return folder


def what_changed(folder: Path) -> str:
    """How this run differs from the newest other run of its preset, in a few words."""
    mine = json.loads((folder / "manifest.json").read_text())
    others = [
        m for m in folder.parent.glob(f"{mine['preset']}-*/manifest.json") if m.parent != folder
    ]
    if not others:
        return ""
    theirs = json.loads(max(others, key=lambda m: m.stat().st_mtime).read_text())
    changes = []
    for part, label in (("settings", "other settings"), ("code", "other code")):
        names = sorted(
            k
            for k in mine[part].keys() | theirs[part].keys()
            if mine[part].get(k) != theirs[part].get(k)
        )
        if names:
            changes.append(f"{label} for: {', '.join(names)}")
    if mine["data"] != theirs["data"]:
        changes.append("other data")
    if mine["trainer"] != theirs["trainer"]:
        changes.append("another trainer.py")
    return "; ".join(changes)


# ---------------------------------------------------------------------------------------
# 2. Precision


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


def choose_precision(settings, device, model: nn.Module, batch, world_size: int = 1) -> str:
    """ "bf16" or "fp32" for a new run: measured on a CPU, bf16 on CUDA."""
    if settings.precision == "fp32" or device.type == "mps":
        return "fp32"
    if settings.precision == "bf16" or device.type == "cuda":
        return "bf16"
    if world_size > 1:  # the ranks would have to agree; CPU processes stay in float32
        return "fp32"
    pays, fp32, bf16 = bf16_pays_off(model, batch)
    choice = "bf16" if pays else "float32"
    print(f"one validation batch, forward and backward: {fp32:.2f} s in float32, ", end="")
    print(f"{bf16:.2f} s in bf16 -> training in {choice}")
    return "bf16" if pays else "fp32"


# ---------------------------------------------------------------------------------------
# 3. The plan

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
    made: str = ""  # when the plan was made, for a person reading the record
    replans: tuple = ()  # one dict per re-plan: after which epoch, epochs before and after

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
    print(f"{label}: epochs take {plan.epoch_seconds:.0f} s here, so {plan.epochs} ", end="")
    print(f"epochs in all, {plan.steps:,} steps, ending about {ends_at}")
    if plan.epochs < MIN_USEFUL_EPOCHS:
        print(
            f"warning: only {plan.epochs} epoch(s) fit in {plan.train_minutes:g} minutes here; "
            "raise train_minutes, or expect a weak translator"
        )


# ---------------------------------------------------------------------------------------
# 4. The run: checkpoints and exact resume


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
            f"process(es), not {world_size}: resume with as many, or delete its folder"
        )
    return checkpoint


def start(settings, folder: Path, model: nn.Module, batch, *, rank=0, world_size=1) -> Run:
    """A run of `settings` in `folder`: resumed from its last.pt, or new with a plan."""
    checkpoint = read_last(folder, world_size)
    if checkpoint is not None:
        print(f"resuming from {folder / 'last.pt'}")
        return Run(settings, folder, Plan(**checkpoint["plan"]), rank, world_size, checkpoint)
    if settings.train_minutes is not None and world_size > 1:
        raise ValueError("train_minutes plans one process's run: set epochs to train on several")
    device = next(model.parameters()).device
    precision = choose_precision(settings, device, model, batch, world_size)
    plan = Plan(settings.epochs, precision, train_minutes=settings.train_minutes)
    if plan.train_minutes is not None:
        print(f"planning {plan.train_minutes:g} minutes: timing the first steps, then the epochs")
    return Run(settings, folder, plan, rank, world_size)


class Run:
    """One training run, as the loop sees it: its plan, its history, where it stands.

    Its methods are called in the loop's order: `resume` once, then for each epoch
    `unfinished`, `step_done` after each optimizer step, and `end_epoch`; `finish` last.
    """

    def __init__(self, settings, folder, plan, rank=0, world_size=1, checkpoint=None):
        self.settings, self.folder, self.plan = settings, Path(folder), plan
        self.rank, self.world_size, self.checkpoint = rank, world_size, checkpoint
        self.history: list[dict] = checkpoint["history"] if checkpoint else []
        self.epoch = len(self.history)
        # the epoch in progress: batches done, their summed loss, tokens and seconds
        own = checkpoint["ranks"][rank]["position"] if checkpoint else {}
        self.done, self.loss = own.get("done", 0), own.get("loss", 0.0)
        self.tokens, self.seconds = own.get("tokens", 0), own.get("seconds", 0.0)
        self.objects: tuple = ()  # the loop's model, optimizer, schedule and TrainState
        self.bar, self.timer = None, None

    def autocast(self):
        """The mixed-precision context of this run's training and validation."""
        device = next(self.objects[0].parameters()).device
        return autocast_for(device, self.plan.precision)()

    def planned_steps(self) -> int:
        """Where the linear schedule reaches zero: read at every step, so a re-plan moves it.

        A run planned to the clock has no end until its first steps are timed: until then
        the end is far away, so the rate does not start to fall towards a guess.
        """
        if self.plan.train_minutes is not None and not self.plan.made:
            return NO_END_YET
        return self.plan.steps

    def resume(self, model, optimizer, schedule, state):
        """Load the last checkpoint into the loop's objects, or seed a fresh run's dropout."""
        self.objects = (model, optimizer, schedule, state)
        if self.checkpoint is None:
            seed = seed_of_rank(self.settings.seed, self.rank)  # the ranks' dropout differs
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
            return state
        model.load_state_dict(self.checkpoint["model"])
        optimizer.load_state_dict(self.checkpoint["optimizer"])
        schedule.load_state_dict(self.checkpoint["schedule"])
        for name, value in self.checkpoint["state"].items():
            setattr(state, name, value)
        restore_random_states(self.checkpoint["ranks"][self.rank]["random"])
        print(f"resumed at epoch {self.epoch}, batch {self.done}, step {state.step}")
        self.checkpoint = None  # read once
        return state

    def epochs(self) -> Iterator[int]:
        """The epochs left to train; a re-plan after one may change how many."""
        while self.epoch < self.plan.epochs:
            yield self.epoch

    def unfinished(self, batches: list) -> list:
        """The epoch's batches not yet trained on (all of them, unless resuming mid-epoch)."""
        if not self.plan.epoch_steps:  # the first epoch: now the run's steps are known
            steps = math.ceil(len(batches) / self.settings.accum_iter) * self.world_size
            self.plan = dataclasses.replace(self.plan, epoch_steps=steps)
        self.epoch_batches, self.epoch_tokens = len(batches), sum(b.ntokens for b in batches)
        self.bar = tqdm(
            total=len(batches), desc=f"epoch {self.epoch}", mininterval=5, leave=False,
            disable=self.rank != 0, initial=self.done,
        )  # fmt: skip
        self.clock = time.perf_counter() - self.seconds  # as if the epoch never stopped
        self.before = (self.done, self.loss, self.tokens)  # what run_epoch will not see
        return batches[self.done :]

    def step_done(self, micro_batches: int, loss: float, tokens: int) -> None:
        """After each optimizer step (run_epoch's `on_step`): the bar, the plan, a checkpoint."""
        done, loss_before, tokens_before = self.before
        self.done, self.loss, self.tokens = (
            done + micro_batches,
            loss_before + loss,
            tokens_before + tokens,
        )
        self.seconds = time.perf_counter() - self.clock
        self.bar.update(self.done - self.bar.n)
        self.bar.set_postfix(loss=f"{loss / max(tokens, 1):.3f}", refresh=False)
        step = self.objects[3].step
        if self.plan.train_minutes is not None and not self.plan.made:
            self.plan_from_first_steps(step)
        every = self.settings.checkpoint_steps
        if every and step % every == 0 and self.done < self.epoch_batches:  # not at the end
            self.save()

    def plan_from_first_steps(self, step: int) -> None:
        """In a planned run's first epoch: time steps TIMED_STEPS, then plan the epochs."""
        first, last = TIMED_STEPS
        if step == first or self.timer is None:
            self.timer = (step, time.perf_counter(), self.tokens)
        timed_from, since, tokens_before = self.timer
        ends = self.done == self.epoch_batches  # a short first epoch: plan at its end
        if step >= last or ends:
            if step == timed_from:  # nothing timed since the timer started: the whole epoch
                timed_from, since, tokens_before = 1, self.clock, 0
            seconds = max(time.perf_counter() - since, 1e-9)
            tokens = self.tokens - tokens_before
            per_epoch = self.epoch_tokens * seconds / max(tokens, 1)  # training only, as yet
            plan = epochs_that_fit(self.plan, per_epoch, done=0, spent=0.0)
            made = time.strftime("%Y-%m-%d %H:%M")
            self.plan = dataclasses.replace(plan, tokens_per_second=tokens / seconds, made=made)
            print(f"steps {timed_from} to {step}: {tokens / seconds:,.0f} target tokens/s")
            say_plan(self.plan, 0, "plan")

    def end_epoch(self, *, val_loss: float, val_bleu=None, watched=None) -> None:
        """Record the epoch, re-plan a planned run, keep weights to average, save last.pt."""
        self.bar.close()
        device = next(self.objects[0].parameters()).device
        loss, tokens = sum_over_ranks([self.loss, self.tokens], device)
        record = {
            "epoch": self.epoch,
            "train_loss": loss / max(tokens, 1),
            "val_loss": val_loss,
            "val_bleu": val_bleu,
            "watched": watched,
            "seconds": self.seconds,
            "validation_seconds": time.perf_counter() - self.clock - self.seconds,
            "tokens": int(tokens),
            "precision": self.plan.precision,
        }
        self.history.append(record)
        if self.rank == 0:
            print(f"epoch {self.epoch}: train loss {record['train_loss']:.3f}, ", end="")
            print(f"val loss {val_loss:.3f}, val BLEU {val_bleu:.1f}, ", end="")
            print(f"{tokens / self.seconds:,.0f} target tokens/s")
            if torch.cuda.is_available():
                print(gpu_report())
        self.replan()
        self.keep_for_average()
        self.epoch, self.done, self.loss, self.tokens, self.seconds = self.epoch + 1, 0, 0.0, 0, 0.0
        self.save()

    def replan(self) -> None:
        """After an epoch of a planned run: fit the epochs left to the minutes left."""
        done = len(self.history)
        if self.plan.train_minutes is None or done >= self.plan.epochs:
            return
        spent = sum(h["seconds"] + h["validation_seconds"] for h in self.history)
        averaging = self.history[-1]["validation_seconds"] if self.settings.average_last > 1 else 0
        new = epochs_that_fit(self.plan, spent / done, done, spent + averaging)
        if new.epochs != self.plan.epochs:
            change = {"after_epoch": done - 1, "epoch_seconds": spent / done}
            change |= {"was": self.plan.epochs, "epochs": new.epochs, "steps": new.steps}
            new = dataclasses.replace(new, replans=(*new.replans, change))
            say_plan(new, done, f"re-plan (was {self.plan.epochs} epochs)")
        self.plan = new

    def save(self) -> None:
        """Write last.pt: everything resuming needs. Every rank calls it; rank 0 writes."""
        model, optimizer, schedule, state = self.objects
        position = {"done": self.done, "loss": self.loss, "tokens": self.tokens}
        own = {"position": position | {"seconds": self.seconds}, "random": random_states()}
        ranks = gather_from_ranks(own)
        if self.rank == 0:
            save_checkpoint(
                self.folder / "last.pt",
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                schedule=schedule.state_dict(),
                state=dataclasses.asdict(state),
                history=self.history,
                plan=dataclasses.asdict(self.plan),
                ranks=ranks,
            )

    # -----------------------------------------------------------------------------------
    # 5. Averaging and the final model

    def keep_for_average(self) -> None:
        """Keep the last `average_last` epochs' weights (a rolling set of files)."""
        if self.rank != 0 or self.settings.average_last < 2:
            return
        save_checkpoint(self.folder / f"epoch-{self.epoch}.pt", model=self.objects[0].state_dict())
        (self.folder / f"epoch-{self.epoch - self.settings.average_last}.pt").unlink(
            missing_ok=True
        )

    def averaged_weights(self) -> dict | None:
        """The mean of the last epochs' weights, or None where the settings average nothing."""
        if self.rank != 0 or self.settings.average_last < 2:
            return None
        last = range(max(self.epoch - self.settings.average_last, 0), self.epoch)
        weights = [read_checkpoint(self.folder / f"epoch-{e}.pt")["model"] for e in last]
        self.history[-1]["averaged"] = {"epochs": list(last)}
        return {name: sum(w[name] for w in weights) / len(weights) for name in weights[0]}

    def averaged_scores(self, *, val_loss: float, val_bleu: float) -> None:
        """The averaged model's validation scores, beside the last epoch's."""
        self.history[-1]["averaged"] |= {"val_loss": val_loss, "val_bleu": val_bleu}
        print(f"average of the last epochs: val loss {val_loss:.3f}, val BLEU {val_bleu:.1f}")

    def finish(self) -> list[dict]:
        """Write final.pt (the model as it is now, and the history); return the history."""
        plan = dataclasses.asdict(self.plan) | {"steps": self.plan.steps}
        self.history[-1]["plan"] = plan | {"warmup": self.settings.warmup}
        if self.rank == 0:
            model = self.objects[0]
            save_checkpoint(
                self.folder / "final.pt", model=model.state_dict(), history=self.history
            )
        return self.history


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
    model.load_state_dict(checkpoint["model"])
    print(f"loaded {final}")
    return model, checkpoint["history"]


# ---------------------------------------------------------------------------------------
# 6. The record of a run, and several processes (Part 10)


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


def ddp_worker(rank: int, world_size: int, settings_fields: dict, data_dir: str, port) -> None:
    """One rank of a DDP job: join the group, train with the twin's loop, leave.

    `port` None reads torchrun's environment.
    """
    import torch.distributed as dist

    import annotated_transformer as twin  # a new process cannot see the notebook

    settings = twin.Settings(**settings_fields)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # share the cores
        prepare_cpu_memory()  # as the notebook's own process does
    init = f"tcp://127.0.0.1:{port}" if port else "env://"
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world_size
    )
    try:
        if rank == 0:
            data = twin.prepare_data(settings, Path(data_dir))  # rank 0 builds the caches
        dist.barrier()
        if rank != 0:
            data = twin.prepare_data(settings, Path(data_dir))  # the others read them
        folder = run_folder(settings, data, vars(twin), Path(data_dir))
        twin.train(settings, data, folder, device=device, rank=rank, world_size=world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_distributed(settings, data_dir: Path, world_size: int | None = None) -> Path:
    """Train with DDP: one process per GPU, or `world_size` (default 2) CPU processes.

    Returns the run's folder, named by the twin's code, which is what the workers train.
    """
    import annotated_transformer as twin

    world_size = world_size or torch.cuda.device_count() or 2
    args = (world_size, dataclasses.asdict(settings), str(data_dir), free_port())
    torch.multiprocessing.spawn(ddp_worker, args=args, nprocs=world_size, join=True)
    data = twin.prepare_data(settings, Path(data_dir))
    return run_folder(settings, data, vars(twin), Path(data_dir))


def not_in_twin(namespace: dict) -> list[str]:
    """The lesson's definitions whose code in `namespace` differs from the `.py` twin's."""
    import annotated_transformer as twin

    ours, theirs = lesson_code(namespace), lesson_code(vars(twin))
    return sorted(name for name in ours if ours[name] != theirs.get(name))

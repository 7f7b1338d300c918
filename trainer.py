"""Training a translator for real: what the notebook's training cell calls.

The lesson (`annotated_transformer.ipynb`) builds the Transformer, its loss, its
learning-rate schedule, `run_epoch` with gradient accumulation, decoding and BLEU. This
module turns them into a run that a student can start on a laptop and trust:

* **one folder per run**: `data/checkpoints/<preset>-<fingerprint>/`, where the
  fingerprint covers every setting that shapes training and the code of the lesson that
  trains, so a changed setting or an edited cell trains a new model beside the old one;
* **planned to the clock**: with `train_minutes`, `plan_run` times this machine and fits
  whole epochs into the budget, and `replan` corrects the plan after an epoch where the
  epochs' real time calls for it;
* **precision**: `choose_precision` measures bf16 against float32 on a CPU;
* **checkpoints and exact resume**: `last.pt` every `checkpoint_steps` optimizer steps
  and after every epoch, holding the plan too, so a killed run resumes exactly where it
  stopped (bit for bit on a CPU, but for later re-plans, which follow the clock);
* **averaging** the last epochs' weights (§6.1 of the paper);
* **the record** of a run (`run_record`, build/results.json) and the DDP worker of
  Part 4 (`ddp_worker`).

It never imports the notebook. Every function of the lesson that it calls comes in a
`Lesson`, taken from the notebook's own namespace, so an edited cell is what trains.
Only the processes that DDP starts import the notebook's `.py` twin, since they cannot
see the notebook.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import os
import platform
import textwrap
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
# The lesson's functions


@dataclass(frozen=True)
class Lesson:
    """The notebook's functions and classes that training uses, taken from the notebook.

    `code` is a fingerprint of their code and of everything they call in the notebook, so
    a run trained before a cell was edited is never mistaken for one trained after.
    """

    model_for: Callable  # a fresh model of the preset's size for the vocabularies
    make_optimizer: Callable
    run_epoch: Callable
    evaluate: Callable
    batch_loss: Callable
    bucket_batches: Callable
    collate: Callable
    translate: Callable
    validation_bleu: Callable
    watched_translations: Callable
    FastLabelSmoothing: type
    TrainState: type
    set_seed: Callable
    count_parameters: Callable
    # Part 4's, for several processes (which import the .py twin, where they are defined)
    ddp_epoch: Callable | None = None
    shard_batches: Callable | None = None
    code: str = ""  # not a function: the fingerprint of those above, DDP's left out

    @classmethod
    def of(cls, namespace) -> Lesson:
        """The lesson in `namespace`: the notebook's `globals()`, or the imported twin."""
        names = vars(namespace) if isinstance(namespace, types.ModuleType) else namespace
        optional = ("ddp_epoch", "shard_batches", "code")
        wanted = [f.name for f in dataclasses.fields(cls) if f.name not in optional]
        missing = [name for name in wanted if name not in names]
        if missing:
            raise NameError(
                f"the notebook has no {', '.join(missing)}: run the cells above this one first"
            )
        picked = {name: names[name] for name in wanted}
        code = code_fingerprint(list(picked.values()), names)
        ddp = {name: names.get(name) for name in optional[:2]}
        return cls(**picked, **ddp, code=code)


def code_fingerprint(roots: list, names: dict) -> str:
    """A hash of the code of `roots` and of every function or class of `names` they use.

    Syntax trees, not text: a changed comment or layout keeps the fingerprint, a changed
    line of code changes it, and the notebook and its `.py` twin agree when their code does.
    """
    seen, todo, parts = set(), list(roots), []
    module = names.get("__name__")
    while todo:
        obj = inspect.unwrap(todo.pop())
        if id(obj) in seen or getattr(obj, "__module__", None) != module:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            fields = dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ()
            shape = (
                [b.__qualname__ for b in obj.__bases__],
                [(f.name, repr(f.default)) for f in fields],
            )
            parts.append(f"class {obj.__qualname__} {shape}")
            methods = [getattr(v, "__func__", v) for v in vars(obj).values()]
            todo += [m for m in methods if inspect.isfunction(m)] + list(obj.__bases__)
        elif inspect.isfunction(obj):
            parts.append(f"{obj.__qualname__} {_syntax_of(obj)}")
            used = sorted(n for n in _names_used(obj.__code__) if n in names)
            todo += [names[n] for n in used if callable(names[n])]
            constants = int | float | str | bool | tuple  # MAX_POSITIONS and the like
            parts += [
                f"{n}={names[n]!r}" for n in used if n.isupper() and isinstance(names[n], constants)
            ]
    return fingerprint(sorted(parts))


def _syntax_of(function) -> str:
    """The function's syntax tree, or "" for one without source (a dataclass's __init__)."""
    try:
        return ast.dump(ast.parse(textwrap.dedent(inspect.getsource(function))))
    except (OSError, TypeError, SyntaxError):
        return ""


def _names_used(code: types.CodeType) -> set[str]:
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return set(code.co_names).union(*(_names_used(c) for c in inner))


# ---------------------------------------------------------------------------------------
# Where a run lives

# The settings that do not change what training computes: the decoding of the final
# model and how often a checkpoint is written.
NOT_TRAINING = ("name", "beam_size", "length_penalty", "checkpoint_steps")


def training_settings(settings) -> dict:
    """The settings that shape training, as a plain dict (what checkpoints store)."""
    fields = dataclasses.asdict(settings)
    return {k: v for k, v in fields.items() if k not in NOT_TRAINING}


def run_dir(settings, lesson: Lesson, data_dir: Path) -> Path:
    """The folder of one run: data/checkpoints/<preset>-<8 hex digits>.

    The digits are a fingerprint of the settings that shape training and of the lesson's
    code: change either and the run trains anew into a folder of its own.
    """
    key = fingerprint([training_settings(settings), lesson.code])[:8]
    return Path(data_dir) / "checkpoints" / f"{settings.name}-{key}"


def vocab_fingerprint(vocabs: dict) -> str:
    return vocabs["de"].fingerprint() + vocabs["en"].fingerprint()


def load_checkpoint(path: Path, settings, vocabs: dict) -> dict:
    """Read a checkpoint safely and check that it was trained with these settings."""
    checkpoint = read_checkpoint(path)  # weights_only=True: tensors and containers only
    if checkpoint.get("vocab_fingerprint") != vocab_fingerprint(vocabs):
        raise CheckpointError(
            f"{path} was made with other vocabularies: delete its folder to train again"
        )
    stored, wanted = checkpoint.get("settings"), training_settings(settings)
    if stored != wanted:
        changed = sorted(k for k in wanted if (stored or {}).get(k) != wanted[k])
        raise CheckpointError(
            f"{path} was trained with other settings ({', '.join(changed) or 'unknown'}): "
            "load it with the settings it was trained with, or delete its folder"
        )
    return checkpoint


# ---------------------------------------------------------------------------------------
# Precision


def autocast_for(device: torch.device, precision: str):
    """A factory of contexts: bf16 autocast on CUDA or a CPU if precision is "bf16"."""
    if precision == "bf16" and device.type in ("cuda", "cpu"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def bf16_pays_off(lesson, model, batch, criterion, repeats: int = 3, margin: float = 1.2):
    """Time forward and backward of one batch on the CPU in float32 and in bf16, alternately.

    Returns (pays, fp32 seconds, bf16 seconds): pays when bf16's best time beats float32's
    by `margin`. Stops early where bf16 is clearly slower (4 times in the warm-up round,
    twice in a later one), as on CPUs without bf16 hardware. Runs in eval mode, so
    dropout draws no random numbers; clears the gradients.
    """
    model.eval()
    times = {"fp32": [], "bf16": []}
    for i in range(repeats + 1):  # the first round only warms up
        for precision, spent in times.items():
            start = time.perf_counter()
            with autocast_for(torch.device("cpu"), precision)():
                loss = lesson.batch_loss(model, criterion, batch)
            loss.backward()
            spent.append(time.perf_counter() - start)
        timed = {name: spent[1:] or spent for name, spent in times.items()}
        if min(timed["bf16"]) > (4 if i == 0 else 2) * min(timed["fp32"]):
            break  # bf16 is far slower (no bf16 hardware): timing it again wastes time
    model.zero_grad(set_to_none=True)
    fp32, bf16 = min(timed["fp32"]), min(timed["bf16"])
    return fp32 > margin * bf16, fp32, bf16


def choose_precision(settings, device, lesson, model, batch, criterion, world_size=1) -> str:
    """ "bf16" or "fp32" for a new run: measured on a CPU, bf16 on CUDA."""
    if settings.precision == "fp32" or device.type == "mps":
        return "fp32"
    if settings.precision == "bf16" or device.type == "cuda":
        return "bf16"
    if world_size > 1:  # the ranks would have to agree; CPU processes stay in float32
        return "fp32"
    pays, fp32, bf16 = bf16_pays_off(lesson, model, batch, criterion)
    choice = "bf16" if pays else "float32"
    print(f"one validation batch, forward and backward: {fp32:.2f} s in float32, ", end="")
    print(f"{bf16:.2f} s in bf16 -> training in {choice}")
    return "bf16" if pays else "fp32"


# ---------------------------------------------------------------------------------------
# Planning to the clock

MIN_USEFUL_EPOCHS = 3  # a planned run of fewer epochs gets a warning
WARMUP_SHARE = 0.7  # a planned run warms up for at most this share of its steps


def planned_steps(lesson: Lesson, settings, pairs: list, world_size: int = 1) -> int:
    """The run's optimizer steps, counted as one process counts them (for the schedule)."""
    steps = 0
    for epoch in range(settings.epochs):
        batches = lesson.bucket_batches(
            pairs, settings.batch_tokens, seed=settings.seed, epoch=epoch
        )
        if world_size > 1:
            batches = lesson.shard_batches(batches, 0, world_size)
        steps += math.ceil(len(batches) / settings.accum_iter)
    return steps * world_size


def fit_warmup(settings, steps: int):
    """The settings of a planned run of `steps`: warm-up cut to WARMUP_SHARE, same peak."""
    warmup = min(settings.warmup, max(1, int(WARMUP_SHARE * steps)))
    factor = settings.lr_factor * math.sqrt(warmup / settings.warmup)  # peak: factor/√warmup
    return dataclasses.replace(settings, warmup=warmup, lr_factor=factor)


def measure_speed(run: Run, probe: nn.Module, steps: int = 12) -> dict:
    """Time `probe`, a throwaway model of the preset's size, on real batches: training
    target tokens per second, and the seconds that one epoch's validation takes."""
    lesson, settings, data = run.lesson, run.settings, run.data
    fixed = dataclasses.replace(settings, schedule="inverse_sqrt")  # no end to plan for
    optimizer, schedule = lesson.make_optimizer(probe, fixed)
    k, pad_id = settings.accum_iter, data.vocabs["en"].pad_id
    indices = lesson.bucket_batches(data.train, settings.batch_tokens, seed=settings.seed, epoch=0)
    batches = [
        lesson.collate(data.train, b, pad_id).to(run.device) for b in indices[: (steps + 2) * k]
    ]
    loop = {"accum_iter": k, "clip_norm": settings.clip_norm, "autocast": run.autocast}
    lesson.run_epoch(batches[: 2 * k], probe, run.criterion, optimizer, schedule, **loop)
    timed = batches[2 * k :] or batches  # the first two steps only warmed up
    start = time.perf_counter()
    lesson.run_epoch(timed, probe, run.criterion, optimizer, schedule, **loop)
    tokens_per_second = sum(b.ntokens for b in timed) / (time.perf_counter() - start)
    start = time.perf_counter()
    lesson.evaluate(run.val_batches, probe, run.criterion, autocast=run.autocast)
    # an untrained model never stops, so it writes as many tokens as its source has,
    # about what a trained one writes: the cost of validation_bleu
    lesson.translate(probe, [src for src, _ in data.val], data.vocabs, longer_by=0)
    return {
        "tokens_per_second": tokens_per_second,
        "validation_seconds": time.perf_counter() - start,
    }


def plan_run(run: Run, probe: nn.Module) -> dict:
    """Epochs and optimizer steps of a new run: the preset's, or as many as fit train_minutes."""
    settings, lesson = run.settings, run.lesson
    if settings.train_minutes is None:
        steps = planned_steps(lesson, settings, run.data.train, run.world_size)
        return {"epochs": settings.epochs, "steps": steps, "precision": run.precision}
    if run.world_size > 1:
        raise ValueError("train_minutes plans one process's run: set epochs to train on several")
    speed = measure_speed(run, probe)
    epoch_tokens = sum(len(tgt) - 1 for _, tgt in run.data.train)  # targets after <s>
    epoch_seconds = epoch_tokens / speed["tokens_per_second"] + speed["validation_seconds"]
    averaging = speed["validation_seconds"] if settings.average_last > 1 else 0.0
    epochs = max(1, int((60 * settings.train_minutes - averaging) // epoch_seconds))
    seconds = epochs * epoch_seconds + averaging
    steps = planned_steps(lesson, dataclasses.replace(settings, epochs=epochs), run.data.train)
    fitted = fit_warmup(settings, steps)
    plan = {
        "train_minutes": settings.train_minutes,
        **speed,
        "precision": run.precision,
        "epoch_seconds": epoch_seconds,
        "epochs": epochs,
        "steps": steps,
        "warmup": fitted.warmup,
        "lr_factor": fitted.lr_factor,
        "planned_seconds": seconds,
        "made": time.strftime("%Y-%m-%d %H:%M"),
    }
    ends = time.strftime("%H:%M", time.localtime(time.time() + seconds))
    print(f"plan: {speed['tokens_per_second']:,.0f} target tokens/s, so {epochs} epochs ", end="")
    print(f"of {epoch_seconds:.0f} s with validation: {steps:,} steps, ", end="")
    print(f"ending about {ends} ({seconds / 60:.1f} of {settings.train_minutes:g} min)")
    if epochs < MIN_USEFUL_EPOCHS:
        print(
            f"warning: only {epochs} epoch(s) fit in {settings.train_minutes:g} minutes here; "
            "raise train_minutes, or expect a weak translator"
        )
    return plan


def aim_decay(schedule, *, from_step: int, from_rate: float, to_step: int) -> None:
    """From LambdaLR's step `from_step` on, fall in a straight line from `from_rate`
    to zero at `to_step` (LambdaLR never asks again for an earlier step)."""
    span = to_step - from_step
    schedule.lr_lambdas[0] = lambda step: from_rate * (max(to_step - step, 0) / span)


def replan(plan: dict, settings, history: list, schedule, lesson: Lesson, pairs: list) -> dict:
    """After an epoch of a planned run: fit the epochs left to the minutes left.

    The epochs trained so far (with their validation) replace the probe's estimate of
    an epoch's time. At least one epoch is left, so the rate still reaches zero; a run
    still warming up, or in its last planned epoch, keeps its plan.
    """
    done, step = len(history), schedule.last_epoch  # epochs and optimizer steps so far
    if done >= plan["epochs"] or step <= plan["warmup"]:
        return plan
    spent = sum(h["seconds"] + h.get("validation_seconds", 0.0) for h in history)
    epoch_seconds = spent / done
    averaging = plan["validation_seconds"] if settings.average_last > 1 else 0.0
    left = 60 * settings.train_minutes - averaging - spent
    epochs = done + max(1, int(left // epoch_seconds))
    if epochs == plan["epochs"]:
        return plan
    steps = planned_steps(lesson, dataclasses.replace(settings, epochs=epochs), pairs)
    decay = {"from_step": step, "from_rate": schedule.lr_lambdas[0](step), "to_step": steps}
    aim_decay(schedule, **decay)
    change = {"after_epoch": done - 1, "epoch_seconds": epoch_seconds, "was": plan["epochs"]}
    replans = [*plan.get("replans", []), change | {"epochs": epochs, "steps": steps}]
    return plan | {"epochs": epochs, "steps": steps, "decay": decay, "replans": replans}


# ---------------------------------------------------------------------------------------
# One run's state


@dataclass
class Position:
    """Where a run stands in an epoch, with the loss and token totals of its done batches."""

    epoch: int
    batches: int = 0  # batches of this epoch already trained on
    loss: float = 0.0  # their summed loss
    tokens: int = 0  # their real target tokens
    seconds: float = 0.0  # training time spent on them


@dataclass(kw_only=True)
class Run:
    """Everything one training run carries from epoch to epoch."""

    lesson: Lesson
    preset: Any  # the settings as given: they name the folder and go into every checkpoint
    settings: Any  # the same, with the epochs and the warm-up of the plan
    data: Any  # the notebook's Multi30k
    folder: Path  # run_dir: its checkpoints and plan.json
    device: torch.device
    criterion: nn.Module  # the label-smoothed loss of training and validation
    val_batches: list
    precision: str = "fp32"  # "fp32" or "bf16", chosen once per run
    rank: int = 0
    world_size: int = 1
    show: bool = True  # progress bars and one line per epoch (rank 0 only)
    plan: dict = field(default_factory=dict)
    history: list = field(default_factory=list)  # one record per finished epoch
    # built by start_or_resume:
    model: nn.Module | None = None
    ddp_model: nn.Module | None = None  # the model wrapped by DistributedDataParallel
    optimizer: torch.optim.Optimizer | None = None
    schedule: Any = None
    state: Any = None  # the lesson's TrainState

    def autocast(self):
        """The mixed-precision context of this run's training and validation."""
        return autocast_for(self.device, self.precision)()

    def optimizer_rate(self) -> str:
        """The learning rate of the next step, as the progress bar shows it."""
        return f"{self.schedule.get_last_lr()[0]:.2e}"

    def path(self, name: str) -> Path:
        """A file of this run: "last" (to resume), "final" or "epoch-<n>" (to average)."""
        return self.folder / f"{name}.pt"

    def checkpoint(self, **more) -> dict:
        """What every checkpoint of this run holds, besides `more`."""
        return {
            "model": self.model.state_dict(),
            "history": self.history,
            "settings": training_settings(self.preset),
            "vocab_fingerprint": vocab_fingerprint(self.data.vocabs),
            **more,
        }

    def save(self, position: Position) -> None:
        """Write `last.pt`: the weights, the plan and everything else resuming needs.

        Every rank must call it: each hands over its own position and random states, and
        rank 0 writes the one file, so the plan and the position can never disagree.
        """
        own = {"position": dataclasses.asdict(position), "random": random_states()}
        ranks = gather_from_ranks(own)
        if self.rank == 0:
            save_checkpoint(
                self.path("last"),
                **self.checkpoint(
                    optimizer=self.optimizer.state_dict(),
                    schedule=self.schedule.state_dict(),
                    state=dataclasses.asdict(self.state),
                    ranks=ranks,
                    plan=self.plan,
                ),
            )


def seed_of_rank(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s dropout: its own stream, the same on every run."""
    return seed + 7919 * (rank + 1)


def read_last(run: Run) -> dict | None:
    """The run's `last.pt`, or None. Every rank must see the same one, or none: a rank on
    another machine without a shared filesystem would start afresh and hang the job."""
    last = run.path("last")
    checkpoint = load_checkpoint(last, run.preset, run.data.vocabs) if last.is_file() else None
    steps = gather_from_ranks(checkpoint["state"]["step"] if checkpoint else None)
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks see different checkpoints in {run.folder} (optimizer steps by rank, "
            f"None for none: {steps}): put data/ on a filesystem that every machine shares"
        )
    if checkpoint is not None and len(checkpoint["ranks"]) != run.world_size:
        raise CheckpointError(
            f"{last} was written by a run on {len(checkpoint['ranks'])} "
            f"process(es), not {run.world_size}: resume with as many, or delete its folder"
        )
    return checkpoint


def start_or_resume(run: Run, checkpoint: dict | None) -> Position:
    """Build the model, optimizer, schedule and state: fresh, or from `checkpoint`."""
    lesson, settings, plan = run.lesson, run.settings, run.plan
    lesson.set_seed(settings.seed)
    run.model = lesson.model_for(settings, run.data.vocabs).to(run.device)  # same on every rank
    lesson.set_seed(seed_of_rank(settings.seed, run.rank))  # but dropout differs per rank
    run.optimizer, run.schedule = lesson.make_optimizer(
        run.model, settings, fused=run.device.type == "cuda", total_steps=plan["steps"]
    )
    if "decay" in plan:  # where a re-planned run re-aimed its decay
        aim_decay(run.schedule, **plan["decay"])
    run.state, position = lesson.TrainState(), Position(epoch=0)
    if checkpoint is not None:
        run.model.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.schedule.load_state_dict(checkpoint["schedule"])
        run.state, run.history = lesson.TrainState(**checkpoint["state"]), checkpoint["history"]
        own = checkpoint["ranks"][run.rank]  # this rank's position, totals and random states
        position = Position(**own["position"])
        restore_random_states(own["random"])
        print(f"resuming from {run.path('last')}: epoch {position.epoch}, batch {position.batches}")
    run.ddp_model = run.model
    if run.world_size > 1:
        ids = [run.device.index] if run.device.type == "cuda" else None
        run.ddp_model = nn.parallel.DistributedDataParallel(run.model, device_ids=ids)
    return position


# ---------------------------------------------------------------------------------------
# Training


def progress_bar(run: Run, batches: int, epoch: int):
    """A bar for one epoch that clears itself at the end (the epoch line stays)."""
    show = run.show and run.rank == 0
    return tqdm(total=batches, desc=f"epoch {epoch}", disable=not show, mininterval=5, leave=False)


def train_epoch(run: Run, position: Position) -> dict:
    """Train one epoch from `position` (its start, or mid-way when resuming); validate."""
    lesson, settings, epoch, skip = run.lesson, run.settings, position.epoch, position.batches
    pad_id = run.data.vocabs["en"].pad_id
    indices = lesson.bucket_batches(
        run.data.train, settings.batch_tokens, seed=settings.seed, epoch=epoch
    )
    if run.world_size > 1:
        indices = lesson.shard_batches(indices, run.rank, run.world_size)
    batches = [lesson.collate(run.data.train, b, pad_id).to(run.device) for b in indices[skip:]]
    bar, done_before = progress_bar(run, len(indices), epoch), [skip]
    bar.update(skip)
    resumed = time.perf_counter()
    start = resumed - position.seconds

    def on_step(done: int, loss: float, tokens: int) -> None:
        """After each optimizer step: the bar, and a checkpoint every checkpoint_steps."""
        done += skip
        bar.update(done - done_before[0])
        done_before[0] = done
        speed, rate = tokens / max(time.perf_counter() - resumed, 1e-9), run.optimizer_rate()
        shown = {"loss": f"{loss / max(tokens, 1):.3f}", "tok_s": f"{speed:,.0f}", "lr": rate}
        bar.set_postfix(shown, refresh=False)  # drawn at most every mininterval seconds
        every = settings.checkpoint_steps
        if every and run.state.step % every == 0 and done < len(indices):  # not at the end
            seconds = time.perf_counter() - start
            totals = {"loss": position.loss + loss, "tokens": position.tokens + tokens}
            run.save(Position(epoch, batches=done, seconds=seconds, **totals))

    epoch_fn = lesson.run_epoch
    if run.world_size > 1:  # Part 4's ddp_epoch, from the .py twin
        epoch_fn = functools.partial(lesson.ddp_epoch, world_size=run.world_size)
    loss = epoch_fn(
        batches,
        run.ddp_model,
        run.criterion,
        run.optimizer,
        run.schedule,
        accum_iter=settings.accum_iter,
        state=run.state,
        clip_norm=settings.clip_norm,
        autocast=run.autocast,
        on_step=on_step,
    )
    end = time.perf_counter()
    bar.close()
    val_loss = lesson.evaluate(run.val_batches, run.model, run.criterion, autocast=run.autocast)
    local_tokens = sum(b.ntokens for b in batches)
    local = [position.loss + loss * local_tokens, position.tokens + local_tokens]
    loss_sum, tokens = sum_over_ranks(local, run.device)
    first = run.rank == 0
    record = {
        "epoch": epoch,
        "train_loss": loss_sum / tokens,
        "val_loss": val_loss,
        "val_bleu": lesson.validation_bleu(run.model, run.data) if first else None,
        "watched": lesson.watched_translations(run.model, run.data) if first else None,
        "seconds": end - start,
        "tokens": int(tokens),
        "precision": run.precision,
    }
    return record | {"validation_seconds": time.perf_counter() - end}


def report_epoch(run: Run, record: dict) -> None:
    """One line per epoch (and the GPUs' load and memory on CUDA)."""
    if run.rank != 0 or not run.show:
        return
    print(f"epoch {record['epoch']}: train loss {record['train_loss']:.3f}, ", end="")
    print(f"val loss {record['val_loss']:.3f}, val BLEU {record['val_bleu']:.1f}, ", end="")
    print(f"{record['tokens'] / record['seconds']:,.0f} target tokens/s")
    if run.device.type == "cuda":
        print(gpu_report())


def save_plan(run: Run) -> None:
    """plan.json beside the checkpoints: the plan, for a person to read (last.pt has it too)."""
    if run.rank == 0:
        write_atomically(run.folder / "plan.json", json.dumps(run.plan, indent=2).encode())


def replan_run(run: Run) -> None:
    """After an epoch of a planned run: re-plan, and say so in one line if it changed."""
    new = replan(run.plan, run.settings, run.history, run.schedule, run.lesson, run.data.train)
    if new is run.plan:
        return
    old, run.plan = run.plan, new
    run.settings = dataclasses.replace(run.settings, epochs=new["epochs"])
    seconds = new["replans"][-1]["epoch_seconds"]
    ends = time.strftime(
        "%H:%M", time.localtime(time.time() + (new["epochs"] - len(run.history)) * seconds)
    )
    print(f"re-plan: epochs take {seconds:.0f} s here, so {new['epochs']} epochs in all ", end="")
    print(f"(was {old['epochs']}), {new['steps']:,} steps, ending about {ends}")


def keep_epoch_weights(run: Run, epoch: int) -> None:
    """Keep the last `average_last` epochs' weights (a rolling set of files)."""
    if run.rank != 0 or run.settings.average_last < 2:
        return
    save_checkpoint(run.path(f"epoch-{epoch}"), **run.checkpoint())
    run.path(f"epoch-{epoch - run.settings.average_last}").unlink(missing_ok=True)


def average_weights(state_dicts: list[dict]) -> dict:
    """The element-wise mean of several state dicts of the same model."""
    return {name: sum(sd[name] for sd in state_dicts) / len(state_dicts) for name in state_dicts[0]}


def average_last_epochs(run: Run) -> None:
    """Load the average of the last epochs' weights into the model; score it on validation."""
    settings, lesson = run.settings, run.lesson
    epochs = list(range(max(settings.epochs - settings.average_last, 0), settings.epochs))
    paths = [run.path(f"epoch-{e}") for e in epochs]
    weights = [load_checkpoint(p, run.preset, run.data.vocabs)["model"] for p in paths]
    run.model.load_state_dict(average_weights(weights))
    run.history[-1]["averaged"] = {
        "epochs": epochs,
        "val_loss": lesson.evaluate(
            run.val_batches, run.model, run.criterion, autocast=run.autocast
        ),
        "val_bleu": lesson.validation_bleu(run.model, run.data),
    }
    if run.show:
        average = run.history[-1]["averaged"]
        print(f"average of epochs {epochs[0]}-{epochs[-1]}: ", end="")
        print(f"val loss {average['val_loss']:.3f}, val BLEU {average['val_bleu']:.1f}")


def validation_batches(lesson: Lesson, data, settings, device) -> list:
    """The validation split in length-bucketed batches, in one fixed order."""
    pad_id = data.vocabs["en"].pad_id
    indices = lesson.bucket_batches(data.val, settings.batch_tokens, seed=0, epoch=0)
    return [lesson.collate(data.val, b, pad_id).to(device) for b in indices]


def new_run(lesson: Lesson, settings, data, data_dir: Path, device, **more) -> Run:
    """A Run of `settings` before any training: its folder, loss and validation batches."""
    en = data.vocabs["en"]
    return Run(
        lesson=lesson,
        preset=settings,
        settings=settings,
        data=data,
        folder=run_dir(settings, lesson, data_dir),
        device=device,
        criterion=lesson.FastLabelSmoothing(len(en), en.pad_id, settings.label_smoothing),
        val_batches=validation_batches(lesson, data, settings, device),
        **more,
    )


def train_model(run: Run) -> Run:
    """Train `run` to its end, resuming from its `last.pt` if it has one; return it."""
    checkpoint = read_last(run)
    if checkpoint is not None:
        run.plan, run.precision = checkpoint["plan"], checkpoint["plan"]["precision"]
        print(f"resuming with the plan made at {run.plan.get('made', 'the start')}")
    else:
        run.lesson.set_seed(run.settings.seed)
        probe = run.lesson.model_for(run.settings, run.data.vocabs).to(run.device)
        run.precision = choose_precision(
            run.settings,
            run.device,
            run.lesson,
            probe,
            run.val_batches[0],
            run.criterion,
            run.world_size,
        )
        run.plan = plan_run(run, probe)
    run.settings = dataclasses.replace(run.settings, epochs=run.plan["epochs"])
    if "warmup" in run.plan:  # a planned run: the warm-up fitted to its steps
        warmup = {k: run.plan[k] for k in ("warmup", "lr_factor")}
        run.settings = dataclasses.replace(run.settings, **warmup)
    save_plan(run)
    position = start_or_resume(run, checkpoint)
    while position.epoch < run.settings.epochs:  # a planned run may change its epochs
        record = train_epoch(run, position)
        run.history.append(record)
        report_epoch(run, record)
        if run.settings.train_minutes is not None:  # one process: plan_run refuses more
            replan_run(run)
            save_plan(run)
        keep_epoch_weights(run, position.epoch)
        position = Position(epoch=position.epoch + 1)
        run.save(position)  # last.pt: the weights, the plan and where to go on
    if run.settings.average_last > 1 and run.rank == 0:
        average_last_epochs(run)
    run.history[-1]["plan"] = run.plan
    return run


# ---------------------------------------------------------------------------------------
# What the notebook calls


@dataclass(frozen=True)
class Trained:
    """A finished run: the model, its history, and the settings it was trained with."""

    model: nn.Module
    history: list  # one record per epoch; the last holds the plan
    settings: Any  # as given (the plan's epochs are in the history)
    folder: Path


def load_final(run: Run) -> Trained | None:
    """The finished model of `run` from its final.pt, or None if it has none."""
    final = run.path("final")
    if not final.is_file():
        return None
    checkpoint = load_checkpoint(final, run.preset, run.data.vocabs)
    model = run.lesson.model_for(run.preset, run.data.vocabs)
    model.load_state_dict(checkpoint["model"])
    print(f"loaded {final}")
    return Trained(model.to(run.device), checkpoint["history"], run.preset, run.folder)


def load_or_train(lesson: Lesson, settings, data, data_dir: Path, *, device, show=True) -> Trained:
    """The trained model of `settings` and this lesson: from its final.pt, else trained now.

    A run is found by its folder (`run_dir`), so a changed setting or an edited lesson
    cell trains a new model into a folder of its own and leaves the old one on disk.
    """
    run = new_run(lesson, settings, data, data_dir, device, show=show)
    loaded = load_final(run)
    if loaded is not None:
        return loaded
    print(f"training into {run.folder}")
    run = train_model(run)
    save_checkpoint(run.path("final"), **run.checkpoint())
    return Trained(run.model, run.history, run.preset, run.folder)


def run_record(lesson: Lesson, trained: Trained, test_results: dict, device) -> dict:
    """The fields of build/results.json: the run's own settings beside its own history."""
    history = trained.history
    train_seconds = sum(h["seconds"] for h in history)
    return {
        "preset": trained.settings.name,
        "device": str(device),
        "parameters": lesson.count_parameters(trained.model),
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
        "settings": dataclasses.asdict(trained.settings),
        "run_folder": str(trained.folder),
        "peak_memory_gb": peak_memory_gb(),  # of this process (the kernel), so far
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------
# Several processes (Part 4)


def ddp_worker(rank: int, world_size: int, settings_fields: dict, data_dir: str, port) -> None:
    """One rank of a DDP job: join the group, train, leave. port None reads torchrun's env."""
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
        if os.environ.get("AT_FAIL_RANK") == str(rank):  # fault injection, for the tests
            raise RuntimeError(f"rank {rank} failed on purpose (AT_FAIL_RANK)")
        if rank == 0:
            data = twin.prepare_data(settings, Path(data_dir))  # rank 0 builds the caches
        dist.barrier()
        if rank != 0:
            data = twin.prepare_data(settings, Path(data_dir))  # the others read them
        lesson = Lesson.of(twin)
        run = new_run(
            lesson,
            settings,
            data,
            Path(data_dir),
            device,
            rank=rank,
            world_size=world_size,
            show=rank == 0,
        )
        run = train_model(run)
        dist.barrier()
        if rank == 0:
            save_checkpoint(run.path("final"), **run.checkpoint())
    finally:
        dist.destroy_process_group()


def train_distributed(settings, data_dir: Path, world_size: int | None = None) -> int:
    """Train with DDP: one process per GPU, or `world_size` (default 2) CPU processes."""
    world_size = world_size or torch.cuda.device_count() or 2
    args = (world_size, dataclasses.asdict(settings), str(data_dir), free_port())
    torch.multiprocessing.spawn(ddp_worker, args=args, nprocs=world_size, join=True)
    return world_size

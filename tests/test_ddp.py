"""DistributedDataParallel on CPU with gloo: sharding, equivalence, the ranks' seeds, exact
resume, a failing rank, machines that share no filesystem, torchrun."""

import dataclasses
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import stopping_jobs
import torch
from conftest import (
    CPU,
    ROOT,
    assert_same_weights,
    loop_objects,
    prepared_data,
    tiny_data,
    tiny_settings,
)

import annotated_transformer as at
import plumbing
import trainer
from plumbing import CheckpointError, free_port, read_checkpoint
from tools import train_ddp

DDP = train_ddp.ROOTS  # what DDP's workers train with, which names their run's folder

TINY = tiny_settings(name="ddp-test", train_pairs=120, eval_pairs=10, batch_tokens=300, warmup=1)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_are_disjoint_equal_and_cover_every_pair(world_size):
    rng = random.Random(0)
    pairs = [([0] * rng.randint(3, 30), [0] * rng.randint(3, 30)) for _ in range(1001)]
    for epoch in range(3):
        batches = at.bucket_batches(pairs, 200, seed=5, epoch=epoch)
        shards = [at.shard_batches(batches, r, world_size) for r in range(world_size)]
        assert len({len(shard) for shard in shards}) == 1  # the same number of steps
        covered = sorted(i for shard in shards for batch in shard for i in batch)
        assert covered == list(range(len(pairs)))  # each pair once, none twice


ADAM = at.make_optimizer  # the notebook's, kept before sgd_rank replaces it in a rank


def sgd_with_the_schedule(model, settings, *, fused=False, total_steps=None, ranks=1):
    """make_optimizer with plain SGD in place of Adam: the same learning-rate schedule,
    taken `ranks` steps at a time (as ddp_epoch advances it once per rank).

    SGD moves each weight by lr times its gradient, so two trainings whose gradients
    differ by rounding end with weights that differ by rounding. Adam divides each
    update by the gradient's own running size: a weight whose true gradient is zero (an
    embedding row no batch holds, the key projection's bias) gets rounding noise
    blown up into a full step of size lr, whose sign depends on the CPU's kernels.
    """
    _, schedule = ADAM(model, settings, total_steps=total_steps)
    rate = schedule.lr_lambdas[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: rate(ranks * s))


def sgd_rank(rank: int, world_size: int, fields: dict, data_dir: str, port: int) -> None:
    """train_ddp.ddp_worker, training with sgd_with_the_schedule (a spawned process's own
    copy of the notebook is patched, nothing in the test process)."""
    at.make_optimizer = sgd_with_the_schedule
    train_ddp.ddp_worker(rank, world_size, fields, data_dir, port)


def reference_training(settings, data, world_size):
    """One process, no accumulation: each optimizer step sees, padded into one batch, all
    the pairs that the ranks' micro-batches of that step hold together."""
    at.set_seed(settings.seed)
    model = at.model_for(settings, data.vocabs)
    processes = at.DDPProcesses(rank=0, world_size=world_size)
    total = at.total_steps(data.train, settings, processes)  # the ranks' schedule ends there
    optimizer, schedule = sgd_with_the_schedule(
        model, settings, total_steps=total, ranks=world_size
    )
    en = data.vocabs["en"]
    criterion = at.FastLabelSmoothing(len(en), en.pad_id)  # train's
    per_step = settings.accum_iter * world_size  # rank r holds batches r, r + W, ...
    for epoch in range(settings.epochs):
        indices = at.bucket_batches(
            data.train, settings.batch_tokens, seed=settings.seed, epoch=epoch
        )
        indices = at.divisible_batches(indices, world_size)
        steps = [sum(indices[i : i + per_step], []) for i in range(0, len(indices), per_step)]
        batches = [at.collate(data.train, step, en.pad_id) for step in steps]
        at.run_epoch(batches, model, criterion, optimizer, schedule)
    return model


def only_folder(data_dir, settings) -> Path:
    """The one run folder of `settings` under data_dir (whatever its lesson's code)."""
    (folder,) = (Path(data_dir) / "checkpoints").glob(f"{settings.name}-*")
    return folder


def tokens_of_each_step(data, settings, rank: int, world_size: int) -> list[int]:
    """The real target tokens of each optimizer step of rank `rank` in epoch 0."""
    processes = at.DDPProcesses(rank=rank, world_size=world_size)
    batches = at.batches_for(data.train, data.vocabs["en"].pad_id, settings, CPU,
                             processes=processes)  # fmt: skip
    return at.tokens_per_step(batches, settings.accum_iter)


@pytest.mark.slow
@pytest.mark.numerics
def test_two_ranks_equal_one_process_on_the_union(tmp_path, monkeypatch, multi30k_env):
    """2 gloo ranks with unequal token counts take the SGD steps of one process that sees
    each step's batches padded into one. SGD, not the notebook's Adam: see
    sgd_with_the_schedule. The ranks' path and the reference's round differently (other
    batch shapes, an all-reduce), so every weight may differ by rounding, no more."""
    settings = dataclasses.replace(TINY, lr_factor=10.0)  # SGD steps of a visible size
    data = prepared_data(settings, tmp_path, monkeypatch)
    # the precondition: the ranks' steps hold different numbers of tokens, most of them
    counts = [tokens_of_each_step(data, settings, rank, 2) for rank in (0, 1)]
    assert sum(a != b for a, b in zip(*counts, strict=True)) >= len(counts[0]) // 2
    args = (2, dataclasses.asdict(settings), str(tmp_path), free_port())
    torch.multiprocessing.spawn(sgd_rank, args=args, nprocs=2, join=True)
    final = read_checkpoint(only_folder(tmp_path, settings) / "last.pt")
    assert len(final["history"]) == settings.epochs
    reference = reference_training(settings, data, world_size=2).state_dict()
    at.set_seed(settings.seed)
    start = at.model_for(settings, data.vocabs).state_dict()
    assert final["model"].keys() == reference.keys()
    moved = max((reference[n] - start[n]).abs().max().item() for n in reference)
    worst = max((final["model"][n] - reference[n]).abs().max().item() for n in reference)
    # Rounding leaves weights of size ~1 some 1e-7 apart (measured: 1.2e-7). Averaging the
    # ranks' own means instead of dividing by the step's tokens lands 4e-3 away.
    assert moved > 1e-2, "training must move the weights for the equality to mean anything"
    assert worst < 1e-5, f"largest difference {worst:.2e} (largest change {moved:.2e})"


class Started(Exception):
    """The run stopped on purpose, once its first epoch had seeded its dropout."""


def test_ranks_start_from_the_same_weights_but_draw_their_own_dropout(tmp_path, monkeypatch):
    """The notebook's `train` seeds the model with the settings' seed, then each epoch's
    dropout by rank and epoch. One process stands for each rank in turn: world_size stays 1,
    so no process group is needed, and `train` stops once it has seeded `epochs` epochs."""
    seed, seen, models = at.set_seed, [], []

    def seed_and_stop(number):
        seed(number)
        if not models:  # model_for drawing the first weights
            return
        weights = torch.cat([p.detach().flatten() for p in models[-1].parameters()])
        seen.append((weights, torch.nn.functional.dropout(torch.ones(1000), p=0.5) > 0))
        if len(seen) == stop[0]:
            raise Started

    monkeypatch.setattr(at, "set_seed", seed_and_stop)

    def build(settings, vocabs):
        models.clear()
        models.append(at.model_for(settings, vocabs))
        return models[-1]

    def started(rank: int, epochs: int = 1, folder=tmp_path) -> list:
        torch.manual_seed(100 + len(seen))  # whatever ran before: train seeds its own
        seen.clear()
        stop[0] = epochs
        with pytest.raises(Started):
            processes = at.Processes(rank=rank)
            at.train(TINY, tiny_data(), folder, device=CPU, processes=processes, build=build)
        return seen[-1]

    stop = [1]
    (weights_0, mask_0), (weights_1, mask_1) = started(0), started(1)
    assert torch.equal(weights_0, weights_1)
    assert (mask_0 != mask_1).float().mean() > 0.3  # independent masks differ in ~half
    assert torch.equal(started(1)[1], mask_1), "a rank's stream is the same on every run"
    _, mask_next = started(0, epochs=2, folder=tmp_path / "two epochs")
    assert (mask_0 != mask_next).float().mean() > 0.3, "each epoch draws its own numbers"


def rank_steps_per_epoch(data, settings, world_size: int = 2) -> int:
    """Optimizer steps that one of `world_size` ranks takes in an epoch."""
    processes = at.DDPProcesses(rank=0, world_size=world_size)
    return at.total_steps(data.train, settings, processes) // (settings.epochs * world_size)


@pytest.mark.slow
def test_ddp_stopped_mid_epoch_goes_on_to_equal_an_uninterrupted_run(
    tmp_path, monkeypatch, multi30k_env
):
    """2 ranks with dropout stop in the middle of their second epoch (both raise); the
    rerun goes on from the first epoch's last.pt, each rank seeding its second epoch as the
    uninterrupted run did, and ends bit-identical to it, per-epoch losses included."""
    settings = dataclasses.replace(TINY, dropout=0.1, train_pairs=400)
    fields = dataclasses.asdict(settings)
    stopping_jobs.spawn(fields, tmp_path / "straight", fail_at=0)
    data = prepared_data(settings, tmp_path / "stopped", monkeypatch)
    per_epoch = rank_steps_per_epoch(data, settings)
    with pytest.raises(Exception, match=f"stopped on purpose at step {per_epoch + 2}"):
        stopping_jobs.spawn(fields, tmp_path / "stopped", fail_at=per_epoch + 2)
    # the stopped job's optimizer was instrumented, its folder is still the run's own
    folder = plumbing.run_folder(settings, data, vars(at), tmp_path / "stopped", roots=DDP)
    last = read_checkpoint(folder / "last.pt")
    assert last["schedule"]["last_epoch"] == 2 * per_epoch and len(last["history"]) == 1
    assert last["processes"] == 2
    stopping_jobs.spawn(fields, tmp_path / "stopped", fail_at=0)
    a, b = (
        read_checkpoint(
            plumbing.run_folder(settings, data, vars(at), tmp_path / run, roots=DDP) / "last.pt"
        )
        for run in ("straight", "stopped")
    )
    assert_same_weights(a["model"], b["model"])
    losses = [[(h["train_loss"], h["val_loss"]) for h in run["history"]] for run in (a, b)]
    assert losses[0] == losses[1] and len(losses[0]) == settings.epochs


@pytest.mark.slow
def test_an_error_reaches_the_job_even_where_leaving_the_group_would_abort(tmp_path, multi30k_env):
    """Both ranks raise after step 3, in processes where destroy_process_group aborts: the
    job still reports their error, not a signal, because a rank that failed does not
    leave the group before spawn has recorded its exception."""
    args = (2, dataclasses.asdict(TINY), str(tmp_path), free_port())
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="on purpose at step 3"):
        torch.multiprocessing.spawn(stopping_jobs.fails_and_teardown_aborts, args=args, nprocs=2)


def run_job(code: str, timeout: float, **env) -> subprocess.CompletedProcess:
    """Run `code` in a new Python process, in a session of its own: if it is still running
    after `timeout` seconds, kill it with every process it started, and fail."""
    job = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **env},
    )
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        pytest.fail(f"the job still ran after {timeout:.0f} s: it hangs")
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_quickly_with_its_message(tmp_path, multi30k_env):
    """train_ddp.train_distributed, with rank 1 raising after step 3 while rank 0 trains on
    (stopping_jobs' stand-in for its worker): the job ends, well before the timeout, with
    rank 1's message, and leaves no finished run."""
    code = (
        "import annotated_transformer as at, stopping_jobs\n"
        "from tools import train_ddp\n"
        "train_ddp.ddp_worker = stopping_jobs.rank_1_fails_at_step_3\n"
        f"train_ddp.train_distributed(at.Settings(**{dataclasses.asdict(TINY)!r}), "
        f"{str(tmp_path)!r}, 2)"
    )
    result = run_job(code, timeout=120)
    assert result.returncode != 0
    assert "rank 1 stopped on purpose at step 3" in result.stderr
    lasts = [read_checkpoint(p) for p in tmp_path.glob("checkpoints/*/last.pt")]
    assert all(len(last["history"]) < TINY.epochs for last in lasts)


@pytest.mark.slow
def test_ranks_that_see_different_checkpoints_stop_at_the_start_and_say_why(
    tmp_path, monkeypatch, multi30k_env
):
    """Two machines without a shared filesystem: a job stopped in its second epoch left its
    last.pt on rank 0's disk only. Started again, both ranks stop before training, with one
    CheckpointError that names the cure, rather than rank 0 resuming, rank 1 starting
    afresh and the job hanging."""
    fields = dataclasses.asdict(TINY)
    stop = rank_steps_per_epoch(prepared_data(TINY, tmp_path / "x", monkeypatch), TINY) + 1
    first = stopping_jobs.spawn_on_separate_machines(fields, tmp_path, 120, fail_at=stop)
    assert f"stopped on purpose at step {stop}" in str(first)
    (last,) = stopping_jobs.machine_folder(tmp_path, 0).glob("checkpoints/*/last.pt")
    written = last.read_bytes()
    second = stopping_jobs.machine_folder(tmp_path, 1)
    assert not list(second.glob("checkpoints/*/*.pt"))  # rank 0 alone writes checkpoints

    error = stopping_jobs.spawn_on_separate_machines(fields, tmp_path, 120)
    assert error is not None, "the job ran as if every rank saw the same checkpoint"
    assert "CheckpointError" in str(error)
    assert "put data/ on a filesystem that every machine shares" in str(error)
    assert last.read_bytes() == written and not list(second.glob("checkpoints/*/*.pt"))


@pytest.mark.slow
def test_torchrun_entry_point_runs_two_processes(tmp_path, monkeypatch, multi30k_env):
    smoke = at.get_settings("smoke")
    data = prepared_data(smoke, tmp_path, monkeypatch)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "tools/train_ddp.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "AT_PRESET": "smoke", "AT_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    final = read_checkpoint(
        plumbing.run_folder(smoke, data, vars(at), tmp_path, roots=DDP) / "last.pt"
    )
    assert len(final["history"]) == smoke.epochs


def test_resuming_with_another_number_of_processes_is_refused(tmp_path, capsys):
    """A last.pt says how many processes trained it: on another number, the ranks would
    share out other batches, and no uninterrupted run would match; so it stops in one line."""
    settings = at.Settings(name="t", N=1, d_model=16, d_ff=32, h=2, epochs=2, warmup=1)

    def kept() -> dict:
        return loop_objects(settings, tiny_data().vocabs)

    written = kept()
    written["schedule"].last_epoch = 3
    trainer.save_last(tmp_path, written, [{"epoch": 0}])
    with pytest.raises(CheckpointError, match=r"on 1 process\(es\), not 2: resume with as many"):
        trainer.load_last(tmp_path, kept(), settings.epochs, world_size=2)
    capsys.readouterr()
    again = kept()
    assert trainer.load_last(tmp_path, again, settings.epochs) == [{"epoch": 0}]  # as many
    assert (
        again["schedule"].last_epoch == 3
        and "going on after epoch 0, step 3" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("gpus", "processes_here", "expected"),
    [(0, 2, "cpu"), (1, 2, "cpu"), (2, 2, "cuda:1"), (4, 2, "cuda:1"), (8, 8, "cuda:1")],
)
def test_a_process_takes_a_gpu_of_its_own_or_the_cpu(monkeypatch, gpus, processes_here, expected):
    """Appendix C asks for two processes: on a machine with one GPU, rank 1 would ask for
    cuda:1, which is not there, so both train on the CPU instead. What counts is this
    machine's processes (torchrun's LOCAL_WORLD_SIZE), not the job's on every machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert train_ddp.device_for(1, processes_here) == torch.device(expected)

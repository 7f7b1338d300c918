"""DistributedDataParallel on CPU with gloo: sharding, equivalence, failures, torchrun."""

import dataclasses
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from conftest import MIRROR, ROOT

import annotated_transformer as at

TINY = at.Settings(
    name="ddp-test",
    N=1,
    d_model=16,
    d_ff=32,
    h=2,
    dropout=0.0,
    train_pairs=120,
    eval_pairs=10,
    batch_tokens=300,
    accum_iter=2,
    epochs=2,
    warmup=8,
)
pytestmark = pytest.mark.skipif(not MIRROR.is_dir(), reason=f"no Multi30k mirror at {MIRROR}")


@pytest.fixture(autouse=True)
def mirror(monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(MIRROR))


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


def reference_training(settings, data, world_size):
    """One process over the union of the ranks' batches, interleaved as the ranks see them."""
    at.set_seed(settings.seed)
    model = at.model_for(settings, data.vocabs)
    single = dataclasses.replace(settings, warmup=max(1, settings.warmup // world_size))
    optimizer, schedule = at.make_optimizer(model, single)
    pad = data.vocabs["en"].pad_id
    criterion = at.FastLabelSmoothing(len(data.vocabs["en"]), pad, settings.label_smoothing)
    for epoch in range(settings.epochs):
        indices = at.bucket_batches(
            data.train, settings.batch_tokens, seed=settings.seed, epoch=epoch
        )
        batches = [
            at.collate(data.train, b, pad) for b in at.divisible_batches(indices, world_size)
        ]
        at.run_epoch(
            batches,
            model,
            criterion,
            optimizer=optimizer,
            schedule=schedule,
            accum_iter=settings.accum_iter * world_size,
        )
    return model


def test_two_ranks_equal_one_process_on_the_union(tmp_path):
    data = at.prepare_data(TINY, tmp_path)
    at.train_distributed(TINY, world_size=2, data_dir=tmp_path)
    final = torch.load(at.checkpoint_dir(TINY, tmp_path) / "final.pt", weights_only=True)
    reference = reference_training(TINY, data, world_size=2).state_dict()
    assert final["model"].keys() == reference.keys()
    # The key bias shifts every score of a row equally, which softmax cancels: its true
    # gradient is 0 and what backward returns is rounding noise, which Adam (dividing by
    # the gradient's own size) turns into updates of full size. Every other weight must match.
    checked = [name for name in reference if not name.endswith("w_k.bias")]
    assert len(checked) > 20
    different = [
        n for n in checked if not torch.allclose(final["model"][n], reference[n], atol=1e-5)
    ]
    assert different == []
    assert len(final["history"]) == TINY.epochs


def run_script(code: str, tmp_path, **env) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AT_PRESET": "smoke", "PYTHONPATH": str(ROOT), **env},
    )
    return result, time.perf_counter() - start


def test_a_failing_rank_ends_the_job_quickly_with_its_message(tmp_path):
    code = (
        "import annotated_transformer as at, dataclasses;"
        f"at.train_distributed(at.Settings(**{dataclasses.asdict(TINY)!r}), 2, {str(tmp_path)!r})"
    )
    result, seconds = run_script(code, tmp_path, AT_FAIL_RANK="1")
    assert result.returncode != 0
    assert "rank 1 failed on purpose" in result.stderr
    assert seconds < 60
    assert not (at.checkpoint_dir(TINY, tmp_path) / "final.pt").exists()


def test_torchrun_entry_point_runs_two_processes(tmp_path):
    start = time.perf_counter()
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
    final = torch.load(tmp_path / "checkpoints" / "smoke" / "final.pt", weights_only=True)
    assert len(final["history"]) == at.get_settings("smoke").epochs
    assert time.perf_counter() - start < 300

"""tools/bench.py: a small run in the smoke preset writes a sane bench.json.

The figures are not checked against their goals here: a benchmark is not a timed test.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import MIRROR, ROOT

import annotated_transformer as at

sys.path.insert(0, str(ROOT / "tools"))
import bench

SMOKE = at.get_settings("smoke")
pytestmark = pytest.mark.skipif(not MIRROR.is_dir(), reason=f"no Multi30k mirror at {MIRROR}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data folder whose final checkpoint is an untrained smoke model, so decoding runs."""
    folder = tmp_path_factory.mktemp("bench") / "data"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTI30K_DIR", str(MIRROR))
        data = at.prepare_data(SMOKE, folder)
    at.set_seed(0)
    model = at.model_for(SMOKE, data.vocabs)
    at.save_final(at.checkpoint_dir(SMOKE, folder) / "final.pt", model, [], data.vocabs, SMOKE)
    return folder


@pytest.fixture(scope="module")
def run(data_dir):
    """Run the benchmark once, as `make bench` would; return (report, printed output)."""
    out = data_dir.parent / "bench.json"
    command = [sys.executable, str(ROOT / "tools" / "bench.py"), "--preset", "smoke"]
    command += ["--repeats", "2", "--threads", "1", "--data-dir", str(data_dir), "--out", str(out)]
    env = {**os.environ, "MULTI30K_DIR": str(MIRROR)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout


def test_headline_figures_and_table(run):
    report, printed = run
    for key in (
        "model_vs_pytorch_step_ratio",
        "pipeline_speedup_vs_reference_loop",
        "padding_efficiency_ours",
        "padding_efficiency_reference",
        "greedy_test2016_seconds",
        "beam4_test2016_seconds",
        "peak_memory_mb",
    ):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert "| step ratio ours / PyTorch |" in printed


def test_both_models_train_and_have_the_same_layers(run):
    models = run[0]["model_vs_pytorch"]
    assert models["ours_step_seconds"] > 0 and models["pytorch_step_seconds"] > 0
    assert len(models["ours_round_step_seconds"]) == 2  # --repeats 2, warm-up left out
    # nn.Transformer's only extra weights: a final LayerNorm (weight, bias) per stack
    assert models["pytorch_parameters"] - models["ours_parameters"] == 4 * SMOKE.d_model


def test_pipelines_train_on_the_same_real_target_tokens(run):
    pipeline = run[0]["pipeline"]
    ours, reference = pipeline["ours"], pipeline["reference"]
    assert ours["real_target_tokens"] == reference["real_target_tokens"]
    assert ours["sentences"] == reference["sentences"]  # the very same pairs
    assert ours["real_target_tokens"] >= bench.SIZES["smoke"].pipeline_tokens
    assert ours["tokens_per_second"] > 0 and reference["tokens_per_second"] > 0
    assert reference["max_padding"] == 72 and reference["batch_size"] == 32


def test_padding_efficiency_of_buckets_beats_fixed_padding(run):
    padding = run[0]["padding"]
    assert 0 < padding["reference"] < padding["ours"] <= 1


def test_decoding_ran_both_ways(run):
    decoding = run[0]["decoding"]
    assert decoding["sentences"] == SMOKE.eval_pairs and decoding["beam_size"] == SMOKE.beam_size
    for key in ("greedy_seconds", "greedy_plain_seconds", "beam_seconds", "beam_first_seconds"):
        assert decoding[key] > 0, key
    # an untrained model's near-ties may round differently on the two paths: type only
    assert isinstance(decoding["greedy_identical"], bool)
    assert isinstance(decoding["beam_identical"], bool)


def test_machine_facts(run):
    facts = run[0]["machine"]
    assert facts["cpu"] and facts["cores"] == os.cpu_count() and facts["torch_threads"] == 1
    assert facts["torch"] == torch.__version__ and facts["python"].count(".") == 2
    assert facts["preset"] == "smoke" and facts["settings"] == dataclasses.asdict(SMOKE)
    assert facts["utc"].endswith("+00:00") and "gpu" in facts


def test_decoding_is_skipped_without_a_trained_model(data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(MIRROR))
    data = at.prepare_data(SMOKE, data_dir)
    result = bench.decoding(SMOKE, data, torch.device("cpu"), tmp_path)
    assert list(result) == ["skipped"] and "`AT_PRESET=smoke make run`" in result["skipped"]


def test_pytorch_contender_masks_padding_and_the_future():
    settings = dataclasses.replace(SMOKE, dropout=0.0)
    vocabs = {"de": at.Vocab([*at.SPECIALS, "a", "b"]), "en": at.Vocab([*at.SPECIALS, "c", "d"])}
    model = bench.TorchTransformer(settings, vocabs).train()  # the path that the bench times
    pad = vocabs["en"].pad_id
    src = torch.tensor([[0, 4, 5, 1, pad], [0, 5, 1, pad, pad]])
    tgt = torch.tensor([[0, 4, 5, 4], [0, 5, 4, 5]])
    with torch.no_grad():
        out = model(src, tgt)
        more_padding = model(torch.cat([src, torch.full((2, 3), pad)], dim=1), tgt)
        other_future = model(src, torch.cat([tgt[:, :2], 9 - tgt[:, 2:]], dim=1))  # 4 <-> 5
    assert out.shape == (2, 4, settings.d_model)
    assert torch.allclose(out, more_padding, atol=1e-5)
    assert torch.allclose(out[:, :2], other_future[:, :2], atol=1e-5)
    assert not torch.allclose(out[:, 2:], other_future[:, 2:], atol=1e-5)

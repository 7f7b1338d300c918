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
from conftest import ROOT, loop_objects
from torch.utils.flop_counter import FlopCounterMode

import annotated_transformer as at
import plumbing
import trainer

sys.path.insert(0, str(ROOT / "tools"))
import bench

SMOKE = at.get_settings("smoke")
# every test here runs the benchmark (which trains both models) or times a model
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, multi30k):
    """A data folder whose finished run is an untrained smoke model, so decoding runs."""
    folder = tmp_path_factory.mktemp("bench") / "data"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MULTI30K_DIR", str(multi30k))
        data = at.prepare_data(SMOKE, folder)
    run_folder = plumbing.run_folder(SMOKE, data, vars(at), folder)
    history = [{"epoch": e} for e in range(SMOKE.epochs)]  # finished: nothing left to train
    trainer.save_last(run_folder, loop_objects(SMOKE, data.vocabs), history)
    return folder


@pytest.fixture(scope="module")
def run(data_dir, multi30k):
    """Run the benchmark once, as `make bench` would; return (report, printed output)."""
    out = data_dir.parent / "bench.json"
    command = [sys.executable, str(ROOT / "tools" / "bench.py"), "--preset", "smoke"]
    command += ["--repeats", "1", "--threads", "1", "--data-dir", str(data_dir), "--out", str(out)]
    env = {**os.environ, "MULTI30K_DIR": str(multi30k)}
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
        "model_flops_per_second",
        "matmul_flops_per_second",
    ):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert 0 < report["mfu"] <= 1
    assert "| step ratio ours / PyTorch |" in printed and "| MFU, ours (PyTorch's) |" in printed
    assert bench.MFU_MEANING in printed


def test_every_training_figure_is_in_the_presets_precision(run):
    report, printed = run
    assert report["precision"] == SMOKE.precision == "fp32" and not report["precision_forced"]
    assert report["precision_calibration"] == "the preset's setting"
    assert report["model_vs_pytorch"]["precision"] == report["pipeline"]["precision"] == "fp32"
    assert report["utilisation"]["matmul"]["precision"] == "fp32"
    assert "1/4 training step in fp32" in printed and "| training precision | fp32 " in printed


def test_mfu_is_the_model_flops_over_the_matmul_flops(run):
    report = run[0]
    mfu, models = report["utilisation"], report["model_vs_pytorch"]
    matmul = mfu["matmul"]
    assert matmul["flops"] == 2 * matmul["size"] ** 3 and matmul["best_seconds"] > 0
    assert mfu["matmul_flops_per_second"] == pytest.approx(matmul["flops"] / matmul["best_seconds"])
    flops = models["model_flops_per_step"] / models["ours_step_seconds"]
    assert mfu["model_flops_per_second"] == pytest.approx(flops)
    assert mfu["mfu"] == pytest.approx(flops / mfu["matmul_flops_per_second"])
    assert mfu["pytorch_mfu"] == pytest.approx(mfu["mfu"] * models["ratio"])


def test_training_flops_count_the_products_that_pytorch_counts():
    settings = dataclasses.replace(SMOKE, dropout=0.0)
    vocabs = {"de": at.Vocab([*at.SPECIALS, *"abcdefg"]), "en": at.Vocab([*at.SPECIALS, *"hijk"])}
    # the lesson's own attention: FlopCounterMode misses the fused kernel on a CPU
    model, pad = at.model_for(settings, vocabs), vocabs["en"].pad_id
    B, S, T = 3, 5, 5  # S = T: the count puts cross-attention's W^K, W^V on target tokens
    words = torch.Generator().manual_seed(0)
    src = torch.randint(4, 11, (B, S), generator=words)
    tgt = torch.randint(4, 8, (B, T + 1), generator=words)  # <s> and T predicted tokens
    criterion = at.FastLabelSmoothing(len(vocabs["en"]), pad, 0.1)
    with FlopCounterMode(display=False) as counter:
        at.batch_loss(model, criterion, at.Batch(src, tgt, pad)).backward()
    # the kernels also multiply the masked half of each decoder self-attention, T(T-1)/2
    # query-key pairs per sentence that the model's count leaves out
    masked = 12 * settings.d_model * settings.N * B * T * (T - 1) // 2
    counted = bench.training_flops(model, settings, [at.Batch(src, tgt, pad)], pad)
    assert counted + masked == counter.get_total_flops()
    padded = at.Batch(
        torch.cat([src, torch.full((B, 3), pad)], dim=1),
        torch.cat([tgt, torch.full((B, 2), pad)], dim=1),
        pad,
    )
    assert bench.training_flops(model, settings, [padded], pad) == counted  # padding: none


def test_both_models_train_and_have_the_same_layers(run):
    models = run[0]["model_vs_pytorch"]
    assert models["ours_step_seconds"] > 0 and models["pytorch_step_seconds"] > 0
    assert len(models["ours_round_step_seconds"]) == 1  # --repeats 1, warm-up left out
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


def test_decoding_ran_both_ways_as_a_run_decodes(run):
    report, printed = run
    decoding = report["decoding"]
    assert decoding["sentences"] == SMOKE.eval_pairs and decoding["beam_size"] == SMOKE.beam_size
    assert decoding["alpha"] == SMOKE.length_penalty  # the run's, not translate's default
    for key in (
        "greedy_seconds",
        "greedy_cached_seconds",
        "greedy_plain_seconds",
        "beam_seconds",
        "beam_first_seconds",
        "beam_first_plain_seconds",
    ):
        assert decoding[key] > 0, key
    for method in ("greedy", "beam"):  # scored by at.evaluate_test, as in make run
        assert 0 <= decoding[f"test2016_bleu_{method}"] <= 100
    assert decoding["bleu_signature"].startswith("nrefs:1")
    assert "| test2016 BLEU, greedy / beam |" in printed
    # an untrained model's near-ties may round differently on the two paths, now and
    # then; a broken cache changes nearly every sentence
    n, first = decoding["sentences"], decoding["beam_first_sentences"]
    assert first == min(n, bench.PLAIN_BEAM_SENTENCES)
    assert decoding["greedy_same_sentences"] >= 0.9 * n
    assert decoding["beam_same_sentences"] >= 0.9 * first
    assert decoding["greedy_identical"] == (decoding["greedy_same_sentences"] == n)
    assert decoding["beam_identical"] == (decoding["beam_same_sentences"] == first)


def test_machine_facts(run):
    facts = run[0]["machine"]
    assert facts["cpu"] and facts["cores"] == os.cpu_count() and facts["torch_threads"] == 1
    assert facts["torch"] == torch.__version__ and facts["python"].count(".") == 2
    assert facts["preset"] == "smoke" and facts["settings"] == dataclasses.asdict(SMOKE)
    assert facts["utc"].endswith("+00:00") and "gpu" in facts


def test_decoding_is_skipped_without_a_trained_model(data_dir, tmp_path, multi30k_env):
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

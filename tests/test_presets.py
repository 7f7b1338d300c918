"""Which preset a machine gets, and the gpu preset's precision, with CUDA stubbed: no GPU
runs here. A GPU gets the cpu preset unless AT_PRESET=gpu asks for the untried one, and
that preset's products are bf16 only where the GPU computes bf16 in hardware."""

import dataclasses

import nbformat
import pytest
import torch
from conftest import ROOT

import annotated_transformer as at
import presets


@pytest.fixture
def a_gpu(monkeypatch):
    """CUDA available, of the compute capability that the test sets in `capability`;
    is_bf16_supported says yes, as PyTorch's does on a T4 (it counts emulation)."""
    capability = {"now": (7, 5)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("AT_PRESET", raising=False)
    return capability


def test_unset_a_gpu_gets_the_cpu_preset(a_gpu):
    for a_gpu["now"] in [(7, 5), (8, 0), (9, 0)]:
        assert presets.get_settings() == presets.PRESETS["cpu"]


def test_the_gpu_preset_is_chosen_by_name(a_gpu, monkeypatch):
    monkeypatch.setenv("AT_PRESET", "gpu")
    a_gpu["now"] = (9, 0)
    assert presets.get_settings().name == "gpu"


@pytest.mark.parametrize(
    "capability, precision",
    [((7, 5), "fp32"), ((6, 1), "fp32"), ((8, 0), "bf16"), ((8, 9), "bf16"), ((9, 0), "bf16")],
)
def test_the_gpu_presets_precision_follows_the_hardware(a_gpu, capability, precision):
    a_gpu["now"] = capability  # 7.5: a T4; 8.0: an A100; 9.0: an H100
    settings = presets.get_settings("gpu")
    assert settings.precision == precision
    assert settings == dataclasses.replace(
        presets.PRESETS["gpu"], precision=precision
    )  # nothing else


def test_without_cuda_the_gpu_preset_is_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert presets.get_settings("gpu").precision == "fp32"


def start_cell() -> str:
    notebook = nbformat.read(ROOT / "annotated_transformer.ipynb", as_version=4)
    (cell,) = [c for c in notebook.cells if c.source.startswith("settings = get_settings()")]
    return cell.source


def test_the_start_line_on_a_gpu_says_what_it_picked_and_how_to_pick_gpu(a_gpu, capsys):
    exec(start_cell(), dict(vars(at)))
    printed = capsys.readouterr().out
    assert "the 'cpu' preset" in printed and "AT_PRESET=gpu" in printed


def test_the_start_line_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("AT_PRESET", "cpu")
    exec(start_cell(), dict(vars(at)))
    assert capsys.readouterr().out == "the 'cpu' preset\n"

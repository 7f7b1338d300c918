"""plumbing.py on its own: caches, fingerprints, random states and atomic writes (its
download and checkpoint functions are also tested in test_data.py and test_checkpoint.py)."""

import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import plumbing


def test_fingerprint_changes_with_any_part_of_the_value():
    base = plumbing.fingerprint([["a", "b"], 2])
    assert base == plumbing.fingerprint([["a", "b"], 2]) and len(base) == 16
    assert base != plumbing.fingerprint([["a", "c"], 2])
    assert base != plumbing.fingerprint([["a", "b"], 3])


def test_the_module_never_imports_the_notebook():
    with open(plumbing.__file__, encoding="utf-8") as f:
        assert "annotated_transformer" not in f.read()


def test_prepare_cpu_memory_caps_onednn_and_keeps_a_users_choice(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    plumbing.prepare_cpu_memory()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    plumbing.prepare_cpu_memory()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"


def high_water_mark_bytes() -> int:
    """The kernel's own record of this process's peak resident memory (Linux only)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE).group(1)) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status exists on Linux only")
def test_peak_memory_matches_the_kernels_high_water_mark():
    block = b"\x01" * 50_000_000  # written, so resident
    peak = plumbing.peak_memory_gb() * 1e9
    # The two counters may differ by a few pages; reading KiB as 1,000 bytes would be 2.4% off.
    assert peak == pytest.approx(high_water_mark_bytes(), rel=0.01) and block


@pytest.mark.parametrize("platform, maxrss, gb", [("linux", 2_000_000, 2.048), ("darwin", 2e9, 2)])
def test_peak_memory_reads_kib_on_linux_and_bytes_on_macos(monkeypatch, platform, maxrss, gb):
    """getrusage(2): ru_maxrss is in kilobytes (KiB) on Linux and the BSDs, bytes on macOS."""
    usage = types.SimpleNamespace(ru_maxrss=maxrss)
    fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: usage)
    monkeypatch.setitem(sys.modules, "resource", fake)
    monkeypatch.setattr(plumbing.sys, "platform", platform)
    assert plumbing.peak_memory_gb() == pytest.approx(gb)


def test_peak_memory_is_none_without_the_resource_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "resource", None)  # as on Windows: import fails
    assert plumbing.peak_memory_gb() is None


def test_a_folder_that_cannot_be_made_is_one_clear_line(tmp_path):
    """A dangling link where a folder must go blocks it without any file in the way: the
    message says so, where a search for the blocking file once raised StopIteration."""
    (tmp_path / "data").symlink_to(tmp_path / "nowhere")
    target = tmp_path / "data" / "tokens" / "train.json"
    with pytest.raises(plumbing.DataError) as error:
        plumbing.write_atomically(target, b"{}")
    message = str(error.value)
    assert message.startswith(f"cannot create the folder {target.parent}: ")
    assert "\n" not in message and not (tmp_path / "nowhere").exists()


def test_numpy_random_state_round_trips_mid_stream():
    """The whole MT19937 state comes back, including the position inside the key
    block and the cached Gaussian, not a fixed position of 624."""
    np.random.seed(3)
    np.random.random(5)  # moves the position inside the 624-word block
    np.random.standard_normal()  # leaves a second Gaussian cached (has_gauss = 1)
    assert np.random.get_state()[2] != 624 and np.random.get_state()[3] == 1
    states = plumbing.random_states()
    expected = (np.random.random(7), np.random.standard_normal(3))
    np.random.seed(99)  # something else entirely
    plumbing.restore_random_states(states)
    again = (np.random.random(7), np.random.standard_normal(3))
    assert np.array_equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])


def test_random_states_survive_a_weights_only_checkpoint(tmp_path):
    np.random.seed(5)
    np.random.random(10)
    plumbing.save_checkpoint(tmp_path / "r.pt", random=plumbing.random_states())
    expected = np.random.random(4)
    loaded = torch.load(tmp_path / "r.pt", weights_only=True)["random"]
    plumbing.restore_random_states(loaded)
    assert np.array_equal(np.random.random(4), expected)

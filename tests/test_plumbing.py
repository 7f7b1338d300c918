"""plumbing.py on its own: fingerprints, machine facts and atomic writes (its
download and checkpoint functions are also tested in test_data.py and test_checkpoint.py)."""

import os
import re
import sys
import types
from pathlib import Path

import pytest

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


@pytest.fixture
def chinese():
    """plumbing's messages in Chinese for one test, English again after it."""
    plumbing.use_language("zh_CN")
    yield
    plumbing.use_language("en")


def test_the_retrain_message_speaks_chinese(chinese):
    """What no notebook run shows unless code changed: why a run trains anew (the changed
    names are code, kept as they are), in the Chinese notebook's language."""
    mine = {"settings": {"epochs": 1}, "code": {"attention": "a"}, "data": {"vocabularies": "v"}}
    theirs = {"settings": {"epochs": 2}, "code": {"attention": "b"}, "data": {"vocabularies": "w"}}
    said = plumbing.differences({**mine, "torch": "2.13.0"}, {**theirs, "torch": "2.12.0"})
    words = set(re.findall(r"[A-Za-z]+", said)) - {"epochs", "attention", "torch"}
    assert words == set() and re.search(r"[\u4e00-\u9fff]", said), said

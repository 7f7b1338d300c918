"""plumbing.py on its own: caches and fingerprints (its file and checkpoint functions are
tested in test_data.py, test_defects.py and test_checkpoint.py)."""

import os

import plumbing


def test_cached_json_computes_once_then_reads(tmp_path):
    value, calls = {"de": [["Ein", "Hund"]], "en": [["A", "dog"]]}, []

    def compute():
        calls.append(1)
        return value

    for name in ("cache.json.gz", "cache.json"):  # gzipped and plain
        path = tmp_path / name
        assert plumbing.cached_json(path, compute) == value and path.is_file()
        assert plumbing.cached_json(path, compute) == value
    assert len(calls) == 2  # once per file


def test_a_damaged_cache_is_computed_again_with_a_message(tmp_path, capsys):
    path = tmp_path / "cache.json.gz"
    path.write_bytes(b"not gzip")
    assert plumbing.cached_json(path, lambda: [1, 2]) == [1, 2]
    assert "is damaged; computing it again" in capsys.readouterr().out
    assert plumbing.cached_json(path, lambda: [3]) == [1, 2]  # the repaired cache is used


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
    assert isinstance(plumbing.prepare_cpu_memory(), bool)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")
    plumbing.prepare_cpu_memory()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"


def test_peak_memory_is_at_least_the_memory_in_use():
    peak = plumbing.peak_memory_gb()
    if peak is not None:  # None only where the resource module is missing (Windows)
        block = bytearray(200_000_000)  # touch 0.2 GB
        assert plumbing.peak_memory_gb() >= 0.2 and block

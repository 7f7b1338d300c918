"""The tools around the notebook: tools/tune.py's command line, and the rule of the test
suite (tests/conftest.py) that CI may not skip a test for a missing prerequisite."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import tune  # noqa: E402


@pytest.mark.parametrize(
    "text, change",
    [
        ("train_pairs=5000", ("train_pairs", 5000)),  # int | None
        ("train_pairs=None", ("train_pairs", None)),
        ("clip_norm=none", ("clip_norm", None)),  # float | None
        ("clip_norm=0.5", ("clip_norm", 0.5)),
        ("lr_factor=0.35", ("lr_factor", 0.35)),  # float
        ("lr_factor=1", ("lr_factor", 1.0)),
        ("epochs=12", ("epochs", 12)),  # int
        ("pre_norm=true", ("pre_norm", True)),  # bool
        ("pre_norm=False", ("pre_norm", False)),
        ("pre_norm=0", ("pre_norm", False)),
        ("precision=bf16", ("precision", "bf16")),  # str, one of a Literal's values
    ],
)
def test_tune_types_a_change_by_its_field(text, change):
    name, value = tune.parse_change(text)
    assert (name, value) == change and type(value) is type(change[1])


@pytest.mark.parametrize(
    "text, message",
    [
        ("warmpu=400", "'warmpu=400' is not name=value for a Settings field; the fields are N,"),
        ("epochs", "'epochs' is not name=value for a Settings field"),
        ("epochs=", "'epochs=' is not name=value for a Settings field"),
        ("name=mine", "'name=mine' is not name=value"),  # tune names runs itself (--label)
        ("train_pairs=5e3", "'train_pairs=5e3': train_pairs takes an integer or none"),
        ("N=none", "'N=none': N takes an integer"),  # not optional
        ("lr_factor=half", "'lr_factor=half': lr_factor takes a number"),
        ("pre_norm=maybe", "'pre_norm=maybe': pre_norm takes true or false"),
        ("precision=fp16", "'precision=fp16': precision takes one of fp32, bf16"),
    ],
)
def test_tune_rejects_a_bad_change_in_one_line(text, message):
    with pytest.raises(SystemExit) as error:
        tune.parse_change(text)
    assert str(error.value).startswith(f"tune: {message}") and "\n" not in str(error.value)


SKIPPING = """
import pytest

def test_data():
    pytest.skip("no Multi30k mirror at /nowhere")

def test_browser():
    pytest.skip("Chromium is not installed: apt-get install chromium")

@pytest.mark.skipif(True, reason="no CUDA device")
def test_gpu():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False

def test_fine():
    pass
"""


@pytest.mark.slow  # starts pytest in a process of its own
@pytest.mark.parametrize("ci", ["true", ""])
def test_ci_turns_a_skip_for_a_missing_prerequisite_into_a_failure(tmp_path, ci):
    """Run pytest on five small tests with our conftest as a plugin, with and without CI."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {
        **os.environ,
        "CI": ci,
        "MULTI30K_DIR": str(tmp_path / "nowhere"),  # no download attempt
        "PYTHONPATH": str(ROOT / "tests"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rfs"]
        + ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    summary = run.stdout.strip().splitlines()[-1]
    if ci:
        assert run.returncode == 1, run.stdout
        assert "2 failed, 1 passed, 1 skipped, 1 xfailed" in summary, run.stdout
        assert "FAILED test_skipping.py::test_data - no Multi30k mirror at /nowhere" in run.stdout
        assert "under CI=true a test may not skip" in run.stdout
        assert "FAILED test_skipping.py::test_browser - Chromium is not installed" in run.stdout
        assert "SKIPPED [1] test_skipping.py:10: no CUDA device" in run.stdout
    else:
        assert run.returncode == 0, run.stdout
        assert "1 passed, 3 skipped, 1 xfailed" in summary, run.stdout
        assert "the tests that need Multi30k were skipped: MULTI30K_DIR=" in run.stdout

"""Shared test set-up: the notebook's .py twin on the path, the Multi30k data, and CI's rules.

The data tests find Multi30k where the notebook does: in `MULTI30K_DIR` if it is set,
else in the project's `data/`, downloading and checking the files that are missing there.
When the data cannot be had, those tests skip, and the end of the run says why. Under CI
(`CI=true`) a skip for a missing prerequisite (the data, Chromium) fails instead: CI must
run every test. Only a skip for a missing GPU stays a skip there.
"""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import plumbing  # noqa: E402

SPLITS = ("train", "val", "test_2016_flickr")  # the three that the notebook reads
# A skip that CI keeps: no CUDA device is a fact of a CPU machine, not a broken set-up.
LEGITIMATE_SKIP = re.compile(r"\b(CUDA|GPU)\b", re.IGNORECASE)


def find_multi30k(data_dir: Path = ROOT / "data") -> tuple[Path, str]:
    """The folder that holds Multi30k for the tests, and a line saying where it came from.

    `MULTI30K_DIR` if set; else `data_dir`, after downloading any missing file into it
    (plumbing.split_file does that and checks every SHA-256). If that fails (no network,
    a damaged file), the folder returned does not exist, so the tests that need it skip,
    and the line says why."""
    mirror = os.environ.get("MULTI30K_DIR")
    if mirror:
        if Path(mirror).is_dir():
            return Path(mirror), f"Multi30k from MULTI30K_DIR={mirror}"
        return Path(mirror), f"MULTI30K_DIR={mirror} is not a folder: point it at the .gz files"
    try:
        for split in SPLITS:
            for lang in ("de", "en"):
                plumbing.split_file(split, lang, data_dir)
    except plumbing.DataError as error:
        return data_dir / "multi30k-not-downloaded", f"no Multi30k data: {error}"
    return data_dir, f"Multi30k from {data_dir} (checked by SHA-256)"


MIRROR, MIRROR_SOURCE = find_multi30k()


def on_ci() -> bool:
    """Whether we run under CI, which sets CI=true."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, turn a skip for a missing prerequisite into a failure that says so."""
    report = yield
    if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
        return report
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if LEGITIMATE_SKIP.search(reason):
        return report
    report.outcome = "failed"
    data = f" ({MIRROR_SOURCE})" if "Multi30k" in reason and not MIRROR.is_dir() else ""
    report.longrepr = (
        f"{reason.removeprefix('Skipped: ')}{data}: under CI=true a test may not skip "
        "for a missing prerequisite; provide it"
    )
    return report


def pytest_terminal_summary(terminalreporter):
    """Say why the data tests skipped, so that no skip goes unexplained."""
    if terminalreporter.stats.get("skipped") and not MIRROR.is_dir():
        terminalreporter.write_line(
            f"the tests that need Multi30k were skipped: {MIRROR_SOURCE}",
            yellow=True,
        )


def prepared_data(settings, data_dir: Path, monkeypatch):
    """The notebook's prepare_data for `settings`, from the mirror; skips without it."""
    if not MIRROR.is_dir():
        pytest.skip(f"no Multi30k mirror at {MIRROR}")
    monkeypatch.setenv("MULTI30K_DIR", str(MIRROR))
    import annotated_transformer  # here, not at the top: conftest loads before the path is set

    return annotated_transformer.prepare_data(settings, data_dir)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Unit-test tensors are tiny: a second thread only adds synchronisation (10-100x
    slower when the cores are busy). Notebook kernels and spawned ranks are other
    processes and keep their own settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Shared test set-up: the notebook's .py twin on the path, the Multi30k data, the one set
of tiny settings and model, weight comparisons, and CI's rules.

The data tests ask for the session fixture `multi30k`, which finds Multi30k where the
notebook does: in `MULTI30K_DIR` if it is set, else in the project's `data/`, downloading
and checking the files that are missing there (at first use, never at import). When the
data cannot be had, those tests skip, and the end of the run says why. Under CI
(`CI=true`) a skip for a missing prerequisite (the data, Chromium) fails instead: CI must
run every test. Only a skip for a missing GPU stays a skip there.
"""

import dataclasses
import functools
import linecache
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


def run_cell(source: str, namespace: dict, filename: str, monkeypatch=None) -> dict:
    """Run `source` into `namespace` as a kernel runs a cell: with its text in linecache,
    where inspect (and so the run's folder) finds it; given `monkeypatch`, the entry goes
    again after the test."""
    entry = (len(source), None, source.splitlines(keepends=True), filename)
    if monkeypatch is None:
        linecache.cache[filename] = entry
    else:
        monkeypatch.setitem(linecache.cache, filename, entry)
    exec(compile(source, filename, "exec"), namespace)
    return namespace


@pytest.fixture
def float64():
    """Seed 0, and float64 for every tensor and module a test makes: two computations of
    one function then agree within about 1e-13, far under the 1e-10 that tests allow."""
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


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


@functools.cache
def multi30k_folder() -> tuple[Path, str]:
    """find_multi30k(), once per session, on first use."""
    found = find_multi30k()
    DATA_AFTER_FETCH.update(files_under(ROOT / "data"))  # what the fetch itself wrote
    return found


@pytest.fixture(scope="session")
def multi30k() -> Path:
    """The folder that holds Multi30k (MULTI30K_DIR, or data/ after downloading the files
    it lacks); skips, saying why, when the data cannot be had."""
    folder, source = multi30k_folder()
    if not folder.is_dir():
        pytest.skip(f"no Multi30k mirror: {source}")
    return folder


@pytest.fixture
def multi30k_env(multi30k, monkeypatch) -> Path:
    """MULTI30K_DIR set to the data for this test and the processes it starts."""
    monkeypatch.setenv("MULTI30K_DIR", str(multi30k))
    return multi30k


# Under pytest-xdist the workers share the cores: the notebook kernels that a worker starts
# take its share. The tests themselves run on one thread (below); the DDP ranks and the
# other processes that tests start set their own.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

# Whatever runs the tests (make test, or pytest by hand), the notebook's kernel and the
# tests train the smoke preset and write only under build/smoke/, never into data/.
for name, value in {
    "AT_PRESET": "smoke",
    "AT_BUILD_DIR": str(ROOT / "build" / "smoke"),
    "AT_DATA_DIR": str(ROOT / "build" / "smoke" / "data"),
}.items():
    os.environ.setdefault(name, value)


def run_smoke_notebook(notebook, build: Path, **options) -> None:
    """Execute `notebook` in a kernel that trains the smoke preset and writes only under
    `build` (the kernel inherits the environment, which is restored afterwards)."""
    from nbclient import NotebookClient

    smoke = {"AT_PRESET": "smoke", "AT_BUILD_DIR": str(build), "AT_DATA_DIR": str(build / "data")}
    saved = {k: os.environ.get(k) for k in smoke}
    os.environ.update(smoke)
    try:
        resources = {"metadata": {"path": str(ROOT)}}
        NotebookClient(notebook, timeout=900, resources=resources, **options).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`, with its size and modification time."""
    found = (p for p in Path(folder).rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in found}


DATA_AFTER_FETCH: dict = {}  # data/ after the Multi30k fetch: the tests change nothing else


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
    missing = "Multi30k" in reason and not multi30k_folder()[0].is_dir()
    data = f" ({multi30k_folder()[1]})" if missing else ""
    report.longrepr = (
        f"{reason.removeprefix('Skipped: ')}{data}: under CI=true a test may not skip "
        "for a missing prerequisite; provide it"
    )
    return report


def pytest_terminal_summary(terminalreporter):
    """Say why the data tests skipped, so that no skip goes unexplained."""
    skipped = terminalreporter.stats.get("skipped", [])
    for_data = any("Multi30k" in str(report.longrepr) for report in skipped)
    if for_data and not multi30k_folder()[0].is_dir():
        terminalreporter.write_line(
            f"the tests that need Multi30k were skipped: {multi30k_folder()[1]}",
            yellow=True,
        )


def prepared_data(settings, data_dir: Path, monkeypatch, **options):
    """The notebook's prepare_data for `settings` (and `options`), from the mirror; skips
    without it."""
    folder, source = multi30k_folder()
    if not folder.is_dir():
        pytest.skip(f"no Multi30k mirror: {source}")
    monkeypatch.setenv("MULTI30K_DIR", str(folder))
    import annotated_transformer  # here, not at the top: conftest loads before the path is set

    return annotated_transformer.prepare_data(settings, data_dir, **options)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Unit-test tensors are tiny: a second thread only adds synchronisation (10-100x
    slower when the cores are busy). Notebook kernels and spawned ranks are other
    processes and keep their own settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- one run of the notebook for nbval and the page tests ---------------------------------

EXECUTED = {}  # the notebook as nbval ran it, outputs included, by path


class KeepNotebookOutputs:
    """Keep what each nbval cell printed and drew, so that the page tests read nbval's run
    instead of running the notebook a second time. A plugin, not a hook of this file: a
    conftest's test hooks reach only the items under its folder, and the notebook is not."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        try:
            return (yield)
        finally:
            outputs = getattr(item, "test_outputs", None)
            if outputs is not None and hasattr(item, "cell"):
                item.cell.outputs = outputs
                EXECUTED[Path(item.path).resolve()] = item.parent.nb


def pytest_configure(config):
    config.pluginmanager.register(KeepNotebookOutputs(), "keep-notebook-outputs")


PAGE_TESTS = "tests/test_page.py"  # the tests that read the executed notebook


def pytest_collection_modifyitems(items):
    """The tests of the executed page run after the notebook's cells, to reuse their run."""
    items.sort(key=lambda item: item.nodeid.startswith(PAGE_TESTS))


# Under pytest-xdist (`make test` starts up to four workers), each test file goes to one
# worker, except that both notebooks and test_page.py go to the same one, in that order:
# the page reads nbval's outputs, and the Chinese notebook loads the model that the English
# one trained. (xdist's own `--dist loadgroup` cannot say this under pytest 9.)
TOGETHER = ("annotated_transformer.ipynb", "annotated_transformer.zh-CN.ipynb", PAGE_TESTS)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, where it is installed
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "the notebooks" if file in TOGETHER else file

    return ByFile(config, log)


def tiny_data():
    """One test pair whose reference holds a word ("zebra") outside the vocabulary."""
    import annotated_transformer as at  # here: conftest loads before the path is set

    vocabs = {
        "de": at.Vocab([*at.SPECIALS, "ein", "Zebra", "läuft", "."]),
        "en": at.Vocab([*at.SPECIALS, "A", "runs", "."]),
    }
    de_ids = vocabs["de"].encode(["ein", "Zebra", "läuft", "."])
    en_ids = vocabs["en"].encode(["A", "zebra", "runs", "."])
    pair = ([0, *de_ids, 1], [0, *en_ids, 1])
    text = [("Ein Zebra läuft.", "A zebra runs.")]
    return at.Multi30k(vocabs, [pair], [pair], [pair], text, text)


# --- what many test files share: a quick preset, its data, and training it ----------------

CPU = torch.device("cpu")


def quick_settings():
    """The smoke preset cut to one quick epoch on 200 pairs (about a second of training)."""
    import annotated_transformer as at

    return dataclasses.replace(
        at.PRESETS["smoke"], train_pairs=200, eval_pairs=20, batch_tokens=400, epochs=1, warmup=2,
        average_last=1,
    )  # fmt: skip


@pytest.fixture
def quick_data(tmp_path, monkeypatch):
    """The data of quick_settings(), prepared under tmp_path from the mirror."""
    return prepared_data(quick_settings(), tmp_path, monkeypatch)


def train_as_the_notebook(settings, data, data_dir, namespace=None, *, device=CPU):
    """What the notebook's training cell does, with the functions of `namespace` (the
    imported twin by default): (model, history, folder), loaded if it finished before."""
    import annotated_transformer

    names = vars(annotated_transformer) if namespace is None else namespace
    folder = plumbing.run_folder(settings, data, names, data_dir)
    model, history = names["train"](settings, data, folder, device=device)
    return model, history, folder


def loop_objects(settings, vocabs) -> dict:
    """What train keeps in last.pt, fresh: the model, optimizer, schedule and average."""
    import annotated_transformer as at

    model = at.model_for(settings, vocabs)
    optimizer, schedule = at.make_optimizer(model, settings, total_steps=100)
    average = torch.optim.swa_utils.AveragedModel(model, use_buffers=True)
    return {"model": model, "optimizer": optimizer, "schedule": schedule, "average": average}


# --- the tiny model and settings that many tests share, and comparing weights --------------

TINY_MODEL = {"N": 1, "d_model": 16, "d_ff": 32, "h": 2, "dropout": 0.0}


def tiny_model(vocab: int = 11, *, seed: int | None = None, **options):
    """An untrained one-layer model of width 16 over `vocab` words (seeded if asked)."""
    import annotated_transformer as at

    if seed is not None:
        at.set_seed(seed)
    return at.make_model(vocab, vocab, at.ModelConfig(**{**TINY_MODEL, **options}))


def tiny_settings(**changes):
    """The tiny model's settings for a two-epoch run on 200 training pairs."""
    import annotated_transformer as at

    tiny = at.Settings(
        name="tiny", **TINY_MODEL, train_pairs=200, eval_pairs=20, batch_tokens=400,
        accum_iter=2, epochs=2, warmup=10,
    )  # fmt: skip
    return dataclasses.replace(tiny, **changes)


def assert_same_weights(a, b) -> None:
    """Two models (or state dicts) with bit-identical weights."""
    a, b = (w.state_dict() if hasattr(w, "state_dict") else w for w in (a, b))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def same_weights(a, b) -> bool:
    """Whether two models (or state dicts) hold bit-identical weights."""
    try:
        assert_same_weights(a, b)
    except AssertionError:
        return False
    return True

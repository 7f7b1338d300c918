"""The notebook and its py:percent twin: in sync, clean, and cheap to import."""

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest
import torch
from conftest import ROOT

NOTEBOOK = ROOT / "annotated_transformer.ipynb"
TWIN = ROOT / "annotated_transformer.py"


def cells(path):
    return [(c.cell_type, c.source.strip()) for c in jupytext.read(path).cells]


def test_notebook_and_twin_have_the_same_cells():
    notebook, twin = cells(NOTEBOOK), cells(TWIN)
    assert len(notebook) == len(twin), "run `make sync` after editing either file"
    for index, (a, b) in enumerate(zip(notebook, twin, strict=True)):
        assert a == b, f"cell {index} differs: run `make sync`"


def test_committed_notebook_has_no_outputs():
    notebook = json.loads(NOTEBOOK.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert code, "the notebook has code cells"
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)


IMPORT_PROBE = """
import json, os, sys, time, types
libraries_start = time.perf_counter()
# the libraries the twin imports come first, so that only the twin's own effects count
# (sacremoses, for one, sets KMP_INIT_AT_FORK when imported)
import altair, IPython.display, numpy, pandas, plumbing, sacrebleu, sacremoses, spacy, torch
libraries = time.perf_counter() - libraries_start
seed, env, renderer = torch.initial_seed(), dict(os.environ), altair.renderers.active
sys.stdout.flush()
start = time.perf_counter()
import annotated_transformer as at
seconds = time.perf_counter() - start
kinds = (types.ModuleType, types.FunctionType, type, types.GenericAlias)
loose = sorted(
    name for name, value in vars(at).items()
    if not name.startswith("__") and not isinstance(value, kinds) and not name.isupper()
)
changed_env = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print("REPORT " + json.dumps({
    "loose": loose,
    "seed_changed": torch.initial_seed() != seed,
    "renderer": [renderer, altair.renderers.active],
    "changed_env": changed_env,
    "seconds": seconds,
    "libraries_seconds": libraries,
}))
"""


@pytest.mark.slow
def test_importing_the_twin_defines_names_and_does_nothing_else():
    """Importing the twin (as tests, tools and DDP workers do) prints nothing, sets no
    seed, switches no renderer, changes no environment variable, and leaves only
    definitions behind: modules, functions, classes, type aliases and UPPER_CASE
    constants, never a demo's `x` or `model`. Its time is reported, not asserted:
    timings belong in benchmarks."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={"AT_PRESET": "smoke", "PATH": "", "PYTHONPATH": str(ROOT)},
    )
    printed, _, report = done.stdout.rpartition("REPORT ")
    assert printed == "", f"importing the twin printed: {printed!r}"
    report = json.loads(report)
    assert report["loose"] == [], f"globals that are not definitions: {report['loose']}"
    assert not report["seed_changed"], "importing the twin must not seed the generators"
    assert report["renderer"][0] == report["renderer"][1], "no renderer switch on import"
    assert report["changed_env"] == [], f"environment changed: {report['changed_env']}"
    print(
        f"importing the twin took {report['seconds']:.2f} s after "
        f"{report['libraries_seconds']:.1f} s for the libraries it imports"
    )


def test_the_twin_keeps_the_demos_as_notebook_only_cells():
    """Every cell that runs a demo is marked active only in the notebook, so jupytext
    comments it out in the twin: the notebook runs it, an import does not."""
    notebook = jupytext.read(NOTEBOOK)
    active = [c for c in notebook.cells if c.metadata.get("active") == "ipynb"]
    assert len(active) > 40, "the demos are notebook-only cells"
    twin = TWIN.read_text()
    assert 'if __name__ == "__main__":\n' not in twin.replace(
        'if __name__ == "__main__" and "google.colab"', ""
    ), "demos are notebook-only cells, not guarded blocks"


# What Colab ships (googlecolab/backend-info, August 2026) of what the project imports.
COLAB_SHIPS = {"altair", "IPython", "numpy", "pandas", "spacy", "torch"}


def colab_cell_source():
    cell = jupytext.read(NOTEBOOK).cells[1]
    assert "google.colab" in cell.source, "the first code cell is the Colab cell"
    return cell.source


def test_colab_cell_installs_only_what_is_missing_and_keeps_torch_numpy_pandas(monkeypatch):
    calls = []
    monkeypatch.chdir(ROOT)  # the project's files are here: nothing to fetch
    monkeypatch.setattr(subprocess, "run", lambda args, **_: calls.append(args))
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # pretend Colab lacks sacremoses only
        importlib.util, "find_spec", lambda n: None if n == "sacremoses" else real_find_spec(n)
    )
    exec(colab_cell_source(), {"__name__": "__main__"})
    (command,) = calls
    assert command[-1] == "sacremoses==0.2.0" and "sacrebleu==2.6.0" not in command
    keep = Path(command[command.index("-c") + 1]).read_text().split()
    assert sorted(k.split("==")[0] for k in keep) == ["numpy", "pandas", "torch"]
    assert f"torch=={torch.__version__}" in keep


def test_colab_cell_says_in_one_line_what_to_upload_when_the_notebook_came_alone(
    monkeypatch, tmp_path
):
    """Uploaded alone to Colab, the notebook has no plumbing.py beside it: the cell stops
    before installing anything, in one line that names the files to upload."""
    calls = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda args, **_: calls.append(args))
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    with pytest.raises(SystemExit) as stop:
        exec(colab_cell_source(), {"__name__": "__main__"})
    message = str(stop.value)
    assert "upload presets.py, plumbing.py" in message and "\n" not in message
    assert calls == []


def third_party_imports() -> set[str]:
    """Top-level modules that the notebook, plumbing.py and trainer.py import, outside the
    standard library and the project, leaving out optional ones imported inside `try`."""
    sources = [c.source for c in jupytext.read(NOTEBOOK).cells if c.cell_type == "code"]
    sources = [
        "\n".join(line for line in s.splitlines() if not line.lstrip().startswith(("%", "!")))
        for s in sources
    ]
    sources += [(ROOT / name).read_text() for name in ("plumbing.py", "presets.py", "trainer.py")]
    found = set()
    for source in sources:
        tree = ast.parse(source)
        optional = {
            id(node) for t in ast.walk(tree) if isinstance(t, ast.Try) for node in ast.walk(t)
        }
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
    local = {"plumbing", "presets", "trainer", "annotated_transformer", "tools"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in local}


def test_colab_has_or_installs_every_module_the_notebook_imports():
    """A module on neither of the Colab cell's lists would stop the notebook on Colab; the
    pins it installs are requirements.txt's."""
    namespace = {"__name__": "a check"}
    exec(colab_cell_source(), namespace)
    known = COLAB_SHIPS | set(namespace["COLAB_NEEDS"])
    assert sorted(third_party_imports() - known) == []
    requirements = (ROOT / "requirements.txt").read_text().split()
    assert [pin for pin in namespace["COLAB_NEEDS"].values() if pin not in requirements] == []


def test_colab_cell_does_nothing_outside_colab(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda args, **_: calls.append(args))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(colab_cell_source(), {"__name__": "__main__"})
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    exec(colab_cell_source(), {"__name__": "annotated_transformer"})  # imported, or a worker
    assert calls == []


def test_every_contents_link_leads_to_a_heading():
    """The contents cell links to headings by the ids that nbconvert (the HTML page) and
    JupyterLab give them: the heading text with spaces turned into hyphens."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    cells = [c for c in jupytext.read(NOTEBOOK).cells if c.cell_type == "markdown"]
    (contents,) = [c for c in cells if c.source.startswith("## Contents")]
    html = "".join(markdown2html_mistune(c.source) for c in cells)
    ids = set(re.findall(r'<h[1-6] id="([^"]+)"', html))
    links = re.findall(r'href="#([^"]+)"', markdown2html_mistune(contents.source))
    assert len(links) >= 10
    assert [link for link in links if link not in ids] == []
    plain = [link for link in links if "%" not in link]  # JupyterLab keeps unicode as is
    assert len(plain) == len(links), "link to ASCII headings only, so both renderers agree"


def bound_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Top-level names a cell defines with def or class, and those it assigns."""
    defined, assigned = set(), set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.For | ast.With):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [item.optional_vars for item in node.items if item.optional_vars]
                if isinstance(node, ast.With)
                else [node.target]
            )
            for target in targets:
                assigned |= target_names(target)
    return defined, assigned


def target_names(target: ast.expr) -> set[str]:
    """The names an assignment rebinds: `Class.method = f` or `x[i] = v` rebinds none."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Starred):
        return target_names(target.value)
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(target_names(t) for t in target.elts))
    return set()


def test_no_cell_assigns_a_name_that_a_function_or_class_has():
    """One namespace runs every cell: `replan = ...` in a demo cell once replaced the
    function `replan`, and training then failed, in the `cpu` preset only."""
    notebook = json.loads(NOTEBOOK.read_text())
    defined, assigned = set(), {}
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        names, bound = bound_names(ast.parse("\n".join(lines)))
        defined |= names
        for name in bound:
            assigned.setdefault(name, index)
    clashes = {name: cell for name, cell in assigned.items() if name in defined}
    assert not clashes, f"cells that assign the name of a function or class: {clashes}"


def test_the_first_multi_head_attention_carries_only_what_the_paper_needs():
    """Part 1's MultiHeadAttention is §3.2.2 alone: the fused kernel and the kept weights of
    the heatmaps arrive where they are used. It has `attend`, the half that the key-value
    cache reuses, from the start: no later cell edits the class (DESIGN.md)."""
    code = [c.source for c in jupytext.read(NOTEBOOK).cells if c.cell_type == "code"]
    first = next(s for s in code if re.search(r"^class MultiHeadAttention\b", s, re.M))
    assert "def attend" in first
    for absent in ("use_sdpa", "keep_weights", "autocast", "scaled_dot_product"):
        assert absent not in first, f"the first MultiHeadAttention mentions {absent}"


def test_every_lesson_name_that_train_uses_is_defined_above_it():
    """The loop reads nothing ahead: run as a kernel runs the cells, every function, class
    and constant that `train` reaches (through calls, as the run's folder follows them)
    already exists when the cell that defines `train` has run."""
    from IPython.core.interactiveshell import InteractiveShell

    from plumbing import code_reached

    shell = InteractiveShell.instance()
    try:
        at_train = None
        for cell in jupytext.read(NOTEBOOK).cells:
            if cell.cell_type == "code" and cell.metadata.get("active") != "ipynb":
                assert shell.run_cell(cell.source, silent=True).success, cell.source[:60]
                if at_train is None and re.search(r"^def train\(", cell.source, re.M):
                    at_train = set(code_reached(shell.user_ns))
        after_all = set(code_reached(shell.user_ns))
        assert at_train is not None, "no cell defines train"
        assert {"train", "run_epoch", "model_for", "Processes"} <= at_train
        assert not after_all - at_train, (
            f"train reaches names defined below it: {after_all - at_train}"
        )
    finally:
        InteractiveShell.clear_instance()


def test_the_notebook_and_its_twin_train_in_the_same_folder():
    """Training finds a run by a fingerprint of the lesson's code: the notebook's cells,
    run as a kernel runs them (up to the training cell, and all of them), and the imported
    twin must agree, or a model trained by `make run` would never be found by the tools
    or by a rerun of the training cell (and DDP's workers, which import the twin, would
    train into another folder than the notebook reads)."""
    from IPython.core.interactiveshell import InteractiveShell

    import annotated_transformer
    from plumbing import code_reached  # what names a run's folder

    shell = InteractiveShell.instance()
    try:
        at_training = None  # as the training cell sees it, before the cells below have run
        for cell in jupytext.read(NOTEBOOK).cells:
            if "model, history = train(settings" in cell.source:
                at_training = code_reached(shell.user_ns)
            if cell.cell_type == "code" and cell.metadata.get("active") != "ipynb":
                assert shell.run_cell(cell.source, silent=True).success, cell.source[:60]
        notebook = code_reached(shell.user_ns)
        assert {"attention", "train", "MultiHeadAttention"} <= set(notebook)
        assert at_training is not None, "no training cell found"
        assert at_training == notebook, "a rerun after Run All would train anew"
        assert notebook == code_reached(vars(annotated_transformer))
        shell.run_cell("def attention(*, query, key, value, mask=None, dropout=None): pass")
        edited = code_reached(shell.user_ns)  # an edit counts, and only the edit
        assert [name for name in notebook if edited[name] != notebook[name]] == ["attention"]
    finally:
        InteractiveShell.clear_instance()

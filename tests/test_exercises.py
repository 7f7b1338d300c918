"""The notebook's exercises: each starter, folded solution and check, and checks that fail
on an untouched starter.

nbval (`make test`) runs every solution and check. Here the notebook runs once more with
its solution cells removed: every check must then stop with its AssertionError, and no
other cell may fail, so no lesson cell depends on an exercise. To keep that run cheap, it
leaves out the cells that train or use a trained model, and the sub-word cells: no
exercise needs them, since an untouched starter stops its check at once.
"""

import ast
import re

import nbformat
import pytest
import torch
from conftest import ROOT, run_cell, run_smoke_notebook

import annotated_transformer as at
import plumbing

NOTEBOOK = ROOT / "annotated_transformer.ipynb"
CHINESE = ROOT / "annotated_transformer.zh-CN.ipynb"
GAP = "✎"
# the last appendix gathers the exercises, a section for each part: its heading, and how
# many exercises it has at least
PARTS = {
    "### Exercises for Part 1": 2,
    "### Exercises for Part 2": 2,
    "### Exercises for Part 3": 2,
    "### Exercises for Part 4": 2,
    "### Exercises for Part 5": 1,
    "### Exercises for Part 7": 1,
    "### Exercises for Part 8": 2,
    "### Exercises for Appendix D": 1,
}


def tags(cell) -> set[str]:
    return set(cell.metadata.get("tags", []))


def exercise_cells(notebook) -> list[tuple[str, str, object]]:
    """(part heading, role, cell) of every starter, solution and check, in order."""
    part, found = None, []
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            heading = next((p for p in PARTS if cell.source.startswith(p)), None)
            part = heading or (None if cell.source.startswith("## ") else part)
        roles = tags(cell) & {"starter", "solution", "check"}
        if roles:
            found.append((part, roles.pop(), cell))
    return found


def test_the_exercises_wait_in_the_last_appendix_so_the_core_reads_straight_through():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    headings = [c.source.splitlines()[0] for c in notebook.cells if c.cell_type == "markdown"]
    parts = [h for h in headings if h.startswith("## ")]
    assert parts[-1] == "## Appendix F: exercises"
    first = next(i for i, c in enumerate(notebook.cells) if c.source.startswith(parts[-1]))
    assert not any(tags(c) & {"starter", "solution", "check"} for c in notebook.cells[:first])


def test_every_part_has_its_exercises_in_starter_solution_check_order():
    found = exercise_cells(nbformat.read(NOTEBOOK, as_version=4))
    roles = [role for _, role, _ in found]
    assert len(roles) % 3 == 0
    triples = [roles[i : i + 3] for i in range(0, len(roles), 3)]
    assert all(t == ["starter", "solution", "check"] for t in triples), triples
    starters = [part for part, role, _ in found if role == "starter"]
    for part, least in PARTS.items():
        assert starters.count(part) >= least, part
    for _, role, cell in found:
        assert cell.cell_type == "code"
        if role == "starter":
            assert GAP in cell.source and "..." in cell.source
        if role == "solution":  # folded in the page and in JupyterLab
            assert "hide-input" in tags(cell) and cell.metadata["jupyter"]["source_hidden"]
            assert GAP not in cell.source
        if role == "check":  # the first test: a clear message on a gap
            assert "expect(" in cell.source or "filled(" in cell.source


# names whose top-level use marks a cell that trains, or needs what training made, or
# learns sub-word merges (seconds, and no exercise needs them)
TRAINED = {"train_copy_task", "train", "trainer", "model", "history", "maps", "copy_model",
           "SUBWORD_MERGES"}  # fmt: skip


def top_level_names(cell) -> tuple[set[str], set[str]]:
    """Names a cell reads and names it binds at its top level (a name inside a function
    definition is only a parameter or a later call)."""
    lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith("%")]
    tree = ast.parse("\n".join(lines))
    top = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.ClassDef)]
    names = [n for statement in top for n in ast.walk(statement) if isinstance(n, ast.Name)]
    read = {n.id for n in names if isinstance(n.ctx, ast.Load)}
    return read, {n.id for n in names if isinstance(n.ctx, ast.Store)}


def training_cells(notebook) -> list:
    """The lesson cells that train, or use what a left-out cell made, in notebook order."""
    trained, left_out = set(TRAINED), []
    for cell in notebook.cells:
        if cell.cell_type != "code" or tags(cell) & {"starter", "check", "solution"}:
            continue
        read, bound = top_level_names(cell)
        if read & trained:
            left_out.append(cell)
            trained |= bound
    return left_out


# each edition, and what its message calls the gap a learner fills
EDITIONS = {"english": (NOTEBOOK, "gap"), "chinese": (CHINESE, "空缺")}


@pytest.fixture(scope="module", params=list(EDITIONS))
def without_solutions(request, tmp_path_factory):
    """The notebook run top to bottom with the smoke preset, without its solution cells
    and without the cells that train; in English, then in Chinese."""
    path, gap = EDITIONS[request.param]
    notebook = nbformat.read(path, as_version=4)
    left_out = {id(c) for c in training_cells(notebook)}
    notebook.cells = [c for c in notebook.cells if "solution" not in tags(c)]
    notebook.cells = [c for c in notebook.cells if id(c) not in left_out]
    build = tmp_path_factory.mktemp("starters")
    run_smoke_notebook(notebook, build, allow_errors=True)
    return notebook, gap


def test_the_cheap_run_leaves_out_the_training_cells_only():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    left_out = [c.source for c in training_cells(notebook)]
    assert any("model, history = train(settings" in source for source in left_out)
    assert any("train_copy_task(until=copies_held_out)" in source for source in left_out)
    assert any("subword_vocabularies(" in source for source in left_out)
    assert not any(source.lstrip().startswith(("def ", "class ")) for source in left_out)


def errors(cell) -> list[dict]:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


@pytest.mark.slow  # runs the notebook
def test_every_check_fails_on_its_untouched_starter(without_solutions):
    """With the message in the notebook's language."""
    notebook, gap = without_solutions
    checks = [c for c in notebook.cells if "check" in tags(c)]
    assert len(checks) >= sum(PARTS.values())
    for cell in checks:
        (error,) = errors(cell)
        assert error.ename == "AssertionError" and gap in error.evalue, (cell.source, error)


@pytest.mark.slow
def test_only_the_checks_fail_without_the_solutions(without_solutions):
    notebook, _ = without_solutions
    failed = [c.source[:80] for c in notebook.cells if errors(c) and "check" not in tags(c)]
    assert failed == [], "these cells need a solution, or failed for another reason"


def test_our_answer_fills_an_empty_gap_and_never_replaces_a_filled_one():
    """Shift-Enter down the page is safe: after a starter whose gap (✎) is filled, the
    folded answer leaves the student's own answer in place for the check; after an
    untouched starter, ours stands in, so Run All still passes."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    helpers = next(c.source for c in notebook.cells if "import expect, filled" in c.source)
    found = exercise_cells(notebook)
    triples = [[cell for _, _, cell in found[i : i + 3]] for i in range(0, len(found), 3)]
    for number, (starter, solution, _) in enumerate(triples):
        (name,) = re.findall(r'gap_is_empty\("(\w+)", globals\(\)\)', solution.source)
        for gap in ("...", "None"):  # untouched, then filled in (with a wrong answer)
            namespace = dict(vars(at))
            run_cell(helpers, namespace, "<cell helpers>")
            run_cell(
                starter.source.replace("...  # ✎", f"{gap}  # ✎"), namespace, f"<cell s{number}>"
            )
            mine = namespace[name]
            run_cell(solution.source, namespace, f"<cell answer {number}>")
            if gap == "...":
                assert namespace[name] is not mine and namespace[name] is not ..., name
            else:
                assert namespace[name] is mine, f"our answer replaced a filled-in {name}"


@pytest.mark.parametrize("edition", list(EDITIONS))
def test_every_assert_of_a_check_says_what_is_wrong(edition):
    """A wrong answer gets a sentence, in the notebook's language, not a bare AssertionError."""
    notebook = nbformat.read(EDITIONS[edition][0], as_version=4)
    bare, english = [], []
    for cell in (c for c in notebook.cells if "check" in tags(c)):
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Assert):
                message = ast.get_source_segment(cell.source, node.msg) if node.msg else None
                where = ast.get_source_segment(cell.source, node.test)[:60]
                if message is None:
                    bare.append(where)
                elif edition == "chinese" and message.isascii():
                    english.append(where)
    assert bare == [] and english == [], (bare, english)


# Two typical wrong answers per exercise: the starter's gap filled with them, and what the
# check's one line must then show of yours.
WRONG = {
    "decoder_layer_parameters": [
        ("None", "yours is None, expected 4,204,032"),  # forgot to return
        ("4 * d_model * d_model + 2 * d_model * d_ff", "yours is 3,145,728, expected 4,204,032"),
    ],
    "embedding_rms": [
        ("model.src_embed[0].embedding.weight.std()", "yours is a tensor of float32, shape ()"),
        ("model.src_embed[0].embedding.weight.abs().max().item()", "expected 0.0441942"),
    ],
    "peak_of_rate": [
        ("d_model**-0.5 * warmup**-0.5", "yours is 0.000698771, expected (4,000, 0.000698771)"),
        ("warmup, d_model**-0.5", "yours is (4,000, 0.0441942), expected (4,000, 0.000698771)"),
    ],
    "padding_mask": [
        ("ids != pad_id", "yours is a tensor of bool, shape (1, 5), [True, True, True, False"),
        ("(ids == pad_id).unsqueeze(-2)", "yours is a tensor of bool, shape (1, 1, 5), [False,"),
    ],
    "prenorm_config": [
        ("ModelConfig(pre_norm=True)", "yours is ModelConfig(d_model=512"),
        ("ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=0.0)", "pre_norm=False"),
    ],
    "reversed_words": [
        ("seq.flip(1)", "yours is a tensor of int64"),
        ("seq", "expected a tensor of int64, shape (1, 6)"),
    ],
    "vocabulary_trade_off": [
        ("len(vocab)", "yours is 6, expected (6, 0.4)"),
        ("0.4, len(vocab)", "yours is (0.4, 6), expected (6, 0.4)"),
    ],
    "random_batches": [  # the new pair's length, not the longest; then a test never true
        ("length * (len(current) + 1) <= batch_tokens", "over budget: yours is 6, expected 0"),
        ("False", "empty batches: yours is 1, expected 0"),
    ],
    "brevity_penalty": [
        (
            "math.exp(1 - hypothesis_length / reference_length)",
            "yours is 1.33071, expected 0.67032",
        ),
        ("1.0", "yours is 1, expected 0.67032"),
    ],
    "tie_alpha": [
        ("None", "your alpha is None, not a number"),
        ("0.5", "with alpha 0.501, your tie says the long sentence wins"),
    ],
    "head_entropy": [  # no average over the queries; then 0 log 0 taken as nan
        ("-(weights * torch.log2(weights)).sum(-1)", "yours is a tensor of float32, shape (1, 3)"),
        (
            "-(weights * torch.log2(weights)).sum(-1).mean(-1)",
            "yours is a tensor of float32, shape (1,), [nan], expected a tensor of float32",
        ),
    ],
    "diagonal_score": [
        ("(weights.argmax(-1) == torch.arange(weights.size(1))).float()", "shape (1, 6)"),
        (
            "(weights.argmax(-2) == torch.arange(weights.size(1))).float().mean(-1)",
            "yours is a tensor of float32, shape (1,), [0], expected",
        ),
    ],
    "rms_norm": [
        ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)", "yours is a tensor of float64"),
        ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * gain", "expected a tensor of float64"),
    ],
}


def what_a_check_reads() -> dict:
    """Small stand-ins for what the checks read from the cells that trained or loaded data."""
    from types import SimpleNamespace

    sentences = ["a man rides a horse on the beach", "two dogs play in the snow"]
    return {
        "tokens": {"train": {"en": [["a", "b", "a"], ["c", "a", "b"]]},
                   "val": {"en": [["a", "b", "d", "e", "a"]]}},  # fmt: skip
        "data": SimpleNamespace(val_text=[("", s) for s in sentences]),
        "full_train": [(list(range(n)), list(range(n))) for n in (2, 9, 3, 8, 4, 7, 5, 6) * 4],
        "settings": SimpleNamespace(batch_tokens=20),
        "maps": {"encoder self-attention": [torch.softmax(torch.randn(2, 3, 4), -1)],
                 "encoder-decoder attention": [torch.softmax(torch.randn(2, 3, 4), -1)]},
    }  # fmt: skip


@pytest.mark.parametrize("edition", list(EDITIONS))
def test_a_wrong_answer_hears_what_it_gave_and_what_was_expected(edition):
    """Each check, given two typical wrong answers, stops with one line that shows the
    learner's answer, in the notebook's language; none trains before it has checked."""
    notebook = nbformat.read(EDITIONS[edition][0], as_version=4)
    helpers = next(c.source for c in notebook.cells if "import expect, filled" in c.source)
    found = exercise_cells(notebook)
    triples = [[cell for _, _, cell in found[i : i + 3]] for i in range(0, len(found), 3)]
    tried = set()
    plumbing.use_language("zh_CN" if edition == "chinese" else "en")
    try:
        for starter, solution, check in triples:
            (name,) = re.findall(r'gap_is_empty\("(\w+)", globals\(\)\)', solution.source)
            for wrong, shown in WRONG.get(name, []):
                namespace = dict(vars(at)) | what_a_check_reads()
                run_cell(helpers, namespace, "<cell helpers>")
                run_cell(re.sub(r"\.\.\.(?=  # ✎)", wrong, starter.source), namespace, "<s>")
                namespace["train_copy_task"] = None  # a check must not train a wrong answer
                with pytest.raises(AssertionError) as failed:
                    run_cell(check.source, namespace, f"<cell check {name}>")
                message = str(failed.value)
                assert "\n" not in message, (name, wrong, message)
                if edition == "english":
                    assert shown in message, (name, wrong, message)
                else:
                    assert not message.isascii(), (name, wrong, message)
            tried.add(name)
    finally:
        plumbing.use_language("en")
    assert set(WRONG) <= tried  # every exercise named above was found and tried


def test_an_answer_that_differs_only_by_rounding_passes():
    """An entropy with a tiny epsilon in its logarithm is right: the check compares within
    a tolerance, not to the last bit."""
    weights = torch.eye(4)[None, :3]
    yours = -(weights * torch.log2(weights + 1e-12)).sum(-1).mean(-1)
    plumbing.expect("one-hot", yours, torch.tensor([0.0]), "")
    with pytest.raises(AssertionError, match="yours is 3, expected 3.5"):
        plumbing.expect("a number", 3, 3.5, "a hint")
    with pytest.raises(AssertionError, match="yours is None, expected"):
        plumbing.expect("a tuple", None, (4000, 0.5), "a hint")
    with pytest.raises(AssertionError, match="gap"):
        plumbing.expect("an empty gap", ..., 1, "a hint")

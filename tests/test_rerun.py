"""Any cell can be run again (DESIGN.md): a student who scrolls back and presses
Shift-Enter on a definition must not break what comes after it.

The whole lesson runs once with the smoke preset; then every cell that defines a function
or class runs again, in notebook order, and a last cell checks three things: the run's
folder has the name it had (the key did not change), training with retrain=True and
decoding work, and Part 8's maps still find every attention block of the model trained
before the re-run, whose blocks are instances of the classes as they were then.
"""

import ast

import nbformat
import pytest
from conftest import ROOT, run_smoke_notebook

NOTEBOOK = ROOT / "annotated_transformer.ipynb"

BEFORE = """\
folder_before_rerun, model_before_rerun = folder, model
"""

AFTER = """\
assert plumbing.run_folder(settings, data, globals(), DATA_DIR) == folder_before_rerun
retrained_folder = plumbing.run_folder(settings, data, globals(), DATA_DIR, retrain=True)
retrained, retrained_history = train(settings, data, retrained_folder, device=device)
assert len(retrained_history) == settings.epochs
source = data.test[0][0]
(english,) = translate(retrained, [source], data.vocabs)
assert english and all(isinstance(word, str) for word in english)  # a list of tokens
_, _, old_maps = translate_with_attention(model_before_rerun, source, data.vocabs)
assert {kind: len(maps) for kind, maps in old_maps.items()} == {
    "encoder self-attention": settings.N,
    "decoder self-attention": settings.N,
    "encoder-decoder attention": settings.N,
}
print("re-run: same folder, retrained, decoded, old model's maps found")
"""


def defines(cell) -> bool:
    """Does the cell define a function or class at its top level?"""
    if cell.cell_type != "code":
        return False
    lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith("%")]
    body = ast.parse("\n".join(lines)).body
    return any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n in body)


def test_the_definition_cells_include_part_1s_attention():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    sources = [c.source for c in notebook.cells if defines(c)]
    assert any("class MultiHeadAttention(nn.Module)" in s for s in sources)
    assert any("def train(" in s for s in sources) and len(sources) > 50


@pytest.mark.slow  # runs the whole notebook, then trains once more
def test_every_definition_cell_can_be_run_again(multi30k_env, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    again = [nbformat.v4.new_code_cell(c.source) for c in notebook.cells if defines(c)]
    notebook.cells += [
        nbformat.v4.new_code_cell(BEFORE),
        *again,
        nbformat.v4.new_code_cell(AFTER),
    ]
    run_smoke_notebook(notebook, tmp_path)  # a failing cell raises, with its traceback
    printed = "".join(o.text for o in notebook.cells[-1].outputs if o.output_type == "stream")
    assert "same folder, retrained, decoded" in printed

"""The exported page, unit by unit: images, folded cells, notes and the figure. The page
of the executed notebook, English and Chinese, is tested in test_page.py."""

import base64
import re
import sys
import xml.etree.ElementTree as ET

import nbformat
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import export_html  # noqa: E402

FIGURE = "figures/transformer.svg"  # the architecture figure, relative to the notebook
SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(
    "mime", ["application/vnd.vegalite.v5+json", "application/vnd.vegalite.v6.json"]
)
def test_chart_spec_reads_the_mime_types_of_altair_5_and_6(mime):
    spec = {"mark": "point", "$schema": "https://vega.github.io/schema/vega-lite/v6.json"}
    assert export_html.chart_spec({mime: spec, "text/plain": "<chart>"}) == spec
    assert export_html.chart_spec({"text/plain": "<chart>"}) is None


def markdown_notebook(path, markdown: str):
    """Write a notebook of one markdown cell to `path`; return `path`."""
    cell = nbformat.v4.new_markdown_cell(markdown)
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), path)
    return path


def test_markdown_images_are_embedded_in_the_page(tmp_path):
    """Both ways a markdown cell can show the figure become data: URIs in the page."""
    markdown = (
        f'<img src="{FIGURE}" alt="The Transformer" width="700">\n\n![The Transformer]({FIGURE})'
    )
    source = markdown_notebook(tmp_path / "figure.ipynb", markdown)
    html = tmp_path / "figure.html"
    export_html.export(source, html)
    text = html.read_text(encoding="utf-8")
    data = base64.b64encode((ROOT / FIGURE).read_bytes()).decode("ascii")
    assert text.count(f'src="data:image/svg+xml;base64,{data}"') == 2
    assert FIGURE not in text, "the page would need the file"


@pytest.mark.parametrize("image", ["figures/missing.svg", "https://example.org/badge.svg"])
def test_an_image_the_page_cannot_embed_stops_the_export(tmp_path, image):
    """A missing file, or an image from the network: offline, either would be broken."""
    source = markdown_notebook(tmp_path / "missing.ipynb", f"[![gone]({image})](https://x.org)")
    with pytest.raises(FileNotFoundError, match=re.escape(image)):
        export_html.export(source, tmp_path / "missing.html")


def test_an_unwritable_target_is_one_clear_line(tmp_path, monkeypatch):
    source = markdown_notebook(tmp_path / "plain.ipynb", "Some prose.")
    (tmp_path / "build").write_text("a file where the folder must go")
    target = tmp_path / "build" / "page.html"
    monkeypatch.setattr(sys, "argv", ["export_html.py", str(source), str(target)])
    with pytest.raises(SystemExit) as error:
        export_html.main()
    message = str(error.value)
    assert message.startswith(f"cannot create the folder {target.parent}: ") and "\n" not in message


def test_figure_is_accessible_self_contained_and_names_real_classes():
    root = ET.parse(ROOT / FIGURE).getroot()
    assert root.tag == f"{SVG}svg" and root.get("width") == "700"
    assert root[0].tag == f"{SVG}title" and root.find(f"{SVG}desc").text.strip()
    elements = list(root.iter())
    assert not [e for e in elements if e.tag in (f"{SVG}script", f"{SVG}image", f"{SVG}a")]
    attributes = [(name, value) for e in elements for name, value in e.attrib.items()]
    assert not [a for a in attributes if a[0].endswith("href")], "a link needs the network"
    assert all(v.startswith("url(#") for _, v in attributes if "url(" in v)
    # every CamelCase name in a label is a class of the notebook (or PyTorch's nn.<name>)
    labels = " ".join(e.text or "" for e in root.iter(f"{SVG}text"))
    names = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", labels))
    code = (ROOT / "annotated_transformer.py").read_text(encoding="utf-8")
    assert len(names) >= 7
    assert [n for n in names if f"class {n}(" not in code and f"nn.{n}(" not in code] == []


def test_hide_input_cells_are_folded_and_others_are_not(tmp_path):
    """A cell tagged hide-input shows its code inside <details> ("show code"), with its
    output still in view; an untagged cell's code stays open."""
    hidden = nbformat.v4.new_code_cell("plumbing_detail = 1")
    hidden.metadata["tags"] = ["hide-input"]
    hidden.outputs = [nbformat.v4.new_output("stream", text="hidden cell's output\n")]
    shown = nbformat.v4.new_code_cell("lesson_code = 2")
    source = tmp_path / "folded.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[hidden, shown]), source)
    export_html.export(source, tmp_path / "folded.html")
    text = (tmp_path / "folded.html").read_text(encoding="utf-8")
    folded = re.findall(
        r"<details class=\"folded-code\"><summary>show code</summary>.*?</details>", text, re.S
    )
    assert len(folded) == 1 and "plumbing_detail" in folded[0]
    assert "lesson_code" not in folded[0] and "lesson_code" in text
    assert "hidden cell's output" in text.split(folded[0])[1]  # the output stays outside


def test_the_notebook_folds_only_what_is_not_the_lesson():
    """The folded cells are the Colab set-up, the exercises' solutions and a few helpers;
    they stay folded in JupyterLab too."""
    notebook = nbformat.read(ROOT / "annotated_transformer.ipynb", as_version=4)
    folded = [c for c in notebook.cells if "hide-input" in c.metadata.get("tags", [])]
    assert "google.colab" in folded[0].source
    assert all(c.metadata.get("jupyter", {}).get("source_hidden") for c in folded)

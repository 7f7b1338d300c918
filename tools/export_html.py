"""Export an executed notebook to one HTML page that needs no network.

nbconvert's page loads require.js and MathJax from a CDN, and it cannot draw Altair's
Vega-Lite outputs at all. This script makes the page self-contained: formulas become
MathML (which browsers draw natively), every chart becomes a vega-embed call, the
Vega, Vega-Lite and vega-embed scripts (bundled by vl-convert) are inlined once,
images that markdown cells link by a relative path (figures/*.svg) become data: URIs
(any other image stops the export: offline, it would be broken), and the code of cells
tagged `hide-input` is folded into a <details> block ("show code").

The page's language is the notebook's `lang` metadata (the Chinese edition says `zh-CN`),
else English: `<html lang>`, the fold's label, and for Chinese a CJK font stack of fonts
the reader's system has (no web font: the page stays offline and small).

    python tools/export_html.py build/annotated_transformer.ipynb build/annotated_transformer.html
"""

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat
import vl_convert
from bs4 import BeautifulSoup
from latex2mathml.converter import convert as latex_to_mathml
from nbconvert import HTMLExporter

# Markdown cells link images relative to the notebook in the project root; executed
# copies in build/ keep those links, so they are resolved from here, not from build/.
PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT))

from plumbing import DataError, write_atomically  # noqa: E402 (the project root is on the path now)

# Altair 5 says application/vnd.vegalite.v5+json; Altair 6 says ...v6.json (a dot, not "+").
VEGALITE = re.compile(r"application/vnd\.vegalite\.v\d+[+.]json")
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.DOTALL)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\$)(.+?)(?<!\\)\$")
MATH_TOKEN = re.compile(r"MATHTOKEN(\d+)X")
# Altair's HTML output ends by calling its loader with the spec: })({...spec...}, {"mode": ...
ALTAIR_HTML = re.compile(r'altair-viz-.*\}\)\((\{.*\}), \{"mode": "vega-lite"\}\);', re.DOTALL)
REMOTE_SCRIPT = re.compile(r'<script[^>]*\ssrc="https?://[^"]*"[^>]*>\s*</script>')
# After nbconvert has embedded the images, an <img> whose src is not a data: URI is a file
# it could not find or an image from the network: offline, a broken image either way.
NOT_EMBEDDED = re.compile(r'<img\b[^>]*?\ssrc="(?!data:)([^"]*)"')
# What the page says in each edition's language: the label of a folded cell and, for
# Chinese, the fonts of its prose and interface (code keeps JupyterLab's monospace stack).
SHOW_CODE = {"en": "show code", "zh-CN": "显示代码"}
CJK_FONTS = '"Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", sans-serif'
FONTS = {
    "zh-CN": f"<style>:root {{ --jp-ui-font-family: {CJK_FONTS}; "
    f"--jp-content-font-family: {CJK_FONTS}; }}</style>\n"
}


def math_to_tokens(markdown: str, formulas: list[str]) -> str:
    """Replace $$...$$ and $...$ with plain tokens, appending each one's MathML to formulas.

    The MathML goes into the page only after nbconvert: its image embedding re-parses a
    markdown cell's HTML and empties every MathML element it meets, which would leave
    the formulas' letters as flat text. A token (letters and digits) passes untouched."""

    def token(mathml: str) -> str:
        formulas.append(mathml)
        return f"MATHTOKEN{len(formulas) - 1}X"

    markdown = DISPLAY_MATH.sub(
        lambda m: token(latex_to_mathml(m.group(1).strip(), display="block")), markdown
    )
    return INLINE_MATH.sub(lambda m: token(latex_to_mathml(m.group(1).strip())), markdown)


def chart_html(spec: dict, number: int) -> str:
    """A div and the script that draws one Vega-Lite spec into it."""
    target = f"altair-chart-{number}"
    # The page's compiler is Vega-Lite 6 (see export), which reads v5 specs; without the
    # $schema, vega-embed does not log that the spec names an older version.
    spec = {key: value for key, value in spec.items() if key != "$schema"}
    spec_json = json.dumps(spec).replace("</", "<\\/")
    return (
        f'<div id="{target}" class="altair-chart"></div>\n<script>'
        f'vegaEmbed("#{target}", {spec_json}, {{"renderer": "svg", "actions": false}})'
        ".catch(function (error) { console.error(error); });</script>"
    )


def chart_spec(data: dict) -> dict | None:
    """The Vega-Lite spec of an Altair output (mime bundle or Altair's HTML), else None."""
    for mime in data:
        if VEGALITE.fullmatch(mime):
            return data[mime]
    match = ALTAIR_HTML.search(data.get("text/html", ""))
    return json.loads(match.group(1)) if match else None


def chart_specs(notebook) -> list[dict]:
    """Every chart of a notebook's outputs, in order."""
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    return [spec for o in outputs if (spec := chart_spec(o.get("data", {}))) is not None]


def inline_charts(notebook) -> int:
    """Turn every chart output into our offline HTML; return how many there were."""
    count = 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            spec = chart_spec(output.get("data", {}))
            if spec is not None:
                output["data"] = {"text/html": chart_html(spec, count)}
                count += 1
    return count


def fold_hidden_inputs(page: BeautifulSoup, label: str = SHOW_CODE["en"]) -> None:
    """Put the code of every cell tagged hide-input inside <details>: one click away.

    nbconvert's lab template gives such a cell the class celltag_hide-input."""
    for cell in page.select("div.celltag_hide-input"):
        code = cell.find("div", class_="jp-Cell-inputWrapper", recursive=False)
        if code is None:
            continue
        details = page.new_tag("details", attrs={"class": "folded-code"})
        summary = page.new_tag("summary")
        summary.string = label
        code.wrap(details)
        details.insert(0, summary)


def export(source: Path, target: Path, base: Path = PROJECT) -> int:
    """Write the offline page for `source` to `target`; return the number of charts.

    Images linked from markdown cells are read from paths relative to `base`."""
    notebook = nbformat.read(source, as_version=4)
    lang = notebook.metadata.get("lang", "en")
    formulas: list[str] = []
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = math_to_tokens(cell.source, formulas)
    charts = inline_charts(notebook)
    for cell in (c for c in notebook.cells if c.cell_type == "code"):
        # a progress bar that cleared itself leaves only blanks behind
        cell.outputs = [o for o in cell.outputs if o.output_type != "stream" or o.text.strip()]
    # embed_images: nbconvert replaces <img src=...> and ![...](...) in markdown by data: URIs
    exporter = HTMLExporter(template_name="lab", embed_images=True)
    body, _ = exporter.from_notebook_node(notebook, {"metadata": {"path": str(base)}})
    if missing := NOT_EMBEDDED.findall(body):
        raise FileNotFoundError(
            f"images the offline page cannot hold (not found under {base}, or on the "
            f"network): {', '.join(missing)}; put them in figures/"
        )
    body = REMOTE_SCRIPT.sub("", body)
    body = MATH_TOKEN.sub(lambda m: formulas[int(m.group(1))], body)
    page = BeautifulSoup(body, "html.parser")  # parsed once: seconds for this page
    fold_hidden_inputs(page, SHOW_CODE.get(lang, SHOW_CODE["en"]))
    body = str(page)
    body = body.replace('<html lang="en">', f'<html lang="{lang}">', 1)
    body = body.replace("</head>", f"{FONTS.get(lang, '')}</head>", 1)  # after the lab's CSS
    # vl-convert bundles Vega 6 with every Vega-Lite version; Vega-Lite 5 compiles to
    # Vega 5 specs (and vega-embed then warns), so the newest Vega-Lite compiles them all.
    bundle = vl_convert.javascript_bundle(vl_version=vl_convert.get_vegalite_versions()[-1])
    bundle = bundle.replace("</script", "<\\/script").replace("<!--", "<\\!--")  # stay in <script>
    body = body.replace("<head>", f"<head>\n<script>(function () {{\n{bundle}\n}})();</script>", 1)
    write_atomically(target, body.encode("utf-8"))
    return charts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="an executed .ipynb")
    parser.add_argument("target", type=Path, help="the .html to write")
    args = parser.parse_args()
    if not args.source.is_file():
        sys.exit(f"{args.source} does not exist: run `make run` first")
    try:
        charts = export(args.source, args.target)
    except DataError as error:  # the target's folder cannot be written
        sys.exit(str(error))
    size = args.target.stat().st_size / 2**20
    print(f"wrote {args.target} ({size:.1f} MiB, {charts} charts, works offline)")


if __name__ == "__main__":
    main()

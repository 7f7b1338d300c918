"""Measure which Altair renderer draws a chart with no network, in a real browser.

For each option (an Altair version and a renderer), a one-chart notebook with a tooltip is
  * run cell by cell inside JupyterLab ("live"),
  * executed by nbclient, then opened in JupyterLab, untrusted ("executed"),
  * exported by tools/export_html.py and opened as a file ("page"),
all in headless Chromium with the network cut off. Prints a Markdown table.

    python tools/measure_renderers.py [--altair5 DIR]

--altair5 names a folder holding Altair 5.5 (pip install --no-deps --target DIR altair==5.5.0);
without it only the installed Altair is measured.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import export_html  # noqa: E402
import lab_browser  # noqa: E402

CHART = """
import altair as alt, pandas as pd
frame = pd.DataFrame([{"x": x, "y": y, "v": x * y} for x in range(4) for y in range(4)])
alt.Chart(frame).mark_rect().encode(x="x:O", y="y:O", color="v:Q", tooltip=["x", "y", "v"])
"""
V5_RENDERER = """
import altair as alt
def vegalite_v5(spec):
    return {"application/vnd.vegalite.v5+json": spec, "text/plain": "<chart>"}
alt.renderers.register("vegalite_v5", vegalite_v5)
alt.renderers.enable("vegalite_v5")
"""
RENDERERS = {
    "default": "",
    "mimetype": "import altair as alt; alt.renderers.enable('mimetype')",
    "svg": "import altair as alt; alt.renderers.enable('svg')",
    "png": "import altair as alt; alt.renderers.enable('png')",
    "own v5+json": V5_RENDERER,
}


def notebook(setup: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(setup), nbformat.v4.new_code_cell(CHART)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    return nb


def tooltip_shows(page) -> bool:
    marks = page.locator(lab_browser.CHART).first
    box = marks.bounding_box()
    if box is None:
        return False
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.4)
    page.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + box["height"] * 0.45)
    page.wait_for_timeout(800)
    return page.locator("#vg-tooltip-element.visible").count() > 0


STATIC = ".jp-RenderedImage img, .jp-RenderedSVG img, .jp-RenderedSVG svg"


def drawn(page, static: bool, where: str = ".jp-OutputArea-output ") -> bool:
    """A Vega chart (marks in an SVG or canvas), or for static renderers an image."""
    if static:
        return page.locator(STATIC if where else "img, svg").count() > 0
    return page.locator(lab_browser.CHART if where else "svg.marks, canvas.marks").count() > 0


def yes(flag: bool) -> str:
    return "drawn" if flag else "blank"


def measure(label: str, env: dict, work: Path) -> list[str]:
    rows = []
    saved = dict(os.environ)
    os.environ.update(env)  # the kernels nbclient starts read PYTHONPATH from here
    try:
        for name, setup in RENDERERS.items():
            slug = f"{label}-{name}".replace(" ", "_").replace("+", "")
            nb = notebook(setup)
            nbformat.write(nb, work / f"{slug}-live.ipynb")
            page_path = work / f"{slug}.html"
            try:
                NotebookClient(nb, timeout=120).execute()
                nbformat.write(nb, work / f"{slug}-executed.ipynb")
                export_html.export(work / f"{slug}-executed.ipynb", page_path)
            except Exception as error:  # noqa: BLE001  (a measurement: record and go on)
                print(f"{slug}: cannot execute, save or export: {str(error)[:90]}")
            rows.append((name, slug, page_path))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    table = []
    home = work / f"home-{label}"
    home.mkdir()
    with lab_browser.jupyterlab(work, home, env=env) as (url, token):
        with lab_browser.offline_page() as (page, blocked):
            for name, slug, page_path in rows:
                lab_browser.open_notebook(page, url, token, f"{slug}-live.ipynb")
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_text("Run All Cells", exact=True).click()
                page.wait_for_timeout(1500)
                lab_browser.wait_idle(page, timeout=120)
                page.wait_for_timeout(2000)
                live = drawn(page, name in ("svg", "png"))
                live_tip = live and name not in ("svg", "png") and tooltip_shows(page)
                page.screenshot(path=work / f"{slug}-live.png")
                executed = executed_tip = False
                if (work / f"{slug}-executed.ipynb").exists():
                    lab_browser.open_notebook(page, url, token, f"{slug}-executed.ipynb")
                    page.wait_for_timeout(3000)
                    executed = drawn(page, name in ("svg", "png"))
                    executed_tip = executed and name not in ("svg", "png") and tooltip_shows(page)
                shown = tip = False
                if page_path.exists():
                    page.goto(page_path.as_uri())
                    page.wait_for_timeout(3000)
                    shown = drawn(page, name in ("svg", "png"), where="")
                    tip = shown and name not in ("svg", "png") and page_tooltip(page)
                table.append(
                    f"| Altair {label}, `{name}` | {yes(live)}{', tooltips' * live_tip} "
                    f"| {yes(executed)}{', tooltips' * executed_tip} "
                    f"| {yes(shown)}{', tooltips' * tip} |"
                )
                print(table[-1], flush=True)
            print(f"network cut: {lab_browser.network_is_cut(page)}; blocked: {len(blocked)}")
    return table


def page_tooltip(page) -> bool:
    marks = page.locator("svg.marks").first
    box = marks.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] * 0.4)
    page.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + box["height"] * 0.45)
    page.wait_for_timeout(800)
    return page.locator("#vg-tooltip-element.visible").count() > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--altair5", type=Path, help="a folder holding Altair 5.5")
    parser.add_argument("--only", nargs="*", choices=list(RENDERERS), help="these renderers")
    args = parser.parse_args()
    for name in set(RENDERERS) - set(args.only or RENDERERS):
        del RENDERERS[name]
    import altair

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        table = measure(altair.__version__, {}, work)
        if args.altair5:
            env = {"PYTHONPATH": f"{args.altair5}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            table += measure("5.5", env, work)
    print("\n| option | JupyterLab, live | executed notebook, untrusted | exported page |")
    print("|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()

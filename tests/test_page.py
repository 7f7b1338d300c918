"""The teaching pages of the executed notebook, English and Chinese: exported offline, every
chart renders in headless Chromium, and the Chinese page draws its text with real glyphs, not
missing-glyph boxes. They read the run that nbval just made of both notebooks (conftest.py
keeps its outputs, and keeps these tests on the notebooks' worker under pytest-xdist)."""

import dataclasses
import gzip
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
from bs4 import BeautifulSoup
from conftest import DATA_AFTER_FETCH, EXECUTED, ROOT, files_under, run_smoke_notebook

import presets

sys.path.insert(0, str(ROOT / "tools"))
import export_html  # noqa: E402
import translations  # noqa: E402

from tools.lab_browser import CHROMIUM, CHROMIUM_FLAGS, offline_page  # noqa: E402

BUILD = ROOT / "build" / "smoke"
OFFLINE_FLAGS = ["--headless", *CHROMIUM_FLAGS]


def executed_notebook(tmp_path_factory, session, path=ROOT / "annotated_transformer.ipynb"):
    """The notebook as nbval ran it in this session, or, when this file runs alone, the
    notebook run here with the smoke preset, its files under a folder of its own."""
    notebook = EXECUTED.get(path.resolve())
    if notebook is not None:
        return notebook
    ran = [i for i in session.items if i.nodeid.startswith(f"{path.name}::")]
    assert not ran, "nbval ran the notebook in this session: its outputs should have been kept"
    notebook = nbformat.read(path, as_version=4)
    build = tmp_path_factory.mktemp("smoke")
    run_smoke_notebook(notebook, build, coalesce_streams=True)
    return notebook


@pytest.fixture(scope="module")
def page(tmp_path_factory, request):
    """The executed smoke notebook and its exported page: (notebook, html path, charts)."""
    notebook = executed_notebook(tmp_path_factory, request.session)
    executed = tmp_path_factory.mktemp("page") / "executed.ipynb"
    nbformat.write(notebook, executed)
    html = BUILD / "annotated_transformer.html"
    charts = export_html.export(executed, html)
    return notebook, html, charts


@pytest.mark.slow  # reads the executed notebook: runs it unless nbval just did
def test_the_page_keeps_at_most_one_progress_line_per_epoch(page):
    """Training's bars clear themselves when an epoch ends (the live bar is for the one
    watching); the page keeps the one line that each epoch prints."""
    notebook, html, _ = page
    text = BeautifulSoup(html.read_text(encoding="utf-8"), "html.parser").get_text("\n")
    bars = [line for line in text.splitlines() if re.search(r"\d+%\|", line)]
    epochs = [line for line in text.splitlines() if re.match(r"\s*epoch \d+: train loss", line)]
    assert len(epochs) >= 2, "the smoke run prints one line per epoch"
    assert len(bars) <= 2, f"progress bars left on the page: {bars[:3]}"


@pytest.mark.slow
def test_the_smoke_run_leaves_the_data_folder_alone(page, multi30k):
    """The tests' notebook run keeps its caches and checkpoints under build/smoke/, so a
    contributor's data/ (and the models in it) is never read or changed by `make test`."""
    assert files_under(ROOT / "data") == DATA_AFTER_FETCH


@pytest.mark.slow
def test_no_output_holds_a_traceback(page):
    """IPython shows a chart that fails to render as a traceback, not as an error."""
    notebook, _, _ = page
    texts = [str(o) for cell in notebook.cells for o in cell.get("outputs", [])]
    assert [t for t in texts if "Traceback" in t] == []


def assert_self_contained(text: str) -> None:
    """The page's text loads nothing from the network and carries the chart libraries."""
    assert not re.search(r'<script[^>]*src="https?://', text), "a script would need the network"
    assert not re.search(r'<img[^>]*src="https?://', text), "an image would need the network"
    assert "@font-face" not in text, "a web font would need the network or bloat the page"
    assert "window.vegaEmbed" in text and "<math" in text
    assert text.count('<details class="folded-code">') >= 10  # solutions, one click away


@pytest.mark.slow
def test_page_is_self_contained(page):
    notebook, html, charts = page
    text = html.read_text(encoding="utf-8")
    assert charts == len(export_html.chart_specs(notebook)) == 8
    assert_self_contained(text)
    assert '<html lang="en">' in text


@pytest.fixture(scope="module")
def zh_page(tmp_path_factory, request):
    """The Chinese page as `make run-zh` builds it, from the Chinese notebook's own run (nbval's
    in `make test`), exported by the same exporter. (notebook, html path, charts)."""
    notebook = executed_notebook(tmp_path_factory, request.session, translations.CHINESE)
    executed = tmp_path_factory.mktemp("zh") / "executed.zh-CN.ipynb"
    nbformat.write(notebook, executed)
    html = BUILD / "annotated_transformer.zh-CN.html"
    charts = export_html.export(executed, html)
    return notebook, html, charts


def titles(spec) -> str:
    """Every title in a chart's spec (the chart's, its parts', its axes' and legends')."""
    if isinstance(spec, list):
        return " ".join(titles(part) for part in spec)
    if not isinstance(spec, dict):
        return ""
    found = [
        str(v.get("text", "") if isinstance(v, dict) else v)
        for k, v in spec.items()
        if k == "title"
    ]
    return " ".join(found + [titles(v) for k, v in spec.items() if k != "title"])


@pytest.mark.slow
def test_the_chinese_page_is_self_contained_and_says_its_language(page, zh_page):
    _, _, english_charts = page
    notebook, html, charts = zh_page
    text = html.read_text(encoding="utf-8")
    assert charts == english_charts == len(export_html.chart_specs(notebook))
    chinese_titles = [titles(spec) for spec in export_html.chart_specs(notebook)]
    assert [t for t in chinese_titles if not re.search(r"[\u4e00-\u9fff]", t)] == []
    printed = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    assert "已加载 " in printed, "trainer.py's messages are not in the notebook's language"
    assert_self_contained(text)
    assert '<html lang="zh-CN">' in text
    fonts = '"Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", sans-serif'
    assert f"--jp-content-font-family: {fonts};" in text
    assert "<summary>显示代码</summary>" in text
    prose = BeautifulSoup(text, "html.parser").select_one("div.jp-RenderedMarkdown").get_text()
    assert re.search(r"[\u4e00-\u9fff]", prose), "the first markdown cell is not in Chinese"


LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'’]*")
# A name or a unit a Chinese reader sees as it is: the paper's and the tools' names, and the
# words that the printed code (a setting's name, a path) and the progress bar are made of.
NAMES = {"Adam", "Altair", "Multi30k", "Python", "PyTorch", "Transformer", "beam", "greedy"}
NAMES |= {"it", "s", "ms", "min", "px", "torch", "sacreBLEU", "spaCy", "nan", "inf", "e"}
NAMES |= {"alpha", "pos", "logit", "rotate"}  # a symbol, a term and a function, as printed
NAMES |= {"Quantencomputer"}  # the German word of Part 7's own sentence that Multi30k lacks


def shown_in_charts(spec) -> list[str]:
    """The text a chart shows: its titles, its menus' labels, the field names that stand as
    titles where a channel has none, and the words of the fields it draws (a legend's
    entries, a nominal axis's labels, a tooltip's values; a boolean as true/false)."""
    rows = [row for data in spec.get("datasets", {}).values() for row in data]
    shown = [titles({k: v for k, v in spec.items() if k != "datasets"})]
    shown += [p["bind"].get("name", p["name"]) for p in spec.get("params", []) if "bind" in p]
    for encoding in encodings(spec):
        for channel in encoding.values():
            for used in channel if isinstance(channel, list) else [channel]:
                if "field" in used:
                    field = used["field"]
                    shown += [] if "title" in used else [field]
                    shown += [r[field] for r in rows if isinstance(r.get(field), str | bool)]
    return [str(t).lower() if isinstance(t, bool) else str(t) for t in shown]


def shown_as_text(notebook) -> list[str]:
    """What the executed notebook prints or displays as text: streams, results, tables (their
    headers and row labels too), errors. A chart's own text is read from its spec."""
    shown = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if output.get("output_type") == "stream":
                shown.append(output["text"])
            elif output.get("output_type") == "error":
                shown.append(f"{output['ename']}: {output['evalue']}")
            elif "text/html" in data:
                shown.append(BeautifulSoup(data["text/html"], "html.parser").get_text(" "))
            elif not any(kind.startswith("application/vnd.vegalite") for kind in data):
                shown.append(data.get("text/plain", "") + data.get("text/markdown", ""))
    return shown


def english_words(texts: list[str], allowed: set[str]) -> dict[str, str]:
    """The English words among what a reader sees, each with the text it came from. A word
    passes when it is part of code (a piece of text with a digit, "/", "_", "=", a bracket,
    a dot inside or a leading quote: a path, a setting, a repr), a name with two capitals
    (BLEU, GPU, LayerNorm, RMSNorm), or `allowed` (lower-cased): names, the data's words."""
    found = {}
    for text in texts:
        for piece in text.split():
            if re.search(r"[/_=()\[\]{}<>\d]|\w\.\w", piece) or piece[:1] in "'\"`":
                continue
            for word in LATIN_WORD.findall(piece):
                plain = word.strip("'’")
                if re.search(r"[A-Z].*[A-Z]", plain) or plain in NAMES:  # BLEU, LayerNorm
                    continue
                if plain.lower() not in allowed:
                    found.setdefault(plain, text.strip()[:120])
    return found


@pytest.fixture(scope="module")
def data_words(multi30k) -> set[str]:
    """Every word of Multi30k's German and English sentences, and the names of the settings
    and their values (a table of the presets shows them as they are), lower-cased."""
    words = set()
    for path in multi30k.glob("*.gz"):
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            words.update(w.lower() for w in LATIN_WORD.findall(lines.read()))
    for preset in presets.PRESETS.values():
        for name, value in dataclasses.asdict(preset).items():
            words |= {name.lower()} | ({value.lower()} if isinstance(value, str) else set())
    return words


@pytest.mark.slow
def test_the_chinese_run_shows_no_english_but_names_numbers_and_the_datas_words(
    page, zh_page, data_words
):
    """Everything the executed Chinese notebook shows a learner (printed lines, tables, chart
    titles, axis and legend titles, legend values, tooltips, menus) is Chinese, but for
    names, numbers, units and the data's own words. The English run, read the same way,
    shows English words: the check can fail."""
    seen = {}
    for edition, (notebook, _, _) in {"english": page, "chinese": zh_page}.items():
        charts = [t for spec in export_html.chart_specs(notebook) for t in shown_in_charts(spec)]
        seen[edition] = english_words(shown_as_text(notebook) + charts, data_words)
    assert {"parameters", "epoch"} & set(seen["english"]), seen["english"]
    assert seen["chinese"] == {}, f"English where the Chinese learner reads: {seen['chinese']}"


def explorer_numbers(notebook) -> list[int]:
    """The numbers of the attention explorers among the page's charts (Part 8's, not the last
    charts, since Appendix B draws one after them)."""
    specs = export_html.chart_specs(notebook)
    return [i for i, spec in enumerate(specs) if spec in explorers(notebook)]


def explorers(notebook) -> list[dict]:
    """The specs of the attention explorers: the charts with a layer and a head menu."""
    specs = export_html.chart_specs(notebook)
    return [s for s in specs if {p["name"] for p in s.get("params", [])} == {"layer", "head"}]


@pytest.mark.slow
def test_explorers_bind_layer_and_head_menus_and_show_the_words(page):
    notebook, _, _ = page
    charts = explorers(notebook)
    assert len(charts) == 3  # encoder, decoder and encoder-decoder attention
    for spec in charts:
        binds = {p["name"]: p["bind"]["input"] for p in spec["params"]}
        assert binds == {"layer": "select", "head": "select"}
        fields = {t["field"] for t in spec["encoding"]["tooltip"]}
        assert fields == {"query", "key", "weight"}
        assert all(t.get("title") for t in spec["encoding"]["tooltip"])  # words, not field names


def encodings(spec) -> list[dict]:
    """Every encoding of a chart and of its parts (layers, concatenations)."""
    if isinstance(spec, list):
        return [e for part in spec for e in encodings(part)]
    if not isinstance(spec, dict):
        return []
    found = [spec["encoding"]] if isinstance(spec.get("encoding"), dict) else []
    parts = [spec.get(k) for k in ("layer", "hconcat", "vconcat", "concat", "spec")]
    return found + [e for part in parts if part for e in encodings(part)]


@pytest.mark.slow
@pytest.mark.parametrize("edition", ["english", "chinese"])
def test_every_chart_titles_its_axes_and_tells_its_series_apart_by_colour(edition, page, zh_page):
    """A chart a teacher projects: each x and y axis says what it measures (a title of its
    own, or a field named in words; never a bare identifier such as "value", nor an empty
    title), and series differ by colour alone, which the legend shows (a dashed or shaped
    series would need a legend of its own)."""
    notebook = (page if edition == "english" else zh_page)[0]
    untitled, other_marks = [], []
    for number, spec in enumerate(export_html.chart_specs(notebook)):
        for encoding in encodings(spec):
            for channel in ("x", "y"):
                if "field" not in encoding.get(channel, {}):
                    continue
                field, title = encoding[channel]["field"], encoding[channel].get("title")
                if not (title or " " in field or not field.isascii()):  # "value", "step"
                    untitled.append((number, channel, field))
            for channel in ("strokeDash", "shape", "size", "opacity"):
                if "field" in encoding.get(channel, {}):
                    other_marks.append((number, channel))
    assert untitled == [] and other_marks == [], (untitled, other_marks)


@pytest.mark.slow  # and drives Chromium
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: apt-get install chromium")
def test_every_chart_renders_offline_without_script_errors(page, tmp_path):
    _, html, charts = page
    run = subprocess.run(
        [
            CHROMIUM,
            *OFFLINE_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=30000",
            "--dump-dom",
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    rendered = len(re.findall(r'<svg[^>]*class="marks"', run.stdout))
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert rendered == charts, f"{rendered} of {charts} charts rendered; console: {console}"
    assert console == [], f"the page logged: {console}"
    cut = re.findall(r"<text[^>]*>([^<]*…)</text>", run.stdout)  # Vega shortens what won't fit
    assert cut == [], f"labels cut short on the page: {cut}"
    # a copy of the page that shows only the cells of the three heatmaps (Part 8's explorers)
    heatmaps = ", ".join(f"#altair-chart-{i}" for i in explorer_numbers(page[0]))
    style = f"<style>.jp-Cell:not(:has({heatmaps})) {{ display: none; }}</style>"
    head, tail = html.read_text(encoding="utf-8").rsplit("</body>", 1)  # the last one
    scrolled = tmp_path / "heatmaps.html"
    scrolled.write_text(head + style + "</body>" + tail)
    screenshot = BUILD / "heatmap_screenshot.png"
    subprocess.run(
        [
            CHROMIUM,
            *OFFLINE_FLAGS,
            f"--user-data-dir={tmp_path / 'profile2'}",
            "--virtual-time-budget=30000",
            "--window-size=1400,1600",
            f"--screenshot={screenshot}",
            scrolled.as_uri(),
        ],
        capture_output=True,
        timeout=180,
        check=True,
    )
    assert screenshot.stat().st_size > 20_000  # a blank page compresses to under 10 kB


@pytest.mark.slow  # and drives Chromium
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: apt-get install chromium")
def test_explorer_menus_redraw_the_chart_offline(page):
    """In the exported page, with the network cut, choosing another head redraws the
    cross-attention explorer; the screenshot shows it after the change."""
    notebook, html, charts = page
    heads = max(explorers(notebook)[-1]["params"][1]["bind"]["options"])
    last = explorer_numbers(notebook)[-1]  # the cross-attention explorer
    with offline_page(height=1400) as (browser, blocked):
        browser.goto(html.as_uri())
        chart = browser.locator(f"#altair-chart-{last}")
        cells = chart.locator("g.mark-rect path")
        cells.first.wait_for(timeout=30_000)

        def colours() -> list[str]:
            return cells.evaluate_all("paths => paths.map(p => p.getAttribute('fill'))")

        before = colours()
        chart.locator("select[name='head']").select_option(str(heads))
        browser.wait_for_function(
            "([selector, old]) => [...document.querySelectorAll(selector)]"
            ".map(p => p.getAttribute('fill')).join() !== old",
            arg=[f"#altair-chart-{last} g.mark-rect path", ",".join(before)],
            timeout=10_000,
        )
        after = colours()
        chart.scroll_into_view_if_needed()
        chart.screenshot(path=BUILD / "explorer_last_head.png")
        assert len(after) == len(before) > 0 and after != before
        assert blocked == [], "the page reached for the network"
    assert (BUILD / "explorer_last_head.png").stat().st_size > 5_000


# Each distinct character of the prose, drawn on a canvas in the prose's font, against the
# drawing of U+10FFFD, a private-use code point that no font has. A character that no
# installed font has is drawn as that same missing-glyph box (.notdef), pixel for pixel:
# without a CJK font (Debian's fonts-noto-cjk) every Chinese character is, and this fails.
# (document.fonts.check could not fail here: it answers true for any font that is not a
# web font, installed or not.)
MISSING_GLYPHS = """(selector) => {
    const prose = [...document.querySelectorAll(selector)];
    const text = prose.map(element => element.innerText).join("");
    const characters = [...new Set(text.replace(/[\\s\\x00-\\x7f]/gu, ""))];
    const font = "32px " + getComputedStyle(prose[0]).fontFamily;
    const canvas = Object.assign(document.createElement("canvas"), {width: 48, height: 48});
    const context = canvas.getContext("2d", {willReadFrequently: true});
    const draw = (character) => {
        context.clearRect(0, 0, 48, 48);
        context.font = font;
        context.fillText(character, 4, 36);
        return context.getImageData(0, 0, 48, 48).data.join();
    };
    const box = draw("\\u{10FFFD}");
    return {font, characters: characters.length, missing: characters.filter(c => draw(c) === box)};
}"""
CJK_STACK = {"Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei"}  # the page's font stack


def cjk_font_installed() -> bool:
    """Whether fontconfig (where Chromium finds fonts on Linux) has a font of the stack."""
    if shutil.which("fc-list") is None:
        return False
    families = subprocess.run(["fc-list", ":", "family"], capture_output=True, text=True).stdout
    return any(name in families for name in CJK_STACK)


def platform_fonts(browser, selector: str) -> dict[str, int]:
    """The fonts that Chromium drew an element's own text with, as DevTools reports them:
    family -> glyphs. A character that the page's fonts lack is drawn by a fallback font."""
    cdp = browser.context.new_cdp_session(browser)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument")["root"]["nodeId"]
    node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    return {font["familyName"]: font["glyphCount"] for font in fonts}


@pytest.mark.slow  # and drives Chromium
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: apt-get install chromium")
def test_the_chinese_page_draws_every_chart_and_every_glyph_offline(zh_page):
    """With the network cut, the Chinese page draws as many charts as the English page, logs
    nothing, and draws its prose with real glyphs: no missing-glyph box, and its Part 1
    heading in a font of the page's CJK stack. Screenshots of its top and of Part 1."""
    _, html, charts = zh_page
    console: list[str] = []
    with offline_page(height=1000) as (browser, blocked):
        browser.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
        browser.on("pageerror", lambda error: console.append(f"error: {error}"))
        browser.goto(html.as_uri())
        drawn = "document.querySelectorAll('svg.marks').length"
        browser.wait_for_function(f"{drawn} >= {charts}", timeout=60_000)
        rendered = browser.evaluate(drawn)
        glyphs = browser.evaluate(MISSING_GLYPHS, "div.jp-RenderedMarkdown")
        browser.screenshot(path=BUILD / "zh_top.png")
        heading = "h2:has(> a[id='Part-1:-the-model'])"
        browser.locator(heading).evaluate("h => h.scrollIntoView()")
        browser.screenshot(path=BUILD / "zh_part1.png")
        logged = list(console)  # the page's own: DevTools' CSS domain, next, logs a file: error
        fonts = platform_fonts(browser, heading)
    assert rendered == charts, f"{rendered} of {charts} charts rendered; console: {logged}"
    assert logged == [], f"the page logged: {logged}"
    assert blocked == [], "the page reached for the network"
    assert glyphs["characters"] > 500, glyphs  # the page's prose is Chinese
    if glyphs["missing"] and not cjk_font_installed():  # under CI=true, a failure
        pytest.skip("no CJK font is installed: apt-get install fonts-noto-cjk")
    assert glyphs["missing"] == [], f"drawn as missing-glyph boxes in {glyphs['font']}: {glyphs}"
    assert fonts and set(fonts) <= CJK_STACK, f"Part 1's heading was drawn in {fonts}"
    for shot in ("zh_top.png", "zh_part1.png"):
        assert (BUILD / shot).stat().st_size > 20_000  # a blank page compresses to under 10 kB

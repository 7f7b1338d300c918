"""The Chinese edition: built from the English notebook and the catalogue, its code the English
code, its catalogue current, its terms the glossary's, its links and formulas intact.

`test_the_catalogue_is_fully_translated` and `test_the_glossary_terms_are_used` are the gate:
they fail until every entry of locale/zh_CN is translated and current."""

import csv
import json
import re
import shutil
import sys

import polib
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import translations as tr  # noqa: E402

GLOSSARY = tr.LOCALE / "glossary.tsv"


def markdown(nb: dict) -> str:
    """All the markdown of a notebook, one cell after another."""
    return "\n\n".join(tr.cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")


def glossary() -> list[dict]:
    """The glossary's rows (its `#` lines are its header comment)."""
    lines = [line for line in GLOSSARY.read_text(encoding="utf-8").splitlines() if line[:1] != "#"]
    return list(csv.DictReader(lines, delimiter="\t"))


@pytest.fixture(scope="module")
def fully_translated(tmp_path_factory) -> tuple[polib.POFile, dict]:
    """A catalogue whose every entry is "translated" (each line marked 中文, one line more in
    paragraphs, tables as they are), and the notebook built from it."""
    po = tr.make_pot(tr.load(tr.ENGLISH))
    for e in po:
        if e.msgid.startswith("|"):
            e.msgstr = e.msgid
        elif "\n" in e.msgid:
            e.msgstr = "\n".join("中文" + line for line in e.msgid.split("\n")) + "\n多一行"
        else:
            e.msgstr = "中文" + e.msgid
    path = tmp_path_factory.mktemp("po") / "fake.po"
    po.save(str(path))
    return po, json.loads(tr.build_text(tr.ENGLISH, path))


def test_the_code_cells_ids_and_metadata_are_the_english_ones():
    english, chinese = tr.load(tr.ENGLISH), tr.load(tr.CHINESE)
    assert len(chinese["cells"]) == len(english["cells"])
    for en, zh in zip(english["cells"], chinese["cells"], strict=True):
        assert (zh["cell_type"], zh["id"], zh["metadata"]) == (
            en["cell_type"],
            en["id"],
            en["metadata"],
        )
        if en["cell_type"] == "code":
            assert zh == en  # source, outputs (none), execution count: byte for byte
        else:
            assert set(zh) == set(en)
    assert chinese["metadata"]["lang"] == "zh-CN" and "jupytext" not in chinese["metadata"]


def test_the_committed_chinese_notebook_is_what_the_build_makes():
    assert tr.CHINESE.read_text(encoding="utf-8") == tr.build_text(), (
        "run `make translations` (or tools/translations.py build) and commit the result"
    )


def test_the_chinese_notebook_takes_an_english_runs_outputs_by_cell_id(tmp_path):
    """`make html` trains once: the Chinese page shows the English run's outputs, each in the
    cell of the same id; a run of other code (the English changed since) is refused."""
    executed = tr.load(tr.ENGLISH)
    code = [c for c in executed["cells"] if c["cell_type"] == "code"]
    for number, cell in enumerate(code, start=1):
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [cell["id"]]}]
        cell["execution_count"] = number
    (tmp_path / "executed.ipynb").write_text(tr.dump(executed), encoding="utf-8")
    tr.outputs(tmp_path / "executed.ipynb", tmp_path / "zh.ipynb")
    chinese, built = tr.load(tr.CHINESE), tr.load(tmp_path / "zh.ipynb")
    for zh, cell in zip(chinese["cells"], built["cells"], strict=True):
        if cell["cell_type"] == "code":
            assert cell["outputs"][0]["text"] == [cell["id"]] and cell["execution_count"]
            cell = {**cell, "outputs": [], "execution_count": None}
        assert cell == zh  # nothing else changes: the prose stays Chinese
    code[3]["source"] = ["changed = True\n"]
    with pytest.raises(ValueError, match=f"cells {code[3]['id']}.*make run"):
        tr.with_outputs(chinese, executed)
    executed["cells"].remove(code[3])  # a cell removed since the run
    with pytest.raises(ValueError, match=f"cells {code[3]['id']}"):
        tr.with_outputs(chinese, executed)
    executed = tr.load(tr.ENGLISH)
    executed["cells"].append({**code[3], "id": "new-cell"})  # a cell added since the run
    with pytest.raises(ValueError, match="added or removed"):
        tr.with_outputs(chinese, executed)


def test_an_empty_catalogue_builds_the_english_notebook_byte_for_byte(tmp_path):
    tr.make_pot(tr.load(tr.ENGLISH)).save(str(tmp_path / "empty.po"))
    english = tr.load(tr.ENGLISH)
    built = json.loads(tr.build_text(tr.ENGLISH, tmp_path / "empty.po"))
    assert built["cells"] == english["cells"]
    assert tr.dump(english) == tr.ENGLISH.read_text(encoding="utf-8")  # the file's own format


def test_each_block_of_a_translated_notebook_is_its_translation(fully_translated):
    """Line prefixes (quotes, list items, indents) survive, and added lines stay inside
    their block: the built cells parse into exactly the translated blocks."""
    po, built = fully_translated
    english = tr.load(tr.ENGLISH)
    for en, zh in zip(english["cells"], built["cells"], strict=True):
        if en["cell_type"] != "markdown":
            continue
        expected = [
            po.find(b.msgid, msgctxt=en["id"]).msgstr for b in tr.blocks(tr.cell_source(en))
        ]
        got = [re.sub(r"<a id=[^>]*></a>$", "", b.msgid) for b in tr.blocks(tr.cell_source(zh))]
        assert got == expected, en["id"]


@pytest.mark.parametrize("which", ["committed", "fully translated"])
def test_every_internal_link_leads_to_a_heading(which, fully_translated):
    """Links keep their ASCII English anchors; a translated heading that one of them targets
    carries that anchor as an `<a id>` (JupyterLab cannot follow non-ASCII fragments)."""
    nb = tr.load(tr.CHINESE) if which == "committed" else fully_translated[1]
    ids = set()
    for _, _, _, block in tr.walk(nb):
        if block.heading:
            ids.add(tr.anchor(block.msgid))
            ids.update(re.findall(r'<a id="([^"]+)"></a>', block.msgid))
    targets = tr.link_targets(nb)
    assert len(targets) >= 12
    assert sorted(targets - ids) == []
    assert all(target.isascii() for target in targets)


def test_the_check_finds_lost_formulas_links_and_html():
    english = "The mask $M_{ij}$, see [Part 2](#Part-2), <b>bold</b> and $$x^2$$."
    assert (
        tr.lost_markup(english, "掩码 $M_{ij}$，见[第 2 部分](#Part-2)，<b>粗</b>与 $$x^2$$。")
        == []
    )
    assert tr.lost_markup(english, "掩码 $M_ij$，见[第 2 部分](#第-2-部分)，粗与 $$x^2$$。") == [
        "math",
        "links",
        "html",
    ]


def test_every_translation_keeps_its_formulas_links_and_html():
    po = polib.pofile(str(tr.CATALOGUE))
    lost = {e.msgid[:50]: tr.lost_markup(e.msgid, e.msgstr) for e in po.translated_entries()}
    assert {text: kinds for text, kinds in lost.items() if kinds} == {}


def test_the_catalogue_is_fully_translated():
    """The gate: no fuzzy, untranslated or obsolete entry, and the catalogue holds exactly
    the English notebook's blocks."""
    found = tr.problems()
    assert found == [], f"{len(found)} problems, e.g. {found[:5]}; {tr.FIX}"


def test_the_glossary_terms_are_english_terms_of_the_notebook():
    prose = markdown(tr.load(tr.ENGLISH)).lower()
    rows = glossary()
    assert len(rows) >= 30
    assert [r["english"] for r in rows if r["english"].lower() not in prose] == []
    assert all(r["first part"] for r in rows)


def test_the_glossary_terms_are_used():
    """The gate for terms: each Chinese term appears, at its first use with the English in
    parentheses; no refused rendering appears anywhere."""
    prose = markdown(tr.load(tr.CHINESE))
    missing, unexplained, refused = [], [], []
    for row in glossary():
        chinese, english = row["chinese"], row["english"]
        if chinese not in prose:
            missing.append(chinese)
        elif chinese != english:
            after = prose[prose.index(chinese) : prose.index(chinese) + len(chinese) + 40]
            if not re.search(r"[（(][^）)]*" + re.escape(english.split()[0]), after, re.I):
                unexplained.append(chinese)
        refused += [alt for alt in row["refuse"].split("|") if alt and alt in prose]
    assert (missing, unexplained, refused) == ([], [], [])


@pytest.mark.skipif(
    shutil.which("msgmerge") is None, reason="needs GNU gettext: apt-get install gettext"
)
def test_an_english_edit_stales_its_entry_and_the_check_names_it(tmp_path, fully_translated):
    """Changed: fuzzy with the old English kept; new: untranslated; removed: obsolete."""
    po, _ = fully_translated
    catalogue, english, chinese = tmp_path / "zh.po", tmp_path / "en.ipynb", tmp_path / "zh.ipynb"
    po.save(str(catalogue))
    nb = tr.load(tr.ENGLISH)
    (_, cell, _, changed), (_, _, _, removed) = [
        (i, c, p, b) for i, c, p, b in tr.walk(nb) if " the " in b.msgid and len(b.msgid) > 200
    ][:2]
    text = tr.cell_source(cell).replace(changed.msgid, changed.msgid.replace(" the ", " a ", 1))
    text += "\n\nA new paragraph."
    cell["source"] = tr.source_lines(text)
    removed_cell = next(c for c in nb["cells"] if removed.msgid in tr.cell_source(c))
    removed_cell["source"] = tr.source_lines(
        tr.cell_source(removed_cell).replace(removed.msgid, "")
    )
    english.write_text(tr.dump(nb), encoding="utf-8")
    tr.update(english, catalogue, chinese)

    after = polib.pofile(str(catalogue))
    fuzzy = [e for e in after if "fuzzy" in e.flags and not e.obsolete]
    assert [(e.msgctxt, e.previous_msgid) for e in fuzzy] == [(cell["id"], changed.msgid)]
    assert [e.msgid for e in after.untranslated_entries()] == ["A new paragraph."]
    assert [e.msgid for e in after.obsolete_entries()] == [removed.msgid]
    lines = tr.problems(english, catalogue, chinese)
    assert [line.split(":")[0] for line in lines] == ["fuzzy", "untranslated", "obsolete"]
    assert all(f'msgctxt "{cell["id"]}"' in line for line in lines[:2])
    assert f'msgctxt "{removed_cell["id"]}"' in lines[2]

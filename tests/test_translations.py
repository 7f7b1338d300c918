"""The Chinese edition: built from the English notebook and the catalogue, its code the English
code, its catalogue current, its terms the glossary's, its links and formulas intact.

`test_the_catalogue_is_fully_translated` and `test_the_glossary_terms_are_used` are the gate:
they fail until every entry of locale/zh_CN is translated and current."""

import ast
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

import plumbing  # noqa: E402

GLOSSARY = tr.LOCALE / "glossary.tsv"


def markdown(nb: dict) -> str:
    """All the markdown of a notebook, one cell after another."""
    return "\n\n".join(tr.cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")


def contents_index() -> int:
    """The index of the contents cell (in both editions): the English one's "Contents"."""
    english = tr.load(tr.ENGLISH)
    return next(i for i, _, _, b in tr.walk(english) if b.heading and b.msgid == "Contents")


def prose(nb: dict) -> str:
    """The notebook's prose as a reader meets it: all the markdown but the contents (its link
    texts are the headings, a test holds them so) and the images' alt text."""
    skip = contents_index()
    cells = [c for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown" and i != skip]
    text = "\n\n".join(tr.cell_source(c) for c in cells)
    return re.sub(r"!\[[^\]]*\]\([^)]*\)", "", text)


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
        if "(code: a string)" in e.comment:  # inside the quotes: 中文 after the opening ones
            e.msgstr = re.sub(r"^([a-zA-Z]*(\"\"\"|'''|\"|'))", r"\1中文", e.msgid)
        elif "(code: a comment" in e.comment:
            e.msgstr = (
                "中文" + e.msgid.replace("\n", " ")
                if "after code" in e.comment
                else ("中文" + e.msgid + "\n多一行")
            )
        elif e.msgid.startswith("|"):
            e.msgstr = e.msgid
        elif "\n" in e.msgid:
            e.msgstr = "\n".join("中文" + line for line in e.msgid.split("\n")) + "\n多一行"
        else:
            e.msgstr = "中文" + e.msgid
    path = tmp_path_factory.mktemp("po") / "fake.po"
    po.save(str(path))
    return po, json.loads(tr.build_text(tr.ENGLISH, path))


@pytest.mark.parametrize("which", ["committed", "fully translated"])
def test_the_code_is_the_english_code_but_for_prose_strings_and_comments(which, fully_translated):
    """Ids, tags and metadata are the English ones. Each code cell's syntax tree, with every
    prose string masked as a run's key masks it, is the English cell's: a translation that
    changes code, or is not Python, fails here and in `make lint`."""
    english = tr.load(tr.ENGLISH)
    chinese = tr.load(tr.CHINESE) if which == "committed" else fully_translated[1]
    assert len(chinese["cells"]) == len(english["cells"])
    translated = 0
    for en, zh in zip(english["cells"], chinese["cells"], strict=True):
        assert (zh["cell_type"], zh["id"], zh["metadata"]) == (
            en["cell_type"],
            en["id"],
            en["metadata"],
        )
        assert set(zh) == set(en)
        if en["cell_type"] == "code":
            assert {**zh, "source": []} == {**en, "source": []}  # no outputs, no count
            assert tr.code_differs(tr.cell_source(en), tr.cell_source(zh)) == "", en["id"]
            translated += tr.cell_source(zh) != tr.cell_source(en)
    assert translated > 100  # the learner's strings and comments are Chinese
    assert chinese["metadata"]["lang"] == "zh-CN" and "jupytext" not in chinese["metadata"]


def test_a_translation_that_changes_code_is_named():
    """Masked: prose strings (words with spaces, or Chinese) and comments. Not masked: other
    strings (a setting's value, a key), f-string fields, and everything else."""
    english = 'x = f"loss {loss:.3f} at step {step}"  # a comment\nmode = "bf16"\n'
    same = 'x = f"第 {step} 步的损失 {loss:.3f}"  # 注释\nmode = "bf16"\n'
    assert tr.code_differs(english, same) == ""
    assert tr.code_differs(english, same.replace('"bf16"', '"fp32"')) != ""
    assert tr.code_differs(english, same.replace("{step}", "{step + 1}")) != ""
    assert tr.code_differs(english, same.replace('步的损失 {loss:.3f}"', "损失")).startswith(
        "is not Python"
    )
    assert tr.changed_in_code('"{n} pairs, 1.5 s"', '"{n} 对，1.5 秒"', comment=False) == []
    assert tr.changed_in_code('"{n} pairs, 1.5 s"', '"{m} 对，1 秒"', comment=False) == [
        "format fields",
        "numbers",
    ]


def test_each_string_and_comment_of_a_code_cell_is_one_entry():
    """Strings with their quotes; comments without `# `, a block of whole-line comments at one
    indentation as one entry; code, one-word strings and pragmas are not entries."""
    source = (
        "# Two lines of\n# one comment\n"
        "def f(x):\n"
        '    """Say what f does."""\n'
        "    # ✎ your answer\n"
        '    return x, "bf16", f"{x} left to go"  # after code\n'
        "import os  # noqa: E402\n"
    )
    found = [(t.msgid, t.lead, t.trailing) for t in tr.code_texts(source)]
    assert found == [
        ("Two lines of\none comment", "# ", False),
        ('"""Say what f does."""', "", False),
        ("✎ your answer", "    # ", False),
        ('f"{x} left to go"', "", False),
        ("after code", " " * 41 + "# ", True),  # its column
    ]
    chinese = {("c", "Two lines of\none comment"): "两行\n一条注释", ("c", "after code"): "代码后"}
    built = tr.translate_code(source, chinese, "c")
    assert built.startswith("# 两行\n# 一条注释\ndef f(x):") and "  # 代码后\n" in built


def test_the_committed_chinese_notebook_is_what_the_build_makes():
    assert tr.CHINESE.read_text(encoding="utf-8") == tr.build_text(), (
        "run `make translations` (or tools/translations.py build) and commit the result"
    )


def test_an_empty_catalogue_builds_the_english_notebook_byte_for_byte(tmp_path):
    """All but the language the modules' messages take."""
    tr.make_pot(tr.load(tr.ENGLISH)).save(str(tmp_path / "empty.po"))
    english = tr.load(tr.ENGLISH)
    built = json.loads(tr.build_text(tr.ENGLISH, tmp_path / "empty.po"))
    pairs = list(zip(english["cells"], built["cells"], strict=True))
    (language,) = [i for i, (en, _) in enumerate(pairs) if tr.LANGUAGE[0] in tr.cell_source(en)]
    assert [i for i, (en, zh) in enumerate(pairs) if en != zh] == [language]
    en, zh = pairs[language]
    assert tr.cell_source(zh) == tr.cell_source(en).replace(*tr.LANGUAGE)
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
    # a rendering under a quotation may repeat its formulas, but not drop, change or add one
    quote = '"the model $d_{\\text{model}}$ and $h$"'
    same = quote + "（译：模型 $d_{\\text{model}}$ 与 $h$）"
    assert tr.lost_markup(quote, same) == []
    assert tr.lost_markup(quote, quote + "（译：模型 $d_{model}$ 与 $h$）") == ["math"]
    assert tr.lost_markup(quote, same + " $k$") == ["math"]
    assert tr.lost_markup(quote, "模型 $h$") == ["math"]


def test_every_translation_keeps_its_formulas_links_and_html():
    po = polib.pofile(str(tr.CATALOGUE))
    prose = [e for e in po.translated_entries() if "(code:" not in e.comment]
    lost = {e.msgid[:50]: tr.lost_markup(e.msgid, e.msgstr) for e in prose}
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
    parentheses; no refused rendering appears anywhere (one that is part of the chosen
    term, as 词级词表 is of 单词级词表, only outside it)."""
    text = prose(tr.load(tr.CHINESE))
    missing, unexplained, refused = [], [], []
    for row in glossary():
        chinese, english = row["chinese"], row["english"]
        if chinese not in text:
            missing.append(chinese)
        elif chinese != english:
            after = text[text.index(chinese) : text.index(chinese) + len(chinese) + 40]
            if not re.search(r"[（(][^）)]*" + re.escape(english.split()[0]), after, re.I):
                unexplained.append(chinese)
        for alt in filter(None, row["refuse"].split("|")):
            if alt in (text.replace(chinese, "") if alt in chinese else text):
                refused.append(alt)
    assert (missing, unexplained, refused) == ([], [], [])


def test_the_english_of_a_glossary_term_is_given_once():
    """Say a thing once: a term's English follows it in parentheses at its first use, and
    nowhere after ("微批量（micro-batch）" once, then 微批量)."""
    text = prose(tr.load(tr.CHINESE))
    repeated = {}
    for row in glossary():
        if row["chinese"] != row["english"]:
            gloss = r"[（(]" + re.escape(row["english"]) + r"(?:s|es)?[，,）)]"
            if len(re.findall(gloss, text, re.I)) > 1:
                repeated[row["english"]] = len(re.findall(gloss, text, re.I))
    assert repeated == {}


def test_the_contents_link_texts_are_the_headings_they_point_to():
    """Each link of the Chinese contents reads as the heading it leads to, without the
    heading's "第 N 部分：" and without the English that a heading gives a term at its first
    use (the contents say it once more in Chinese only)."""
    nb = tr.load(tr.CHINESE)
    text = tr.cell_source(nb["cells"][contents_index()])
    definitions = dict(re.findall(r"^ {0,3}\[([^\]]+)\]:\s*#(\S+)", text, re.MULTILINE))
    links = re.findall(r"\[([^\]]+)\]\(#([^)\s]+)\)", text)
    links += [
        (label, definitions[ref]) for label, ref in re.findall(r"\[([^\]]+)\]\[([^\]]+)\]", text)
    ]
    headings = {}
    for _, _, _, block in tr.walk(nb):
        if block.heading:
            name = re.sub(r"<a id=[^>]*></a>$", "", block.msgid)
            for target in [
                tr.anchor(block.msgid),
                *re.findall(r'<a id="([^"]+)"></a>', block.msgid),
            ]:
                headings[target] = name
    assert len(links) == 17  # Prelims, Background, the nine parts and six appendices
    differ = []
    for label, target in links:
        heading = re.sub(r"^第 \d+ 部分：", "", headings[target])
        heading = re.sub(r"^附录 ([A-Z])：", r"\1. ", heading)  # the contents letter them
        heading = re.sub(r"（[A-Za-z][^（）\u4e00-\u9fff]*）", "", heading)  # an English gloss
        if label != heading:
            differ.append((label, headings[target]))
    assert differ == []


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


@pytest.mark.skipif(
    shutil.which("msgmerge") is None, reason="needs GNU gettext: apt-get install gettext"
)
def test_an_edited_english_string_in_code_stales_its_entry(tmp_path, fully_translated):
    """A learner-facing string is prose like any paragraph: edited in English, its entry
    turns fuzzy and the check names it; until it is translated again, the build writes the
    new English."""
    po, _ = fully_translated
    catalogue, english, chinese = tmp_path / "zh.po", tmp_path / "en.ipynb", tmp_path / "zh.ipynb"
    po.save(str(catalogue))
    nb = tr.load(tr.ENGLISH)
    said = "pads should not move real positions"  # a check's message (exercise 2.2)
    cell = next(c for c in nb["cells"] if said in tr.cell_source(c))
    old = next(t.msgid for t in tr.code_texts(tr.cell_source(cell)) if said in t.msgid)
    new = old.replace("should not", "must not")
    cell["source"] = tr.source_lines(tr.cell_source(cell).replace(old, new))
    english.write_text(tr.dump(nb), encoding="utf-8")
    tr.update(english, catalogue, chinese)
    fuzzy = [e for e in polib.pofile(str(catalogue)) if "fuzzy" in e.flags and not e.obsolete]
    assert [(e.msgctxt, e.msgid, e.previous_msgid) for e in fuzzy] == [(cell["id"], new, old)]
    lines = tr.problems(english, catalogue, chinese)
    assert len(lines) == 1 and lines[0].startswith(f'fuzzy: msgctxt "{cell["id"]}"'), lines


def test_every_message_of_the_modules_names_the_fields_it_fills():
    """plumbing.say formats each message with its keywords: a field without one would stop
    the program where it meant to explain a problem."""
    import ast
    import string

    checked = 0
    for name in tr.MODULES:
        for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "say":
                fields = {f for _, f, _, _ in string.Formatter().parse(node.args[0].value) if f}
                given = {k.arg for k in node.keywords}
                if None not in given:  # no **mapping, whose keys a reading cannot see
                    assert fields == given, (name, node.args[0].value)
                checked += 1
    assert checked >= 25


def test_the_modules_speak_the_notebooks_language():
    """The Chinese notebook asks for zh_CN; then a message is the catalogue's, its fields
    filled in; back in English, the English."""
    chinese = tr.cell_source(next(c for c in tr.load(tr.CHINESE)["cells"] if "use_language" in
                                  tr.cell_source(c)))  # fmt: skip
    assert 'plumbing.use_language("zh_CN")' in chinese
    try:
        plumbing.use_language("zh_CN")
        assert plumbing.say("loaded {path}", path="x/last.pt") == "已加载 x/last.pt"
        plumbing.use_language("de")  # no catalogue: English
        assert plumbing.say("loaded {path}", path="x/last.pt") == "loaded x/last.pt"
    finally:
        plumbing.use_language("en")
    assert plumbing.say("loaded {path}", path="x/last.pt") == "loaded x/last.pt"


def test_a_label_with_commas_between_its_words_is_prose():
    """A printed label whose words stand apart by commas, such as
    f"{n:,} parameters, {m} epochs, in {folder}", reaches the catalogue, and the run's key
    masks it as it masks any prose; a name or a setting stays code."""
    label = ast.parse('f"{n:,} parameters, {m} epochs, in {folder}"', mode="eval").body
    assert plumbing.canonical(label).startswith("Prose(")
    assert tr.PROSE.search(" parameters,  epochs, in ") and tr.PROSE.search("loss; accuracy")
    for code in ("d_model", "train.de.gz", "fp32", "cpu-820d2db5", "a", "x, y"):
        assert not tr.PROSE.search(code), code

"""The Chinese edition: a gettext catalogue of the English notebook's prose, and the notebook
built from it.

    python tools/translations.py update        # English -> POT -> msgmerge the .po -> build
    python tools/translations.py build         # write annotated_transformer.zh-CN.ipynb
    python tools/translations.py check         # exit 1 naming every stale entry (make lint)
    python tools/translations.py chunks        # split the .po into work packages for translators
    python tools/translations.py merge-chunks  # copy their translations back, then build
    python tools/translations.py outputs build/annotated_transformer.ipynb \
        build/annotated_transformer.zh-CN.ipynb   # the Chinese notebook with a run's outputs

One entry per paragraph, heading, list item's paragraph, table and block quote's paragraph
of each markdown cell, found by markdown-it-py (CommonMark, tables, dollar math) from its
`token.map` line ranges; math blocks, fences, HTML blocks and link reference definitions
stay as they are. msgctxt is the cell id alone, so an inserted paragraph stales nothing
else. polib writes only the POT; GNU gettext's `msgmerge --previous` writes the .po, so a
changed English paragraph turns fuzzy with its old English kept (`#| msgid`).

Headings keep their English anchors: JupyterLab 4 cannot follow a Markdown link to a heading
whose anchor has non-ASCII characters (jupyterlab/jupyterlab#12402; its click handler looks
the percent-encoded fragment up among raw ids). So a translated heading that a link in the
notebook targets gets an empty `<a id="English-anchor"></a>`, and every link stays as it is.

One link changes: the Colab badge's, which opens the notebook it sits in. Its URL is a link
reference definition (not a translatable block), so the build points it at the Chinese
notebook; the check, which compares the links of each entry, never sees it.

Code cells: what a learner reads in them is translated too. Each prose string (a docstring, a
message, a title: words with spaces) is an entry, its Python literal as written, quotes and
all; each comment is an entry, a block of whole-line comments as one. Everything else stays
the English code: the check parses every translated cell and compares its syntax tree, prose
strings masked as a run's key masks them (plumbing.canonical), with the English one, and
each entry's format fields and numbers with its English. So a translated string is a harmless
edit: either edition's run loads the other's. Strings that code looks up (a dict key read in
another cell, a German sentence) are translated as themselves.

The modules' messages (each call of plumbing.say in MODULES) are entries of context
"messages". The Chinese notebook asks for them with `plumbing.use_language("zh_CN")`, the one
literal the build changes beyond prose: the language is the notebook's, so it is its code.
"""

import argparse
import ast
import html
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import polib
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from plumbing import PROSE as PROSE_PATTERN  # noqa: E402  (a run's key masks the same prose)
from plumbing import canonical  # noqa: E402  (the run's key reads code the same way)

ENGLISH = ROOT / "annotated_transformer.ipynb"
CHINESE = ROOT / "annotated_transformer.zh-CN.ipynb"
LOCALE = ROOT / "locale" / "zh_CN"
CATALOGUE = LOCALE / "LC_MESSAGES" / "annotated_transformer.po"
CHUNKS = LOCALE / "chunks"
POT = ROOT / "build" / "locale" / "annotated_transformer.pot"
FIX = (
    "to fix: run `make translations`, then translate the entries named above in "
    f"{CATALOGUE.relative_to(ROOT)} (and delete each `#, fuzzy` line once its Chinese is current)"
)
PARSER = MarkdownIt("commonmark").enable("table").use(dollarmath_plugin)
LINK_TARGET = re.compile(r"\]\(#([^)\s]+)\)|^ {0,3}\[[^\]]+\]:\s*#(\S+)", re.MULTILINE)


@dataclass
class Block:
    """One translatable block of a markdown cell: its lines [start, end) in the cell, the
    text a translator sees (`msgid`), and each line's container prefix (`> `, `* `, indent)."""

    start: int
    end: int
    msgid: str
    prefixes: list[str]
    heading: str = ""  # the `#`s of a heading, "" for anything else


def blocks(source: str) -> list[Block]:
    """The translatable blocks of one markdown cell, in order."""
    lines = source.split("\n")
    found = []
    tokens = PARSER.parse(source)
    for i, token in enumerate(tokens):
        if token.type == "table_open":
            start, end = token.map
            found.append(Block(start, end, "\n".join(lines[start:end]), [""] * (end - start)))
        elif token.type in ("paragraph_open", "heading_open") and not in_table(tokens, i):
            start, end = token.map
            content = tokens[i + 1].content.split("\n")
            assert len(content) == end - start, (source, token.map)
            prefixes = []
            for line, text in zip(lines[start:end], content, strict=True):
                assert line.rstrip().endswith(text.strip()), (line, text)
                prefixes.append(line[: len(line.rstrip()) - len(text.strip())])
            msgid = "\n".join(text.strip() for text in content)
            found.append(Block(start, end, msgid, prefixes, token.markup * (token.type[0] == "h")))
    return found


def in_table(tokens, i: int) -> bool:
    """Whether token i lies inside a table (a table is one entry, not one per cell)."""
    depth = 0
    for token in tokens[:i]:
        depth += {"table_open": 1, "table_close": -1}.get(token.type, 0)
    return depth > 0


# --- the code cells' strings and comments -----------------------------------------------

# Prose in code: words with spaces, or Chinese; what plumbing.canonical masks in a run's key.
PROSE = re.compile(PROSE_PATTERN)
# The one change to code beyond prose: the language of the project's messages (plumbing.say).
LANGUAGE = ('use_language("en")', 'use_language("zh_CN")')
# The files whose messages (calls of plumbing.say) the catalogue translates, as "messages".
MODULES = ("plumbing.py", "trainer.py", "presets.py", "tools/train_ddp.py")
# A comment or docstring with a word in it is for reading (a run's key ignores both), unless
# it is only a tool's pragma.
WORDS = re.compile(r"[A-Za-z]{2,}|[\u2e80-\u9fff\uff00-\uffef]")
PRAGMA = re.compile(r"^(noqa(: ?[A-Z]+\d+(, ?[A-Z]+\d+)*)?|fmt: ?\w+|type: ?[\w\[\], ]+)$")
FIELD = re.compile(r"(?<!\{)\{[^{}]*\}(?!\})")  # a format field: {loss:.3f}, {}
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


@dataclass
class CodeText:
    """A string or comment of a code cell that a learner reads: its span [start, end) in the
    cell's source, and its English. A string's English is its literal as written, quotes and
    all; a comment's is its text without `# `, a line per line of a block of comments, and
    `lead` is what starts each line after the first."""

    start: int
    end: int
    msgid: str
    lead: str = ""
    trailing: bool = False  # a comment after code on its line: one line only


def code_texts(source: str) -> list[CodeText]:
    """The prose strings (docstrings, messages, titles) and comments of one code cell, in
    order. Consecutive whole-line comments at one indentation are one entry."""
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(row: int, byte_col: int) -> int:  # ast counts columns in UTF-8 bytes
        return starts[row - 1] + len(lines[row - 1].encode()[:byte_col].decode())

    found = []
    tree = ast.parse(source)
    inside = set()  # the parts of f-strings, which belong to their f-string
    documents = {  # docstrings, which a run's key leaves out
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside.update(id(v) for v in ast.walk(node) if v is not node)
            words = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = node.value
        else:
            continue
        if id(node) not in inside and (WORDS if id(node) in documents else PROSE).search(words):
            start = offset(node.lineno, node.col_offset)
            end = offset(node.end_lineno, node.end_col_offset)
            found.append(CodeText(start, end, source[start:end]))

    block: list[tokenize.TokenInfo] = []

    def close():
        text = " ".join(t.string[1:].strip() for t in block)
        if block and WORDS.search(text) and not PRAGMA.match(text):
            (row, col), (end_row, end_col) = block[0].start, block[-1].end
            text = "\n".join(re.sub(r"^# ?", "", t.string) for t in block)
            trailing = bool(lines[row - 1][:col].strip())
            lead = " " * col + "# "
            found.append(CodeText(starts[row - 1] + col, starts[end_row - 1] + end_col, text,
                                  lead, trailing))  # fmt: skip
        block.clear()

    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                close()  # code between two comments parts them
            continue
        (row, col), empty = token.start, token.string.strip() == "#"
        whole_line = not lines[row - 1][:col].strip()
        follows = block and block[-1].start == (row - 1, col) and whole_line
        if not follows:
            close()
        if not empty:
            block.append(token)
        if not whole_line:
            close()
    close()
    return sorted(found, key=lambda t: t.start)


def translate_code(source: str, chinese: dict, cell_id: str) -> str:
    """One code cell with each translated string and comment put in place of its English."""
    for text in reversed(code_texts(source)):
        new = chinese.get((cell_id, text.msgid))
        if new is None:
            continue
        if text.lead:
            lines = new.split("\n")
            new = "# " + (" ".join(lines) if text.trailing else ("\n" + text.lead).join(lines))
        source = source[: text.start] + new + source[text.end :]
    return source


def masked(source: str) -> str:
    """A code cell as a run's key reads it: its syntax tree with prose strings masked (and
    so comments, docstrings and prose in either language ignored)."""
    return canonical(ast.parse(source.replace(LANGUAGE[1], LANGUAGE[0])))


def changed_in_code(msgid: str, msgstr: str, comment: bool) -> list[str]:
    """What a code entry's translation must keep: a string's format fields, and every number
    (units are the English's too; a test cannot see those)."""
    lost = []
    if not comment and sorted(FIELD.findall(msgid)) != sorted(FIELD.findall(msgstr)):
        lost.append("format fields")
    numbers = NUMBER.findall(msgstr)
    if any(numbers.count(n) < NUMBER.findall(msgid).count(n) for n in NUMBER.findall(msgid)):
        lost.append("numbers")
    return lost


def anchor(heading_text: str) -> str:
    """A heading's anchor as JupyterLab and nbconvert make it: its text, spaces as `-`."""
    rendered = PARSER.renderInline(heading_text)
    return html.unescape(re.sub(r"<[^>]+>", "", rendered)).strip().replace(" ", "-")


def cell_source(cell) -> str:
    """A cell's source as one string (nbformat stores a list of lines)."""
    return "".join(cell["source"])


def source_lines(text: str) -> list[str]:
    """A string as nbformat's list of lines, each but the last ending in a newline."""
    return [line for line in re.split(r"(?<=\n)", text) if line]


def load(path: Path) -> dict:
    """A notebook as plain JSON (not nbformat), so that it is written back byte for byte."""
    return json.loads(path.read_text(encoding="utf-8"))


def dump(nb: dict) -> str:
    """The notebook file's text, formatted as Jupyter writes the English one."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def walk(nb: dict):
    """(cell index, cell, part heading, block) for every block of every markdown cell."""
    part = ""
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for block in blocks(cell_source(cell)):
            if block.heading in ("#", "##"):
                part = block.msgid
            yield index, cell, part, block


def link_targets(nb: dict) -> set[str]:
    """The fragments that the notebook's markdown links to (`](#X)` and `[ref]: #X`)."""
    text = "\n".join(cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    return {a or b for a, b in LINK_TARGET.findall(text)}


# --- extract and merge -----------------------------------------------------------------


def make_pot(nb: dict) -> polib.POFile:
    """The template: one entry per block, its cell id as context, and for translators the
    cell's index and the part it is under."""
    pot = polib.POFile(wrapwidth=79)
    pot.metadata = {
        "Project-Id-Version": "annotated-transformer",
        "MIME-Version": "1.0",
        "Content-Type": "text/plain; charset=UTF-8",
        "Content-Transfer-Encoding": "8bit",
    }
    seen = set()
    for index, cell, part, msgid, kind in texts(nb):
        if (cell["id"], msgid) in seen:  # the same text twice in one cell: one entry
            continue
        seen.add((cell["id"], msgid))
        comment = f"cell {index}{kind}, under: {part}"
        pot.append(polib.POEntry(msgctxt=cell["id"], msgid=msgid, comment=comment))
    for name, msgid in messages():
        if ("messages", msgid) not in seen:
            seen.add(("messages", msgid))
            comment = f"{name}: a message (keep its {{fields}})"
            pot.append(polib.POEntry(msgctxt="messages", msgid=msgid, comment=comment))
    return pot


def messages() -> list[tuple[str, str]]:
    """(file, English) for every message of the project's modules: the first argument of each
    call of plumbing.say, a format string. Their entries' context is "messages"."""
    found = []
    for name in MODULES:
        for node in ast.walk(ast.parse((ROOT / name).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "say":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    found.append((name, first.value))
    return found


def texts(nb: dict):
    """(cell index, cell, part heading, English, kind) for every block of the markdown and
    every prose string and comment of the code, in the notebook's order. The kind is "" for
    markdown, else says which of a string, a comment or a comment after code it is."""
    part = ""
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            for block in blocks(cell_source(cell)):
                if block.heading in ("#", "##"):
                    part = block.msgid
                yield index, cell, part, block.msgid, ""
        elif cell["cell_type"] == "code":
            for text in code_texts(cell_source(cell)):
                kind = " (code: a string)"
                if text.lead:
                    kind = (
                        " (code: a comment after code, one line)"
                        if text.trailing
                        else (" (code: a comment)")
                    )
                yield index, cell, part, text.msgid, kind


def gettext(*args: str) -> None:
    """Run a GNU gettext command, saying how to install it when it is missing."""
    if shutil.which(args[0]) is None:
        sys.exit(f"{args[0]} not found: install GNU gettext (Debian: apt-get install gettext)")
    subprocess.run(args, check=True)


def update(english: Path = ENGLISH, catalogue: Path = CATALOGUE, chinese: Path = CHINESE):
    """Extract the POT, merge it into the catalogue (created the first time, by msginit),
    and rebuild the Chinese notebook."""
    POT.parent.mkdir(parents=True, exist_ok=True)
    make_pot(load(english)).save(str(POT))
    if not catalogue.exists():
        catalogue.parent.mkdir(parents=True, exist_ok=True)
        gettext(
            "msginit", "--no-translator", "--locale=zh_CN.UTF-8",
            f"--input={POT}", f"--output-file={catalogue}",
        )  # fmt: skip
    # Not `--update`, which leaves the file as it is when only its layout would change (after
    # polib wrote it, for example): always write gettext's own layout.
    merged = catalogue.with_suffix(".merged")
    gettext(
        "msgmerge", "--quiet", "--previous", f"--output-file={merged}", str(catalogue), str(POT)
    )
    merged.replace(catalogue)
    build(english, catalogue, chinese)


# --- build -----------------------------------------------------------------------------


def translations(catalogue: Path) -> dict[tuple[str, str], str]:
    """(cell id, English) -> Chinese, for every entry that is translated and not fuzzy."""
    po = polib.pofile(str(catalogue))
    return {(e.msgctxt, e.msgid): e.msgstr for e in po.translated_entries() if not e.obsolete}


def translate_cell(source: str, chinese: dict, cell_id: str, targets: set[str]) -> str:
    """One markdown cell with each translated block put in place of its English lines."""
    lines = source.split("\n")
    for block in reversed(blocks(source)):
        text = chinese.get((cell_id, block.msgid))
        if text is None:
            continue
        if block.heading:
            text = " ".join(text.split("\n"))  # a second line would not be heading
            if anchor(block.msgid) in targets and anchor(text) != anchor(block.msgid):
                text += f'<a id="{html.escape(anchor(block.msgid))}"></a>'
        new = text.split("\n")
        more = continuation(block.prefixes)
        prefixes = block.prefixes[: len(new)] + [more] * (len(new) - len(block.prefixes))
        lines[block.start : block.end] = [
            p + t if t else p.rstrip() for p, t in zip(prefixes, new, strict=True)
        ]
    return "\n".join(lines)


def continuation(prefixes: list[str]) -> str:
    """The prefix of a line added to a block: the second line's, else the first line's with
    its list marker blanked (`* ` -> two spaces, `> 1. ` -> `>    `)."""
    if len(prefixes) > 1:
        return prefixes[1]
    return re.sub(r"[^>\s]", " ", prefixes[0])


def build_text(english: Path = ENGLISH, catalogue: Path = CATALOGUE) -> str:
    """The Chinese notebook's text: the English one with its prose translated, and the prose
    strings and comments of its code. Ids, tags and metadata are the English ones; the
    notebook is marked `lang: zh-CN` and unpaired from the `.py` twin (jupytext would
    otherwise write a Chinese twin on save)."""
    nb = load(english)
    chinese = translations(catalogue)
    targets = link_targets(nb)
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = translate_cell(cell_source(cell), chinese, cell["id"], targets)
            cell["source"] = source_lines(text)
        elif cell["cell_type"] == "code":
            text = translate_code(cell_source(cell), chinese, cell["id"]).replace(*LANGUAGE)
            cell["source"] = source_lines(text)
    nb["metadata"].pop("jupytext", None)
    nb["metadata"]["lang"] = "zh-CN"
    return dump(nb)


def build(english: Path = ENGLISH, catalogue: Path = CATALOGUE, chinese: Path = CHINESE):
    """Write the Chinese notebook."""
    chinese.write_text(build_text(english, catalogue), encoding="utf-8")


# --- check -----------------------------------------------------------------------------

MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)|^ {0,3}\[[^\]]+\]:\s*(\S+)|\]\[([^\]]*)\]", re.MULTILINE)
TAG = re.compile(r"</?[a-zA-Z][^>]*>")


def markup(text: str) -> dict[str, list[str]]:
    """What a translation must keep: math spans, link targets and references, HTML tags."""
    return {
        "math": sorted(MATH.findall(text)),
        "links": sorted("".join(m) for m in LINK.findall(text)),
        "html": sorted(TAG.findall(text)),
    }


def lost_markup(msgid: str, msgstr: str) -> list[str]:
    """The kinds of markup (math, links, html) whose spans differ between English and Chinese.

    A formula may occur more often in the Chinese: the rendering under a quotation writes the
    quotation's symbols as the quotation does ($d_{\\text{model}}$, not d_model). None may be
    missing, changed or new."""
    english, chinese = markup(msgid), markup(msgstr)
    lost = []
    for kind in english:
        if kind == "math":
            same = set(english[kind]) == set(chinese[kind]) and all(
                chinese[kind].count(span) >= english[kind].count(span) for span in english[kind]
            )
        else:
            same = english[kind] == chinese[kind]
        if not same:
            lost.append(kind)
    return lost


def problems(english: Path = ENGLISH, catalogue: Path = CATALOGUE, chinese: Path = CHINESE):
    """One line per stale entry or stale file; empty when the Chinese edition is current."""
    nb = load(english)
    index = {c["id"]: i for i, c in enumerate(nb["cells"])}
    if not catalogue.exists():
        return [f"{catalogue.relative_to(ROOT)} is missing"]
    po = polib.pofile(str(catalogue))
    code_cells = {c["id"] for c in nb["cells"] if c["cell_type"] == "code"}
    found = []
    for e in po:
        where = f"cell {index[e.msgctxt]}" if e.msgctxt in index else "a removed cell"
        where = "a module's message" if e.msgctxt == "messages" else where
        words = " ".join(e.msgid.split()[:8])
        name = f'msgctxt "{e.msgctxt}" ({where}) "{words} …"'
        if e.obsolete:
            found.append(f"obsolete: {name}: the English is gone; delete the entry")
        elif "fuzzy" in e.flags:
            found.append(f"fuzzy: {name}: the English changed; update the Chinese")
        elif not e.msgstr:
            found.append(f"untranslated: {name}")
        elif e.msgctxt in code_cells or e.msgctxt == "messages":
            if lost := changed_in_code(e.msgid, e.msgstr, "code: a comment" in e.comment):
                found.append(f"{'/'.join(lost)} differ: {name}: keep the English's as they are")
        elif lost := lost_markup(e.msgid, e.msgstr):
            found.append(f"{'/'.join(lost)} differ: {name}: keep the English's spans as they are")
    current = {(e.msgctxt, e.msgid) for e in po if not e.obsolete}
    expected = {(e.msgctxt, e.msgid) for e in make_pot(nb)}
    for ctxt, msgid in sorted(expected - current, key=lambda k: index.get(k[0], -1)):
        words = " ".join(msgid.split()[:8])
        found.append(
            f'not in the catalogue: msgctxt "{ctxt}" (cell {index[ctxt]}) "{words} …": '
            "the English is new or changed"
        )
    if current - expected:
        found.append(f"{len(current - expected)} entries' English is gone from the notebook")
    built = json.loads(build_text(english, catalogue))
    for i, (en, zh) in enumerate(zip(nb["cells"], built["cells"], strict=True)):
        if en["cell_type"] == "code" and (why := code_differs(cell_source(en), cell_source(zh))):
            found.append(f"cell {i} ({en['id']}): the Chinese code {why}; fix its entries")
    if not chinese.exists() or chinese.read_text(encoding="utf-8") != dump(built):
        found.append(f"{chinese.name} differs from what the build makes now")
    return found


def code_differs(english: str, chinese: str) -> str:
    """What is wrong with a translated code cell, or "" when it is the English code but for
    prose strings and comments."""
    try:
        ast.parse(chinese)
    except SyntaxError as error:
        return f"is not Python ({error.msg}, line {error.lineno})"
    return "" if masked(chinese) == masked(english) else "differs from the English code"


def check() -> int:
    """Print every problem and what to do; the exit status for `make lint`."""
    found = problems()
    for line in found:
        print(f"{CATALOGUE.relative_to(ROOT)}: {line}")
    if found:
        print(f"{len(found)} translation problems; {FIX}")
    return 1 if found else 0


# --- work packages for translators ------------------------------------------------------


def sections(po: polib.POFile, nb: dict) -> list[tuple[bool, list[polib.POEntry]]]:
    """The catalogue's entries in document order, grouped by section (each heading starts
    one); the flag says whether the group starts a part (a `#` or `##` heading)."""
    levels = {(c["id"], b.msgid): b.heading for _, c, _, b in walk(nb)}
    groups = []
    for e in (e for e in po if not e.obsolete):
        level = levels.get((e.msgctxt, e.msgid), "")
        if not groups or level:
            groups.append((level in ("#", "##") or not groups, []))
        groups[-1][1].append(e)
    return groups


def words(entries) -> int:
    """English words in these entries (whitespace-separated runs)."""
    return sum(len(e.msgid.split()) for e in entries)


def split_chunks(groups, n: int) -> list[list]:
    """Cut the groups into n runs of about equal word count, preferring cuts between parts
    (dynamic programming on the squared distance from the mean, plus a penalty per cut that
    falls inside a part)."""
    sizes = [words(g) for _, g in groups]
    target = sum(sizes) / n
    penalty = (0.15 * target) ** 2
    m = len(groups)
    best = {(0, 0): (0.0, None)}
    for k in range(1, n + 1):
        for j in range(1, m + 1):
            for i in range(k - 1, j):
                if (i, k - 1) not in best:
                    continue
                cost = best[(i, k - 1)][0] + (sum(sizes[i:j]) - target) ** 2
                cost += 0 if i == 0 or groups[i][0] else penalty
                if (j, k) not in best or cost < best[(j, k)][0]:
                    best[(j, k)] = (cost, i)
    cuts, j = [], m
    for k in range(n, 0, -1):
        i = best[(j, k)][1]
        cuts.append((i, j))
        j = i
    return [[e for _, g in groups[i:j] for e in g] for i, j in reversed(cuts)]


def chunks(n: int = 6) -> None:
    """Write locale/zh_CN/chunks/chunk-1.po … chunk-n.po: the catalogue's entries in document
    order, n runs of about equal English word count, msgstr empty."""
    po = polib.pofile(str(CATALOGUE))
    CHUNKS.mkdir(parents=True, exist_ok=True)
    for k, entries in enumerate(split_chunks(sections(po, load(ENGLISH)), n), start=1):
        chunk = polib.POFile(wrapwidth=79)
        chunk.metadata = dict(po.metadata)
        for e in entries:
            copy = polib.POEntry(
                msgctxt=e.msgctxt,
                msgid=e.msgid,
                msgstr="",
                comment=e.comment,
                tcomment=e.tcomment,
                flags=list(e.flags),
                previous_msgid=e.previous_msgid,
                previous_msgctxt=e.previous_msgctxt,
            )
            chunk.append(copy)
        chunk.save(str(CHUNKS / f"chunk-{k}.po"))
        first = entries[0].comment.split("under: ", 1)[1]
        print(f"chunk-{k}.po: {len(entries)} entries, {words(entries)} words, from “{first}”")


def merge_chunks() -> None:
    """Copy every translated, non-fuzzy msgstr of the chunks into the catalogue, matched by
    (msgctxt, msgid); then let msgmerge rewrite the file in gettext's own layout, and build."""
    po = polib.pofile(str(CATALOGUE))
    entries = {(e.msgctxt, e.msgid): e for e in po if not e.obsolete}
    copied = 0
    for path in sorted(CHUNKS.glob("chunk-*.po")):
        for e in polib.pofile(str(path)).translated_entries():
            target = entries.get((e.msgctxt, e.msgid))
            if target is None:
                print(f"{path.name}: no entry for {e.msgctxt} “{e.msgid[:40]}”: skipped")
                continue
            target.msgstr = e.msgstr
            target.flags = [f for f in target.flags if f != "fuzzy"]
            target.previous_msgid = target.previous_msgctxt = None
            copied += 1
    po.save(str(CATALOGUE))  # in polib's layout until update() has msgmerge rewrite it
    print(f"copied {copied} translations into {CATALOGUE.relative_to(ROOT)}")
    update()


def main() -> int:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = ["update", "build", "check", "chunks", "merge-chunks"]
    parser.add_argument("command", choices=commands)
    command = parser.parse_args().command
    if command == "check":
        return check()
    {"update": update, "build": build, "chunks": chunks, "merge-chunks": merge_chunks}[command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())

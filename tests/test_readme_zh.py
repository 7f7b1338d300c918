"""README.zh-CN.md stands alone: every command, `make` target, environment variable and
setting that README.md and its troubleshooting page give, and every message of that page's
tables, appears in the Chinese README as the same code; each message of the Chinese table
is the catalogue's Chinese for the English beside it; and the Chinese README shows the same
records as README.md's results and performance blocks."""

import functools
import re
import sys
from pathlib import Path

import polib
import pytest
from conftest import ROOT

ENGLISH = ROOT / "README.md"
CHINESE = ROOT / "README.zh-CN.md"
# README.md's table of messages lives on this page, which both READMEs link to.
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
# The Chinese renderings of the project's messages: entries of context "messages".
CATALOGUE = ROOT / "locale" / "zh_CN" / "LC_MESSAGES" / "annotated_transformer.po"

# README.md's `##` sections (each with its `###` subsections), every one of them: the
# Chinese README translates them all.
SECTIONS = [
    "Start here",
    "Presets",
    "Layout",
    "Tests",
    "Without internet",
    "Versions",
    "Charts",
    "Training on several GPUs",
    "Performance",
    "When things go wrong",
]
# The header of README.zh-CN.md's table of the notebook's messages: Chinese, then English.
CHINESE_TABLE = "| 中文版笔记本打印的信息 | 英文版笔记本打印的信息 |"
# An inline code span is a command when it starts with one of these programs.
PROGRAMS = (
    "make ", "python ", "python3 ", ".venv/", "pip ", "pytest ", "apt-get ", "sudo ",
    "torchrun ",
)  # fmt: skip
FENCE = re.compile(r"^```[ \t]*(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL = {"bash", "sh", ""}  # the fenced blocks whose lines are commands
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a code span may wrap onto a second line
ENV_VAR = re.compile(r"^([A-Z][A-Z0-9_]*)(=\S*)?$")
SETTING = re.compile(r"^[a-z_]+=\S+$")  # retrain=True, epochs=6
# make's target where a command runs make (`AT_PRESET=smoke make run`), not the package
# that `apt-get install make git` names
MAKE_TARGET = re.compile(r"(?:^|[;&|]\s*)(?:[A-Z][A-Z0-9_]*=\S*\s+)*make ([a-z][\w-]*)")
ASSIGNMENT = re.compile(r"^((?:[A-Z][A-Z0-9_]*=\S*\s+)+)")  # AT_PRESET=gpu torchrun ...
MAKE_VARIABLE = re.compile(r"\s([A-Z][A-Z0-9_]*)=")  # make setup PYTHON=python3.11
# Nothing of a command's own characters may touch a match: `make lab` is not in `make lab-zh`;
# a variable may be followed by its value (`CI` in `CI=true`).
BEFORE, AFTER = r"[\w./=-]", r"[\w./-]"


def squash(text: str) -> str:
    """Whitespace runs as one space, trimmed."""
    return " ".join(text.split())


def sections(markdown: str, headings: list[str]) -> dict[str, str]:
    """The text of each `## heading` section, up to the next `##` heading; a clear failure
    if README.md no longer has one of them (so the test never checks nothing)."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.MULTILINE)
    found = {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}
    missing = [h for h in headings if h not in found]
    assert not missing, (
        f"README.md has no section {missing}: update SECTIONS in {Path(__file__).name} "
        f"to README.md's headings, which are now {list(found)}"
    )
    return {h: found[h] for h in headings}


def fenced_commands(markdown: str) -> list[str]:
    """Each command of the bash/sh/plain fenced blocks: continuation lines joined, comments
    and blank lines dropped, whitespace squashed."""
    commands = []
    for language, block in FENCE.findall(markdown):
        if language not in SHELL:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            command = squash(re.sub(r"(^|\s)#.*$", "", line))
            if command:
                commands.append(command)
    return commands


def spans(markdown: str) -> list[str]:
    """The inline code spans outside fenced blocks, whitespace squashed."""
    return [squash(s) for s in SPAN.findall(FENCE.sub("", markdown))]


def items(markdown: str) -> dict[str, set[str]]:
    """What a reader types or sets, by kind, from a piece of README.md."""
    commands = fenced_commands(markdown)
    inline = spans(markdown)
    commands += [s for s in inline if s.startswith(PROGRAMS)]
    # `NAME` with an underscore (not an acronym such as `BLEU`), or `NAME=value` (`CI=true`)
    variables = {m[1] for s in inline if (m := ENV_VAR.match(s)) and ("_" in m[1] or m[2])}
    for command in commands:
        if prefix := ASSIGNMENT.match(command):
            variables |= {a.split("=")[0] for a in prefix.group(1).split()}
        variables |= set(re.findall(r"\b([A-Z][A-Z0-9]*_[A-Z0-9_]+)=", command))
        if command.startswith("make "):
            variables |= set(MAKE_VARIABLE.findall(command))
    return {
        "command": set(commands),
        "make target": {f"make {t}" for c in commands for t in MAKE_TARGET.findall(c)},
        "environment variable": variables,
        "setting": {s for s in inline if SETTING.match(s)},
    }


def troubleshooting_messages(page: str) -> set[str]:
    """The code spans in the first column of the troubleshooting page's tables."""
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    return {squash(s) for row in rows for s in SPAN.findall(row.split(" | ")[0])}


def chinese_table_rows(markdown: str) -> list[tuple[list[str], list[str]]]:
    """Each row of README.zh-CN.md's table of the notebook's messages: the code spans of
    its Chinese column and of its English column."""
    lines = markdown.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(CHINESE_TABLE)]
    assert len(heads) == 1, f"README.zh-CN.md has {len(heads)} tables headed {CHINESE_TABLE!r}"
    start = heads[0] + 2  # below the header and its |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = line.strip("|").split(" | ")
        rows.append(([squash(s) for s in SPAN.findall(cells[0])],
                     [squash(s) for s in SPAN.findall(cells[1])]))  # fmt: skip
    return rows


WILD = object()  # `...` in a README's message, or a {field} in a catalogue's template


def tokens(text: str, wild: str) -> list:
    """`text` as its characters, with each match of the pattern `wild` as one WILD."""
    out = []
    for i, part in enumerate(re.split(f"({wild})", text)):
        out += [WILD] if i % 2 else list(part)
    return out


def fits(shown: str, template: str) -> bool:
    """Whether `shown`, a message as a README quotes it, is the start of a line that
    `template` prints. In `template`, a {field} stands for any text; in `shown`, a `...`
    stands for one field's text, or, closing the quote, for the rest of the message; the
    other characters must agree. The quote starts where the message starts and may stop
    before it ends, but its last character other than `...` and spaces must be the
    template's own, not a field's (else "anything ..." would fit every template that
    starts with "{path} ")."""
    a, b = tokens(shown, r"\.\.\."), tokens(template, r"\{[^{}]*\}")

    @functools.cache
    def match(i: int, j: int, held: bool) -> bool:
        """a[i:] matches from b[j]; `held`: the last character of a[:i] other than `...`
        and spaces was matched by the template's own, not taken by a field."""
        if i == len(a):  # the quote ends: on the template's own text, or in its last field
            return held or (j < len(b) and all(x is WILD for x in b[j:]))
        if a[i] is WILD and i == len(a) - 1:
            return held  # a closing `...`: the rest of the message
        if j == len(b):
            return False
        if a[i] is WILD:  # `...` is this field's text
            return b[j] is WILD and match(i + 1, j + 1, held)
        if b[j] is WILD:  # the field takes the quote's next character, or ends
            return match(i + 1, j, False) or match(i, j + 1, held)
        return a[i] == b[j] and match(i + 1, j + 1, held or not a[i].isspace())

    return match(0, 0, True)


def code_text(markdown: str) -> str:
    """Everything a reader can copy from a README, one item a line: fenced commands and
    inline code spans."""
    return "\n".join(fenced_commands(markdown) + spans(markdown))


def present(item: str, code: str) -> bool:
    """Whether `item` occurs in `code` as a whole: not inside a longer command or name."""
    return re.search(rf"(?<!{BEFORE}){re.escape(item)}(?!{AFTER})", code) is not None


@pytest.fixture(scope="module")
def english() -> dict[str, str]:
    """README.md's sections, by heading, and its troubleshooting page as one more."""
    found = sections(ENGLISH.read_text(encoding="utf-8"), SECTIONS)
    found[TROUBLESHOOTING.name] = TROUBLESHOOTING.read_text(encoding="utf-8")
    return found


@pytest.fixture(scope="module")
def chinese_code() -> str:
    """What a reader can copy from README.zh-CN.md."""
    return code_text(CHINESE.read_text(encoding="utf-8"))


def test_every_setup_and_run_item_is_in_the_chinese_readme(english, chinese_code):
    """Each command, make target, environment variable and setting of README.md and its
    troubleshooting page is code in README.zh-CN.md too."""
    wanted = set()
    for text in english.values():
        wanted |= {(kind, item) for kind, found in items(text).items() for item in found}
    kinds = {kind for kind, _ in wanted}
    assert len(wanted) >= 30 and len(kinds) == 4, (
        f"found only {len(wanted)} items of {sorted(kinds)} in README.md's sections "
        f"{SECTIONS}: the parsing in {Path(__file__).name} no longer fits README.md"
    )
    missing = sorted(f"{kind}: {item}" for kind, item in wanted if not present(item, chinese_code))
    assert not missing, (
        "README.zh-CN.md lacks what README.md and docs/troubleshooting.md give (as code, in a "
        "fenced block or backticks):\n  " + "\n  ".join(missing)
    )


def test_both_readmes_link_to_the_troubleshooting_page():
    for readme in (ENGLISH, CHINESE):
        assert "](docs/troubleshooting.md)" in readme.read_text(encoding="utf-8"), readme.name


def test_every_troubleshooting_message_is_in_the_chinese_readme(english, chinese_code):
    """The Chinese troubleshooting table quotes the English messages of the troubleshooting
    page verbatim, so a reader of either edition can match the line they see."""
    messages = troubleshooting_messages(english[TROUBLESHOOTING.name])
    assert len(messages) >= 12, f"found only {len(messages)} messages in {TROUBLESHOOTING.name}"
    missing = sorted(m for m in messages if m not in chinese_code.splitlines())
    assert not missing, "README.zh-CN.md's table lacks these messages:\n  " + "\n  ".join(missing)


def test_fits_reads_a_quoted_message_as_the_start_of_a_template():
    template = "{path} is missing: copy {name} into {folder} or unset MULTI30K_DIR"
    assert fits("... is missing", template)
    assert fits("data/val.de.gz is missing: copy ...", template)
    assert fits("precision='bf61': use one of fp32, bf16", "{name}={value!r}: use one of {allowed}")
    assert not fits("... is absent", template)
    assert not fits("missing", template)  # a quote starts where the message starts
    assert not fits("anything at all", template)  # and does not end inside {path}
    assert not fits("anything at all ...", template)
    assert not fits("... copy ...", template)  # `...` inside a quote is one field's text


def test_each_chinese_message_is_the_catalogues_chinese_for_the_english_beside_it():
    """In README.zh-CN.md's table of the notebook's messages, each Chinese message and the
    English beside it quote one entry of the catalogue: the English its msgid, the Chinese
    its msgstr, the very line the Chinese notebook prints (plumbing.say). A reworded message
    or translation fails here until the README follows."""
    entries = [
        (e.msgid, e.msgstr)
        for e in polib.pofile(str(CATALOGUE)).translated_entries()
        if e.msgctxt == "messages"
    ]
    assert len(entries) >= 20, f"found only {len(entries)} messages in {CATALOGUE.name}"
    rows = chinese_table_rows(CHINESE.read_text(encoding="utf-8"))
    assert len(rows) >= 8, f"found only {len(rows)} rows under {CHINESE_TABLE!r}"
    wrong = []
    for chinese, english in rows:
        if len(chinese) != len(english) or not chinese:
            wrong.append(f"{chinese} beside {english}: one Chinese message for each English")
            continue
        for zh, en in zip(chinese, english, strict=True):
            if not any(fits(en, msgid) and fits(zh, msgstr) for msgid, msgstr in entries):
                wrong.append(f"{zh!r} beside {en!r}")
    assert not wrong, (
        f"these messages are not the Chinese and the English of one entry of "
        f"{CATALOGUE.relative_to(ROOT)} (msgstr, msgid):\n  " + "\n  ".join(wrong)
    )


def records():
    """tools/records.py, which picks the records that README.md's generated blocks show."""
    sys.path.insert(0, str(ROOT / "tools"))
    import records

    return records


def not_in_chinese(shown: list[str]) -> list[str]:
    """The items of `shown` that README.zh-CN.md lacks."""
    chinese = CHINESE.read_text(encoding="utf-8")
    return [item for item in shown if item not in chinese]


def test_the_chinese_results_table_shows_the_same_record():
    """README.zh-CN.md shows the record that README.md's generated table shows (the newest
    `make run` of the cpu preset, as tools/records.py picks it): its link, BLEU and
    training minutes. When a new record replaces it, this fails until the Chinese follows."""
    run = records().newest_run(records().load_records(), "cpu")
    assert run is not None, "results/ has no make run record of the cpu preset"
    missing = not_in_chinese([
        f"](results/{run['file']})",
        f"{run['test2016_bleu_greedy']:.1f}",
        f"{run['test2016_bleu_beam']:.1f}",
        f"{run['train_seconds'] / 60:.1f}",
    ])  # fmt: skip
    assert not missing, f"README.zh-CN.md's results table lacks {missing} of {run['file']}"


def test_the_chinese_performance_section_shows_the_newest_benchmark():
    """README.zh-CN.md's Performance gives the figures of README.md's generated block (the
    newest benchmark, as tools/records.py picks it): its commit, the model's size, the step
    against torch.nn.Transformer, the pipeline's speed-up and the share of real tokens."""
    benches = [r for r in records().load_records() if r["kind"] == "bench"]
    assert benches, "results/ has no benchmark record"
    r = sorted(benches, key=lambda r: r["machine"].get("utc", ""))[-1]  # as records.py picks
    b = r["bench"]
    missing = not_in_chinese([
        f"`{r['commit']}`",
        f"{b['model_vs_pytorch']['ours_parameters']:,}",
        f"{b['model_vs_pytorch']['ratio']:.2f} 倍",
        f"{b['pipeline']['speedup']:.1f} 倍",
        f"{b['padding']['ours']:.0%}",
        f"{b['padding']['reference']:.0%}",
    ])  # fmt: skip
    assert not missing, f"README.zh-CN.md's Performance lacks {missing} of {r['file']}"

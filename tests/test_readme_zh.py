"""README.zh-CN.md stands alone: every command, `make` target, environment variable and
setting that README.md's set-up and run sections give, and every message of its
troubleshooting table, appears in the Chinese README as the same code, and the Chinese
README shows the same record as README.md's results table."""

import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT

ENGLISH = ROOT / "README.md"
CHINESE = ROOT / "README.zh-CN.md"

# README.md's `##` sections where a reader sets up and runs the project (each with its
# `###` subsections). The others (Layout, Versions, Charts, Performance) describe it.
SETUP_AND_RUN = [
    "Start here",
    "Presets",
    "Tests",
    "Without internet",
    "Training on several GPUs",
    "When things go wrong",
]
TROUBLESHOOTING = "When things go wrong"
# An inline code span is a command when it starts with one of these programs.
PROGRAMS = ("make ", "python ", ".venv/", "pip ", "pytest ", "apt-get ", "torchrun ")
FENCE = re.compile(r"^```[ \t]*(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL = {"bash", "sh", ""}  # the fenced blocks whose lines are commands
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # a code span may wrap onto a second line
ENV_VAR = re.compile(r"^([A-Z][A-Z0-9_]*)(=\S*)?$")
SETTING = re.compile(r"^[a-z_]+=\S+$")  # retrain=True, epochs=6
MAKE_TARGET = re.compile(r"\bmake ([a-z][\w-]*)")
ASSIGNMENT = re.compile(r"^((?:[A-Z][A-Z0-9_]*=\S*\s+)+)")  # AT_PRESET=gpu torchrun ...
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
        f"README.md has no section {missing}: update SETUP_AND_RUN in {Path(__file__).name} "
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
    return {
        "command": set(commands),
        "make target": {f"make {t}" for c in commands for t in MAKE_TARGET.findall(c)},
        "environment variable": variables,
        "setting": {s for s in inline if SETTING.match(s)},
    }


def troubleshooting_messages(section: str) -> set[str]:
    """The code spans in the first column of the troubleshooting table."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {squash(s) for row in rows for s in SPAN.findall(row.split(" | ")[0])}


def code_text(markdown: str) -> str:
    """Everything a reader can copy from a README, one item a line: fenced commands and
    inline code spans."""
    return "\n".join(fenced_commands(markdown) + spans(markdown))


def present(item: str, code: str) -> bool:
    """Whether `item` occurs in `code` as a whole: not inside a longer command or name."""
    return re.search(rf"(?<!{BEFORE}){re.escape(item)}(?!{AFTER})", code) is not None


@pytest.fixture(scope="module")
def english() -> dict[str, str]:
    """README.md's set-up and run sections, by heading."""
    return sections(ENGLISH.read_text(encoding="utf-8"), SETUP_AND_RUN)


@pytest.fixture(scope="module")
def chinese_code() -> str:
    """What a reader can copy from README.zh-CN.md."""
    return code_text(CHINESE.read_text(encoding="utf-8"))


def test_every_setup_and_run_item_is_in_the_chinese_readme(english, chinese_code):
    """Each command, make target, environment variable and setting of README.md's set-up
    and run sections is code in README.zh-CN.md too."""
    wanted = set()
    for text in english.values():
        wanted |= {(kind, item) for kind, found in items(text).items() for item in found}
    kinds = {kind for kind, _ in wanted}
    assert len(wanted) >= 30 and len(kinds) == 4, (
        f"found only {len(wanted)} items of {sorted(kinds)} in README.md's sections "
        f"{SETUP_AND_RUN}: the parsing in {Path(__file__).name} no longer fits README.md"
    )
    missing = sorted(f"{kind}: {item}" for kind, item in wanted if not present(item, chinese_code))
    assert not missing, (
        "README.zh-CN.md lacks what README.md's set-up and run sections give (as code, in a "
        "fenced block or backticks):\n  " + "\n  ".join(missing)
    )


def test_every_troubleshooting_message_is_in_the_chinese_readme(english, chinese_code):
    """The Chinese troubleshooting table quotes README.md's English messages verbatim, so a
    reader can match the line they see."""
    messages = troubleshooting_messages(english[TROUBLESHOOTING])
    assert len(messages) >= 10, f"found only {len(messages)} messages in {TROUBLESHOOTING!r}"
    missing = sorted(m for m in messages if m not in chinese_code.splitlines())
    assert not missing, "README.zh-CN.md's table lacks these messages:\n  " + "\n  ".join(missing)


def test_the_chinese_results_table_shows_the_same_record():
    """README.zh-CN.md shows the record that README.md's generated table shows (the newest
    `make run` of the cpu preset, as tools/records.py picks it): its link, BLEU and
    training minutes. When a new record replaces it, this fails until the Chinese follows."""
    sys.path.insert(0, str(ROOT / "tools"))
    import records

    run = records.newest_run(records.load_records(), "cpu")
    assert run is not None, "results/ has no make run record of the cpu preset"
    chinese = CHINESE.read_text(encoding="utf-8")
    shown = [
        f"](results/{run['file']})",
        f"{run['test2016_bleu_greedy']:.1f}",
        f"{run['test2016_bleu_beam']:.1f}",
        f"{run['train_seconds'] / 60:.1f}",
    ]
    missing = [item for item in shown if item not in chinese]
    assert not missing, f"README.zh-CN.md's results table lacks {missing} of {run['file']}"

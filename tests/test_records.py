"""Published numbers come from records: the README's generated tables match results/."""

import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import records  # noqa: E402


def test_every_record_says_what_made_it():
    found = records.load_records()
    assert {r["kind"] for r in found} >= {"make run", "tuning"}
    for record in found:
        for field in ("kind", "preset", "machine", "commit", "command", "source"):
            assert record.get(field), f"{record['file']} lacks {field!r}"
        assert record["machine"].get("cpu") and "cores" in record["machine"]


def test_the_readme_agrees_with_the_records():
    readme = records.README.read_text(encoding="utf-8")
    assert records.render(readme, records.load_records()) == readme, (
        "README.md disagrees with results/: run .venv/bin/python tools/records.py"
    )


def test_a_number_edited_by_hand_in_the_readme_is_caught(tmp_path, monkeypatch):
    readme = records.README.read_text(encoding="utf-8")
    assert "| 37.1 |" in readme  # the reference run's beam BLEU, inside a generated table
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("| 37.1 |", "| 39.1 |", 1), encoding="utf-8")
    monkeypatch.setattr(records, "README", edited)
    with pytest.raises(SystemExit, match="disagrees with results/"):
        records.main(["--check"])
    records.main([])  # regenerating restores the record's number
    assert edited.read_text(encoding="utf-8") == readme


def test_a_new_record_changes_the_table(tmp_path):
    """A new measurement updates its record, and the table follows it."""
    for path in records.RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    run = tmp_path / "make-run-cpu-xeon.json"
    changed = {**json.loads(run.read_text(encoding="utf-8")), "test2016_bleu_beam": 40.2}
    run.write_text(json.dumps(changed), encoding="utf-8")
    table = records.results_table(records.load_records(tmp_path))
    assert "| 40.2 |" in table and "| 37.1 |" not in table


def test_a_readme_without_a_marked_block_is_refused():
    with pytest.raises(SystemExit, match="no <!-- records:results --> block"):
        records.render("# a README with no tables\n", records.load_records())


def test_a_replanned_run_is_summarised_with_its_replans():
    (reference,) = [
        r for r in records.load_records() if r["file"] == "make-run-cpu-epyc-narrow.json"
    ]
    plan = reference["plan"] | {"epochs": 9, "steps": 2817}
    plan["replans"] = [{"after_epoch": 1, "epoch_seconds": 97.4, "was": 8, "epochs": 9}]
    text = records.summary_of(reference | {"plan": plan})
    assert "fitted 8 epochs into 16 minutes; after epoch 1 (epochs of 97 s) it re-planned 9" in text
    assert "(2,817 steps, 200 of them warming up)" in text

"""Published numbers come from records: results/README.md and README.md match results/."""

import json
import re
import shutil
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import records  # noqa: E402

# The headings that the notebook links to (results/README.md#...).
HEADINGS = (
    "## make run records",
    "## Tuning on a 2-core Xeon (first preset)",
    "## Tuning on a 2-core AMD EPYC",
    "## Benchmarks",
    "## Today's block beside the paper's",
)


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """The records, README.md and results/README.md copied to tmp_path, and records.py
    pointed at the copies."""
    results = tmp_path / "results"
    shutil.copytree(records.RESULTS, results)
    shutil.copy(records.README, tmp_path / "README.md")
    monkeypatch.setattr(records, "ROOT", tmp_path)
    monkeypatch.setattr(records, "RESULTS", results)
    monkeypatch.setattr(records, "DOCUMENT", results / "README.md")
    monkeypatch.setattr(records, "README", tmp_path / "README.md")
    return tmp_path


def test_every_record_says_what_made_it():
    found = records.load_records()
    assert {r["kind"] for r in found} >= {"make run", "tuning", "bench"}
    for record in found:
        for field in ("kind", "preset", "machine", "commit", "command", "source"):
            assert record.get(field), f"{record['file']} lacks {field!r}"
        assert record["machine"].get("cpu") and "cores" in record["machine"]


def test_the_records_document_is_generated_from_the_records():
    text = records.DOCUMENT.read_text(encoding="utf-8")
    assert text == records.document(records.load_records()), (
        "results/README.md disagrees with results/*.json: run .venv/bin/python tools/records.py"
    )


def test_the_readme_agrees_with_the_records():
    readme = records.README.read_text(encoding="utf-8")
    assert records.render(readme, records.load_records()) == readme, (
        "README.md disagrees with results/*.json: run .venv/bin/python tools/records.py"
    )


def test_the_check_passes_on_the_committed_files(capsys):
    records.main(["--check"])
    assert "agree" in capsys.readouterr().out


def test_the_readme_is_short_and_links_to_the_records():
    readme = records.README.read_bytes()
    assert len(readme) <= 10_000, f"README.md has {len(readme):,} bytes, over 10,000"
    assert b"(results/README.md)" in readme


def test_the_document_has_the_headings_the_notebook_links_to():
    lines = records.DOCUMENT.read_text(encoding="utf-8").splitlines()
    for heading in HEADINGS:
        assert lines.count(heading) == 1, heading


def test_every_run_on_record_is_in_the_document():
    text = records.DOCUMENT.read_text(encoding="utf-8")
    for record in records.load_records():
        assert f"]({record['file']})" in text, record["file"]
        for run in record.get("runs", []):
            assert f"| {run['run']} |" in text, (record["file"], run["run"])
    assert "R4" in text  # the bf16 run lives in its own part of the Xeon record


def test_a_number_edited_by_hand_in_the_readme_is_caught(copies):
    readme = (copies / "README.md").read_text(encoding="utf-8")
    newest = records.newest_run(records.load_records(), "cpu")
    beam = f"| {newest['test2016_bleu_beam']:.1f} |"
    assert readme.count(beam) == 1  # the newest run's beam BLEU, inside the generated block
    (copies / "README.md").write_text(readme.replace(beam, "| 99.9 |"), encoding="utf-8")
    with pytest.raises(SystemExit, match="^records: README.md disagrees with results"):
        records.main(["--check"])
    records.main([])  # regenerating restores the record's number
    assert (copies / "README.md").read_text(encoding="utf-8") == readme


def test_a_number_edited_by_hand_in_the_document_is_caught(copies):
    document = copies / "results" / "README.md"
    text = document.read_text(encoding="utf-8")
    assert "| 38.31 |" in text  # E16's beam BLEU, a tuning figure
    document.write_text(text.replace("| 38.31 |", "| 39.31 |", 1), encoding="utf-8")
    with pytest.raises(SystemExit, match="^records: results/README.md disagrees with results"):
        records.main(["--check"])
    records.main([])
    assert document.read_text(encoding="utf-8") == text


def test_a_missing_document_is_caught_and_written(copies):
    document = copies / "results" / "README.md"
    text = document.read_text(encoding="utf-8")
    document.unlink()
    with pytest.raises(SystemExit, match="results/README.md disagrees"):
        records.main(["--check"])
    records.main([])
    assert document.read_text(encoding="utf-8") == text


def test_a_new_record_changes_the_tables(copies):
    """A new `make run` becomes the README's row and the first, marked row of the document."""
    results = copies / "results"
    base = json.loads((results / "make-run-cpu-epyc-replan.json").read_text("utf-8"))
    newer = base | {
        "commit": "fedcba9",
        "wall_seconds": 1400,
        "test2016_bleu_greedy": 38.4,
        "test2016_bleu_beam": 40.2,
        "plan": base["plan"] | {"made": "2099-01-01 00:00"},
    }
    (results / "make-run-cpu-new.json").write_text(json.dumps(newer), encoding="utf-8")
    found = records.load_records()
    row = records.results_table(found)
    assert "| 23 min 20 s, of which" in row and "| 38.4 | 40.2 |" in row
    assert "(results/make-run-cpu-new.json)" in row and "dca2870" not in row
    document = records.document(found)
    marked = [
        line for line in document.splitlines() if line.startswith("| ") and "(newest)" in line
    ]
    assert len(marked) == 1 and marked[0].startswith("| **`fedcba9`** (newest) |")
    runs = document.split("## make run records")[1].split("###")[0]
    assert runs.index("`fedcba9`") < runs.index("`dca2870`")  # newest first


def test_a_changed_tuning_figure_changes_its_table(copies):
    results = copies / "results"
    tuning = json.loads((results / "tuning-cpu-epyc.json").read_text("utf-8"))
    (e16,) = [run for run in tuning["runs"] if run["run"] == "E16"]
    e16["val_bleu_beam_last_epoch"] = 40.55
    e16["tokens_per_second_per_epoch"] = [1000, 3000]
    (results / "tuning-cpu-epyc.json").write_text(json.dumps(tuning), encoding="utf-8")
    document = records.document(records.load_records())
    row = next(line for line in document.splitlines() if line.startswith("| E16 |"))  # the table
    assert "| 40.55 |" in row and "| 2,000 |" in row and "38.31" not in row


def test_make_runs_are_ordered_by_when_they_were_planned():
    runs = [
        {"kind": "make run", "preset": "cpu", "file": "b.json", "plan": {"made": "2026-01-02"}},
        {"kind": "make run", "preset": "cpu", "file": "a.json"},  # no plan: the oldest
        {"kind": "make run", "preset": "cpu", "file": "c.json", "plan": {"made": "2026-01-03"}},
        {"kind": "tuning", "preset": "cpu", "file": "d.json"},
    ]
    assert [r["file"] for r in records.make_runs(runs)] == ["c.json", "b.json", "a.json"]


def test_the_readme_quotes_the_newest_run_on_all_its_cores():
    """A run with OMP_NUM_THREADS=1 stands in for a slower CPU; the README skips it."""
    runs = [
        {"kind": "make run", "preset": "cpu", "file": "a.json", "command": "make run"}
        | {"plan": {"made": "2026-01-01"}},
        {"kind": "make run", "preset": "cpu", "file": "b.json"}
        | {"command": "OMP_NUM_THREADS=1 make run", "plan": {"made": "2026-01-02"}},
    ]
    assert records.newest_run(runs, "cpu")["file"] == "a.json"
    assert records.newest_run(runs, "gpu") is None


def test_the_gpu_row_says_it_is_not_measured_until_a_gpu_record_exists():
    found = [r for r in records.load_records() if r["preset"] != "gpu"]
    row = records.results_table(found).splitlines()[-1]
    assert row.startswith("| `gpu` on a GPU | not yet measured")
    cpu = records.newest_run(found, "cpu")
    machine = cpu["machine"] | {"short": "H100"}
    gpu = cpu | {"preset": "gpu", "file": "make-run-gpu.json", "machine": machine}
    row = records.results_table([*found, gpu]).splitlines()[-1]
    assert row.startswith("| `gpu` on a H100 |") and "(results/make-run-gpu.json)" in row


def test_the_readme_quotes_the_newest_benchmark_and_the_model_it_measured():
    benches = [r for r in records.load_records() if r["kind"] == "bench"]
    bench = max(benches, key=lambda r: r["machine"]["utc"])
    parameters = f"{bench['bench']['model_vs_pytorch']['ours_parameters']:,}"
    readme = records.README.read_text(encoding="utf-8")
    block = readme.split("<!-- records:performance -->")[1].split("<!-- /records:performance")[0]
    assert f"a model of {parameters} parameters" in block and f"`{bench['commit']}`" in block
    older = [r for r in benches if r is not bench]
    assert all(f"`{r['commit']}`" not in block for r in older)  # one paragraph, the newest


def test_settings_changed_names_only_the_differences():
    reference = {"settings": {"N": 4, "d_model": 128, "pre_norm": True, "lr_factor": 0.35355}}
    older = {"settings": {"N": 3, "d_model": 128, "lr_factor": 0.5, "batch_tokens": 2500}}
    assert records.settings_changed(older, reference) == (
        "`N=3`, `pre_norm` —, `lr_factor=0.5`, `batch_tokens=2500`"
    )
    assert records.settings_changed(reference, reference) == "none"
    assert records.settings_changed({}, reference) == "not recorded"


def test_tags_in_a_records_words_are_set_as_code():
    assert records.prose("decoded with <unk> allowed, </s> kept") == (
        "decoded with `<unk>` allowed, `</s>` kept"
    )
    assert records.prose("already `<unk>`") == "already `<unk>`"


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
    assert records.planned(reference | {"plan": plan}) == "8 → 9"


def test_a_records_words_end_with_one_full_stop():
    assert records.sentence("no other job shared the cores.") == "no other job shared the cores."
    assert records.sentence("copied by hand") == "copied by hand."
    text = records.DOCUMENT.read_text(encoding="utf-8")
    assert not re.search(r"[^.]\.\.(\s|$)", text)  # no sentence ends twice (paths aside)


def test_a_benchmark_that_skipped_decoding_says_so():
    """Its decoding figures are null: the document says why, and whose times the decoding
    table holds, so that no one reads them as the benchmark's."""
    benches = [r for r in records.load_records() if r["kind"] == "bench"]
    skipped = [r for r in benches if (r["bench"].get("decoding") or {}).get("skipped")]
    assert skipped, "the committed benchmarks skipped decoding"
    text = records.bench_section(skipped)
    assert text.count("It measured no decoding (no trained model in ") == len(skipped)
    assert "the decoding times below come from the `make run` records" in text
    decoded = skipped[0] | {"bench": skipped[0]["bench"] | {"decoding": {"sentences": 1000}}}
    assert "It measured no decoding" not in records.bench_section([decoded])


def test_the_blocks_sentences_hold_against_their_record():
    """Appendix D's comparison of the two blocks (its numbers, rounded as it
    prints them) against results/blocks-cpu-epyc-zen4.json, where its charts used to be."""
    (blocks,) = [r for r in records.load_records() if r["file"] == "blocks-cpu-epyc-zen4.json"]
    runs = {(r["block"], r["seed"]): r for r in blocks["runs"]}
    seeds = sorted({seed for _, seed in runs})

    def gaps(key: str, epoch: int) -> list[float]:  # the paper's minus today's, seed by seed
        return [runs["2017", s][key][epoch] - runs["modern", s][key][epoch] for s in seeds]

    epochs = len(runs["2017", seeds[0]]["val_loss_per_epoch"])
    assert all(min(gaps("val_loss_per_epoch", e)) > 0 for e in range(epochs))  # every epoch
    assert [round(g, 2) for g in sorted(gaps("val_loss_per_epoch", 2))] == [0.11, 0.13]
    assert [round(g, 2) for g in gaps("val_loss_per_epoch", -1)] == [0.05, 0.05]
    assert sorted(round(-g) for g in gaps("val_bleu_greedy_per_epoch", 2)) == [3, 5]

    def mean(block: str, key: str) -> float:
        return round(sum(runs[block, s][key] for s in seeds) / len(seeds), 1)

    assert [mean("modern", "test2016_bleu_greedy"), mean("modern", "test2016_bleu_beam")] == [
        38.7, 39.9]  # fmt: skip
    assert [mean("2017", "test2016_bleu_greedy"), mean("2017", "test2016_bleu_beam")] == [
        38.4,
        39.4,
    ]
    assert blocks["speed"]["relative"]["modern"] == 1.07  # "7% longer"
    notebook = (ROOT / "annotated_transformer.py").read_text(encoding="utf-8")
    prose = " ".join(notebook.replace("# ", " ").split())
    claims = [
        "by 0.11 and 0.13 after three epochs (seeds 43 and 42)",
        "by 3 and 5 points",
        "0.05 at the end",
        "38.7 greedy and 39.9 beam, against the paper's block's 38.4 and 39.4 here",
        "take 7% longer",
    ]
    assert [claim for claim in claims if claim not in prose] == []

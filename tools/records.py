"""Write the README's tables of past runs from the committed records in results/.

    .venv/bin/python tools/records.py          # rewrite the tables in README.md
    .venv/bin/python tools/records.py --check  # exit 1 if README.md disagrees

Every number that a run produced and the README quotes lives in a JSON record under
results/, with the machine, the commit and the command that made it. The README holds
each generated table between two markers, `<!-- records:NAME -->` and
`<!-- /records:NAME -->`; what lies between them is this script's output, never typed by
hand. tests/test_records.py runs the check.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plumbing import write_atomically  # noqa: E402

RESULTS = ROOT / "results"
README = ROOT / "README.md"


def load_records(folder: Path = RESULTS) -> list[dict]:
    """Every record, sorted by file name; each keeps its file name under "file"."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        records.append({**record, "file": path.name})
    return records


def minutes(seconds: float) -> str:
    """1122 -> '18 min 42 s'."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s"


def results_table(records: list[dict]) -> str:
    """The README's Results table: one row per `make run` record, and a gpu row."""
    head = (
        "| preset | hardware | `make run` wall time | training | train target tokens/s "
        "| peak memory | val BLEU greedy | BLEU greedy | BLEU beam 4 | commit | command |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    runs = [r for r in records if r["kind"] == "make run"]
    for r in runs:
        training = f"{r['epochs']} epochs, {r['train_seconds']:,} s, {r['precision']}"
        rows.append(
            f"| `{r['preset']}` | {r['machine']['short']} | {minutes(r['wall_seconds'])} "
            f"| {training} | {r['train_tokens_per_second']:,} | {r['peak_memory_gb']:.2f} GB "
            f"| {r['val_bleu_greedy_averaged'] or r['val_bleu_greedy_last_epoch']:.1f} "
            f"| {r['test2016_bleu_greedy']:.1f} "
            f"| {r['test2016_bleu_beam']:.1f} | `{r['commit']}` | `{r['command']}` |"
        )
    if not any(r["preset"] == "gpu" for r in runs):
        rows.append(
            "| `gpu` | — | not run yet: no GPU was lent to this project so far "
            "| | | | | | | | `AT_PRESET=gpu make run` |"
        )
    return "\n".join([head, *rows])


def run_summary(records: list[dict]) -> str:
    """The sentences under the Results table: a paragraph per `cpu` run, newest last."""
    runs = [r for r in records if r["kind"] == "make run" and r["preset"] == "cpu"]
    return "\n\n".join(summary_of(r) for r in runs)


def summary_of(r: dict) -> str:
    """One run's paragraph: time, plan, precision, decoding, the model scored, memory."""
    calibration, plan = r.get("calibration_seconds"), r.get("plan")
    text = (
        f"Measured on a fresh clone of commit `{r['commit']}` ({r['file']}, "
        f"{r['machine']['short']}): `make run` took {minutes(r['wall_seconds'])}, of which "
        f"{r['train_seconds'] / 60:.1f} minutes are training ({r['epochs']} epochs in "
        f"{r['precision']}"
    )
    if calibration:
        text += (
            f", chosen by the calibration: one batch took {calibration['fp32']:.2f} s in "
            f"float32 and {calibration['bf16']:.2f} s in bf16"
        )
    text += "). "
    if plan and plan.get("replans"):  # re-planned after epochs (from session 13 on)
        first, changes = plan["replans"][0]["was"], plan["replans"]
        text += (
            f"The plan measured {plan['tokens_per_second']:,.0f} target tokens/s and fitted "
            f"{first} epochs into {plan['train_minutes']:g} minutes; "
            + ", then ".join(
                f"after epoch {c['after_epoch']} (epochs of {c['epoch_seconds']:.0f} s) it "
                f"re-planned {c['epochs']}"
                for c in changes
            )
            + f" ({plan['steps']:,} steps, {plan['warmup']:,} of them warming up); training "
            f"ran at {r['train_tokens_per_second']:,} target tokens/s. "
        )
    elif plan:
        text += (
            f"The plan measured {plan['tokens_per_second']:,.0f} target tokens/s and fitted "
            f"{plan['epochs']} epochs ({plan['steps']:,} steps) into {plan['train_minutes']:g} "
            f"minutes"
        )
        if "warmup" in plan:  # the warm-up the plan left (fit_warmup), from session 7 on
            text += f", {plan['warmup']:,} of them warming up"
        text += f"; training then ran at {r['train_tokens_per_second']:,} target tokens/s. "
    text += (
        f"Decoding the test set took {r['greedy_test2016_seconds']:.1f} s greedily "
        f"and {r['beam4_test2016_seconds']:.1f} s with beam {r['beam_size']} "
        f"(α = {r['length_penalty']}). "
    )
    if r.get("averaged_epochs"):
        first, last = r["averaged_epochs"][0], r["averaged_epochs"][-1]
        text += (
            f"The model is the average of epochs {first} to {last}: validation BLEU "
            f"{r['val_bleu_greedy_averaged']:.1f} greedy, against "
            f"{r['val_bleu_greedy_last_epoch']:.1f} for the last epoch alone. "
        )
    else:
        text += (
            f"The model is the last epoch's: validation BLEU "
            f"{r['val_bleu_greedy_last_epoch']:.1f} greedy. "
        )
    return text + (
        f"Peak memory {r['peak_memory_gb']:.2f} GB. sacreBLEU signature: "
        f"`{r['bleu_signature']}`. One run; BLEU varies by about ±2 between machines."
    )


def performance_table(records: list[dict]) -> str:
    """The README's Performance table: the `make bench` records, and decoding from the
    reference `make run` (the benchmark decodes only when a trained model exists)."""
    lines = []
    for r in [r for r in records if r["kind"] == "bench"]:
        b, m = r["bench"], r["machine"]
        duel, use = b["model_vs_pytorch"], b["utilisation"]
        ours, ref = b["pipeline"]["ours"], b["pipeline"]["reference"]
        lines += [
            f"`{r['preset']}` preset on a {m['short']}, torch {m['torch']}, "
            f"commit `{r['commit']}`, {b['precision']} (the calibration's choice: "
            f"{b['precision_calibration']}); `{r['command']}`, {r['wall_seconds']:.0f} s "
            f"({r['file']}). {r.get('caveat', '')}".rstrip(),
            "",
            "| figure | ours | the other | ratio | goal |",
            "|---|---|---|---|---|",
            f"| training step, same size, same {duel['batches']} batches "
            f"| {duel['ours_step_seconds']:.3f} s "
            f"| {duel['pytorch_step_seconds']:.3f} s (`torch.nn.Transformer`) "
            f"| {duel['ratio']:.2f} | ≤ 1.10 {'✓' if duel['ratio'] <= 1.10 else '✗'} |",
            f"| model FLOPs per second in training, against one large `torch.mm` (MFU) "
            f"| {use['model_flops_per_second'] / 1e9:.1f} G, {use['mfu']:.0%} "
            f"| {use['matmul_flops_per_second'] / 1e9:.1f} G (`torch.mm`, "
            f"{use['matmul']['size']}²) | | |",
            f"| training, target tokens/s, same {ours['sentences']:,} sentences "
            f"({ours['real_target_tokens']:,} target tokens) "
            f"| {ours['tokens_per_second']:,.0f} "
            f"| {ref['tokens_per_second']:,.0f} (the well-known notebook's loop) "
            f"| {b['pipeline']['speedup']:.1f}× | ≥ 30× on a GPU (not measured) |",
            f"| real tokens in training batches | {b['padding']['ours']:.1%} "
            f"| {b['padding']['reference']:.1%} (every sentence padded to "
            f"{ref['max_padding']}) | | |",
            f"| peak resident memory of the benchmark | {b['peak_memory_mb'] / 1000:.2f} GB "
            "| | | |",
        ]
    for r in [r for r in records if r["kind"] == "make run"]:
        lines += [
            "",
            f"Decoding the 1,000 test2016 sentences, from the reference `make run` on the "
            f"{r['machine']['short']} (commit `{r['commit']}`, {r['file']}): greedy "
            f"{r['greedy_test2016_seconds']:.1f} s, beam {r['beam_size']} "
            f"{r['beam4_test2016_seconds']:.1f} s.",
        ]
    return "\n".join(lines)


TABLES = {
    "results": results_table,
    "run-summary": run_summary,
    "performance": performance_table,
}


def render(readme: str, records: list[dict]) -> str:
    """README text with every marked block replaced by its table from the records."""
    for name, make in TABLES.items():
        pattern = re.compile(
            rf"(<!-- records:{name} -->\n).*?(\n<!-- /records:{name} -->)", flags=re.DOTALL
        )
        if not pattern.search(readme):
            raise SystemExit(f"records: README.md has no <!-- records:{name} --> block")
        table = make(records)
        readme = pattern.sub(lambda m, t=table: m.group(1) + t + m.group(2), readme)
    return readme


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md disagrees")
    args = parser.parse_args(argv)
    current = README.read_text(encoding="utf-8")
    expected = render(current, load_records())
    if args.check:
        if current != expected:
            sys.exit(
                "records: README.md disagrees with results/: run "
                "`.venv/bin/python tools/records.py` (never edit a generated table by hand)"
            )
        print("records: README.md agrees with results/")
    elif current != expected:
        write_atomically(README, expected.encode("utf-8"))
        print("records: README.md rewritten from results/")


if __name__ == "__main__":
    main()

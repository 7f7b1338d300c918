"""Write the records document and the README's results from the committed records.

    .venv/bin/python tools/records.py          # rewrite results/README.md and README.md's blocks
    .venv/bin/python tools/records.py --check  # exit 1 if either disagrees with the records

Every number that a run produced lives in a JSON record under results/, with the machine,
the commit and the command that made it. results/README.md is this script's output, whole:
every table of past runs (`make run`, tuning, benchmark). README.md holds two generated
blocks between markers, `<!-- records:NAME -->` and `<!-- /records:NAME -->`: what `make
run` gives, and what the benchmark measured. Neither is ever typed by hand;
tests/test_records.py runs the check.
"""

import argparse
import json
import re
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plumbing import write_atomically  # noqa: E402

RESULTS = ROOT / "results"
DOCUMENT = RESULTS / "README.md"
README = ROOT / "README.md"
REGENERATE = "`.venv/bin/python tools/records.py`"


def load_records(folder: Path | None = None) -> list[dict]:
    """Every record in `folder` (results/ by default), sorted by file name; each keeps its
    file name under "file"."""
    records = []
    for path in sorted(Path(folder or RESULTS).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        records.append({**record, "file": path.name})
    return records


# Formatting -----------------------------------------------------------------------------


def minutes(seconds: float) -> str:
    """1122 -> '18 min 42 s'."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s"


def num(value, digits: int = 1) -> str:
    """A figure for a table: blank when the record has none, else with `digits` decimals."""
    return "" if value is None else f"{value:,.{digits}f}"


def span(values) -> str:
    """One figure, or a list of them as 'low to high'."""
    if isinstance(values, list):
        return f"{min(values):,} to {max(values):,}"
    return f"{values:,}"


def setting(name: str, value) -> str:
    """`name=value`, with booleans as in JSON and whole floats without '.0'."""
    if isinstance(value, bool):
        value = json.dumps(value)
    elif isinstance(value, float):
        value = f"{value:g}"
    return f"`{name}={value}`"


def link(record: dict) -> str:
    """A Markdown link to the record, from results/README.md."""
    return f"[{record['file']}]({record['file']})"


def table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a '|' inside a cell is escaped."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def prose(text: str) -> str:
    """A record's words for Markdown: tags such as <unk> or </s> set as code, not HTML."""
    return re.sub(r"(?<!`)(</?\w+>)(?!`)", r"`\1`", text)


def sentence(text: str) -> str:
    """A record's words as prose that ends with one full stop, however the record ends."""
    return prose(text).rstrip().rstrip(".") + "."


# Which run is which ---------------------------------------------------------------------


def made(record: dict) -> str:
    """When the run was made ('2026-11-25 05:55'): its own "made", else when its plan was
    made; '' when the record has neither, which sorts it before every run that has one
    (the oldest records predate plans; runs of a fixed number of epochs have no plan)."""
    return record.get("made") or (record.get("plan") or {}).get("made", "")


def make_runs(records: list[dict], preset: str | None = None) -> list[dict]:
    """The `make run` records (of one preset if given), newest first."""
    runs = [r for r in records if r["kind"] == "make run" and preset in (None, r["preset"])]
    return sorted(runs, key=lambda r: (made(r), r["file"]), reverse=True)


def newest_run(records: list[dict], preset: str) -> dict | None:
    """The newest `make run` of a preset as committed, on every core: no OMP_NUM_THREADS in
    its command (those runs stand in for a slower CPU) and no edit of presets.py (a second
    seed). README.md shows this one."""
    runs = [
        r
        for r in make_runs(records, preset)
        if "OMP_NUM_THREADS" not in r["command"] and "presets.py" not in r["command"]
    ]
    return runs[0] if runs else None


def settings_changed(record: dict, reference: dict) -> str:
    """The settings in which a run differs from the reference run; '—' for a setting that
    the record does not have."""
    if "settings" not in record:
        return "not recorded"
    ours, theirs = record["settings"], reference.get("settings", {})
    names = list(theirs) + [name for name in ours if name not in theirs]
    changed = [
        f"`{name}` —" if name not in ours else setting(name, ours[name])
        for name in names
        if name not in ours or ours[name] != theirs.get(name)
    ]
    return ", ".join(changed) or "none"


def planned(record: dict) -> str:
    """The epochs a run planned, and each re-plan: '12 → 11 → 10 → 11'."""
    plan = record.get("plan")
    if not plan:
        return "—"
    replans = plan.get("replans", [])
    epochs = [replans[0]["was"]] if replans else [plan["epochs"]]
    return " → ".join(str(e) for e in epochs + [c["epochs"] for c in replans])


# README.md's blocks ---------------------------------------------------------------------


def results_table(records: list[dict]) -> str:
    """README.md's block: what `make run` gives, from the newest record of each preset."""
    rows = []
    for preset, where in (("cpu", "a 2-core CPU"), ("gpu", "a GPU")):
        r = newest_run(records, preset)
        if r is None:
            why = "no GPU has been lent to the project" if preset == "gpu" else "no record"
            rows.append([f"`{preset}` on {where}", f"not yet measured: {why}", "", "", ""])
            continue
        rows.append(
            [
                f"`{preset}` on a {r['machine']['short']}",
                f"{minutes(r['wall_seconds'])}, of which {r['train_seconds'] / 60:.1f} min "
                f"training ({r['epochs']} epochs, {r['precision']})",
                f"{r['test2016_bleu_greedy']:.1f}",
                f"{r['test2016_bleu_beam']:.1f}",
                f"[`{r['commit']}`](results/{r['file']})",
            ]
        )
    head = ["preset, machine", "`make run` took", "BLEU greedy", "BLEU beam 4", "record"]
    return table(head, rows)


def performance_summary(records: list[dict]) -> str:
    """README.md's block: which model the benchmark measured, and its main figures."""
    current = newest_run(records, "cpu")
    lines = []
    benches = [r for r in records if r["kind"] == "bench"]
    for r in sorted(benches, key=lambda r: r["machine"].get("utc", ""))[-1:]:  # the newest
        b = r["bench"]
        duel = b["model_vs_pytorch"]
        text = (
            f"The newest benchmark on record ran at commit `{r['commit']}` on a "
            f"{r['machine']['short']}, with that commit's `{r['preset']}` preset: a model of "
            f"{duel['ours_parameters']:,} parameters"
        )
        if current and current.get("parameters") not in (None, duel["ours_parameters"]):
            text += (
                f" (the newest `make run` of the preset trained a model of "
                f"{current['parameters']:,})"
            )
        text += (
            f". Our training step took {duel['ratio']:.2f} times as long as "
            f"`torch.nn.Transformer`'s on the same batches, and the whole training pipeline "
            f"ran {b['pipeline']['speedup']:.1f} times as many target tokens a second as the "
            f"well-known notebook's loop; our batches were {b['padding']['ours']:.0%} real "
            f"tokens, its {b['padding']['reference']:.0%}."
        )
        lines.append(text)
    return "\n\n".join(lines) or "No benchmark on record yet."


README_BLOCKS = {"results": results_table, "performance": performance_summary}


def render(readme: str, records: list[dict]) -> str:
    """README text with every marked block replaced by its text from the records."""
    for name, make in README_BLOCKS.items():
        pattern = re.compile(
            rf"(<!-- records:{name} -->\n).*?(\n<!-- /records:{name} -->)", flags=re.DOTALL
        )
        if not pattern.search(readme):
            raise SystemExit(f"records: README.md has no <!-- records:{name} --> block")
        text = make(records)
        readme = pattern.sub(lambda m, t=text: m.group(1) + t + m.group(2), readme)
    return readme


# results/README.md ----------------------------------------------------------------------


def summary_of(r: dict) -> str:
    """One run's paragraph: time, plan, precision, decoding, the model scored, memory."""
    calibration, plan = r.get("calibration_seconds"), r.get("plan")
    text = (
        f"**`{r['commit']}`** ({link(r)}, {r['machine']['short']}): `make run` took "
        f"{minutes(r['wall_seconds'])}, of which {r['train_seconds'] / 60:.1f} minutes are "
        f"training ({r['epochs']} epochs in {r['precision']}"
    )
    if calibration:
        text += (
            f", chosen by the calibration: one batch took {calibration['fp32']:.2f} s in "
            f"float32 and {calibration['bf16']:.2f} s in bf16"
        )
    text += "). "
    if plan and plan.get("replans"):
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
        if "warmup" in plan:  # the warm-up the plan left (fit_warmup); older plans lack it
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
        f"`{r['bleu_signature']}`. Command: `{r['command']}`. Source: {sentence(r['source'])}"
    )


def per_epoch_table(rows: list[tuple[str, list[float]]], digits: int = 1) -> str:
    """A figure after each epoch (validation BLEU unless told), one row per run; epochs
    counted from 0."""
    width = max(len(history) for _, history in rows)
    body = [[name] + [f"{b:.{digits}f}" for b in h] + [""] * (width - len(h)) for name, h in rows]
    return table(["run"] + [str(i) for i in range(width)], body)


def make_run_section(records: list[dict]) -> str:
    """The `make run` records: one table, the BLEU of each epoch, a paragraph per run."""
    runs = make_runs(records)
    newest = newest_run(records, "cpu")
    reference = newest or (runs[0] if runs else {})
    rows = []
    for r in runs:
        commit = f"`{r['commit']}`"
        if r is newest:
            commit = f"**{commit}** (newest)"
        rows.append(
            [
                commit,
                f"`{r['preset']}`",
                r["machine"]["short"],
                settings_changed(r, reference),
                planned(r),
                str(r["epochs"]),
                f"{r['train_seconds']:,} s",
                r["precision"],
                f"{r['train_tokens_per_second']:,}",
                minutes(r["wall_seconds"]),
                f"{r['peak_memory_gb']:.2f} GB",
                num(r["val_bleu_greedy_averaged"] or r["val_bleu_greedy_last_epoch"]),
                num(r["test2016_bleu_greedy"]),
                num(r["test2016_bleu_beam"]),
                link(r),
            ]
        )
    head = ["commit", "preset", "machine", "settings changed", "plan: epochs", "epochs"]
    head += ["training", "precision", "target tokens/s", "`make run` took", "peak memory"]
    head += ["val BLEU greedy", "test BLEU greedy", "test BLEU beam 4", "record"]
    histories = [(f"`{r['commit']}`", r.get("val_bleu_history")) for r in runs]
    histories = [(name, h) for name, h in histories if h]
    parts = [
        "## make run records",
        "",
        "One row per recorded `make run`, newest first (by when it was made, or its plan was; "
        "a record with neither is older than any with one). **(newest)** marks the newest "
        "run of the current `cpu` preset on all its cores: the one README.md quotes. "
        "*Settings changed*: the settings in which the run differs from that newest run "
        "(`—`: the record has no such setting). *Plan*: for the older runs planned to the "
        "clock, the epochs planned before training, then after each re-plan (`—`: a fixed "
        "number of epochs). *Training*: seconds of training. "
        "*Target tokens/s*: English tokens trained a second. *Val BLEU*: greedy, on the "
        "validation split, of the model that was scored (averaged where the run averaged). "
        "*Test BLEU*: sacreBLEU on test2016, greedy and with beam search.",
        "",
        table(head, rows),
        "",
        "### Validation BLEU after each epoch",
        "",
        per_epoch_table(histories) if histories else "No record has a per-epoch history.",
        "",
        "### Run by run",
        "",
        "\n\n".join(summary_of(r) for r in runs),
    ]
    return "\n".join(parts)


def xeon_section(record: dict, heading: str) -> str:
    """The first tuning (runs R1 to R4): validation BLEU, the <unk> ban, bf16 against fp32."""
    rows = [
        [
            run["run"],
            run["settings"],
            run["averaged"],
            num(run.get("training_minutes")),
            num(run["greedy"]),
            num(run["beam_0.6"]),
            num(run["beam_1.0"]),
            prose(run.get("note", "")),
        ]
        for run in record["runs"]
    ]
    head = ["run", "settings", "weights averaged", "training minutes", "val BLEU greedy"]
    head += ["val BLEU beam 4, α = 0.6", "val BLEU beam 4, α = 1.0", "note"]
    ban = record["unk_ban"]
    what = prose(ban["what"])
    ban_rows = [
        [label, num(ban[key]["allowed"]), num(ban[key]["banned"])]
        for key, label in (("greedy", "greedy"), ("beam_0.6", "beam 4, α = 0.6"))
    ]
    fp = record["bf16_against_fp32"]
    fp_rows = [
        [str(i), f"{lf:.3f}", f"{lb:.3f}", num(bf), num(bb)]
        for i, (lf, lb, bf, bb) in enumerate(
            zip(
                fp["val_loss_fp32"],
                fp["val_loss_bf16"],
                fp["val_bleu_greedy_fp32"],
                fp["val_bleu_greedy_bf16"],
                strict=True,
            )
        )
    ]
    parts = [
        f"## {heading}",
        "",
        f"Record: {link(record)}. Machine: {prose(record['machine']['cpu'])}. Commits: "
        f"{record['commit']}. Command: `{record['command']}`. Source: "
        f"{sentence(record['source'])}",
        "",
        "Each row is one training run scored on the validation split: greedy, then beam "
        "search with two length penalties α. *Weights averaged*: the final model is the "
        "mean of the last epochs' weights, or the last epoch alone.",
        "",
        table(head, rows),
        "",
        f"### `<unk>` allowed or never written ({ban['run']})",
        "",
        f"{what[:1].upper()}{what[1:]}; weights: {ban['weights']}. Greedy decoding ran "
        f"away (one `<unk>` after another, up to the length cap) on "
        f"{ban['runaway_sentences_greedy']} of {ban['sentences']:,} sentences with `<unk>` "
        "allowed.",
        "",
        table(["decoding", "val BLEU, `<unk>` allowed", "val BLEU, never written"], ban_rows),
        "",
        f"### bf16 against float32 ({fp['run']})",
        "",
        f"{fp['run']}: {prose(fp['what'])}. Training ran at {span(fp['tokens_per_second_bf16'])} "
        f"target tokens/s in bf16 and {span(fp['tokens_per_second_fp32'])} in float32.",
        "",
        table(
            ["epoch", "val loss fp32", "val loss bf16", "val BLEU fp32", "val BLEU bf16"],
            fp_rows,
        ),
    ]
    return "\n".join(parts)


def epyc_section(record: dict, heading: str) -> str:
    """The second tuning (runs E1 to E23): one table, BLEU after each epoch, the notes."""
    rows = []
    for run in record["runs"]:
        epochs = str(run["epochs"])
        if run.get("replans"):
            epochs += f" (re-planned from {run['replans'][0]['was']})"
        speeds = run.get("tokens_per_second_per_epoch")
        rows.append(
            [
                run["run"],
                f"`{run['commit'].split()[0]}`" if run.get("commit") else "",
                ", ".join(setting(k, v) for k, v in run["changes"].items()),
                f"{run['parameters']:,}" if run.get("parameters") else "",
                epochs,
                num(run.get("training_minutes")),
                f"{run['planned_tokens_per_second']:,}"
                if run.get("planned_tokens_per_second")
                else "",
                f"{mean(speeds):,.0f}" if speeds else "",
                num(run.get("val_bleu_greedy_last_epoch"), 2),
                num(run.get("val_bleu_greedy_averaged"), 2),
                num(run.get("val_bleu_beam_last_epoch"), 2),
                num(run.get("val_bleu_beam_averaged"), 2),
            ]
        )
    head = ["run", "commit", "changed from the preset", "parameters", "epochs"]
    head += ["training minutes", "target tokens/s, probe", "target tokens/s, trained"]
    head += ["val BLEU greedy, last epoch", "greedy, averaged", "beam 4, last epoch"]
    head += ["beam 4, averaged"]
    histories = [(run["run"], run["val_bleu_greedy_per_epoch"]) for run in record["runs"]]
    notes = []
    for run in record["runs"]:
        words = [prose(run["note"]).rstrip(".") + "."] if run.get("note") else []
        if len(run.get("commit", "").split()) > 1:  # a commit with words about it
            words.append(f"Commit: {prose(run['commit'])}.")
        if words:
            notes.append(f"* **{run['run']}**: " + " ".join(words))
    parts = [
        f"## {heading}",
        "",
        f"Record: {link(record)}. Machine: {prose(record['machine']['cpu'])}. Command: "
        f"`{record['command']}`. Source: {sentence(record['source'])}",
        "",
        "Each row is one training run scored on the validation split only. *Changed from "
        "the preset*: the settings given to `tools/tune.py`, against the `cpu` preset of the "
        f"run's commit; a run without a commit ran on this base: {prose(record['commit'])} "
        "*Target tokens/s*: what the speed probe read before training, and the mean of the "
        "epochs. *Averaged*: the mean of the last epochs' weights, where the run averaged. "
        "Beam search: 4 beams, α = 1.0.",
        "",
        table(head, rows),
        "",
        "### Validation BLEU after each epoch",
        "",
        "Greedy, epochs counted from 0.",
        "",
        per_epoch_table(histories),
        "",
        "### Notes",
        "",
        "\n".join(notes),
    ]
    return "\n".join(parts)


def decoding_of(bench: dict) -> str:
    """What a benchmark says of decoding: nothing when it decoded, else that it skipped
    decoding and why, so that no reader takes the decoding table below for its figures."""
    skipped = (bench.get("decoding") or {}).get("skipped")
    if not skipped:
        return ""
    return (
        f"It measured no decoding ({prose(skipped.split(': run ')[0])}): the decoding times "
        "below come from the `make run` records. "
    )


def bench_section(records: list[dict]) -> str:
    """The `make bench` records, and decoding times from the `make run` records."""
    lines = ["## Benchmarks", ""]
    for r in [r for r in records if r["kind"] == "bench"]:
        b, m = r["bench"], r["machine"]
        duel, use = b["model_vs_pytorch"], b["utilisation"]
        ours, ref = b["pipeline"]["ours"], b["pipeline"]["reference"]
        lines += [
            f"`make bench` ({link(r)}): the `{r['preset']}` preset of commit `{r['commit']}`, "
            f"a model of {duel['ours_parameters']:,} parameters (`torch.nn.Transformer` "
            f"built to match: {duel['pytorch_parameters']:,}), on a {m['short']}, torch "
            f"{m['torch']}, {b['precision']} (the calibration's choice: "
            f"{b['precision_calibration']}). Command: `{r['command']}`, "
            f"{r['wall_seconds']:.0f} s. Source: {sentence(r['source'])} "
            f"{decoding_of(b)}{prose(r.get('caveat', ''))}".rstrip(),
            "",
            table(
                ["figure", "ours", "the other", "ratio", "goal"],
                [
                    [
                        f"training step, same size, same {duel['batches']} batches",
                        f"{duel['ours_step_seconds']:.3f} s",
                        f"{duel['pytorch_step_seconds']:.3f} s (`torch.nn.Transformer`)",
                        f"{duel['ratio']:.2f}",
                        f"≤ 1.10 {'✓' if duel['ratio'] <= 1.10 else '✗'}",
                    ],
                    *(
                        [
                            [
                                "training step, our `attention` against PyTorch's fused kernel",
                                f"{duel['ours_step_seconds']:.3f} s",
                                f"{duel['fused_step_seconds']:.3f} s (`fused_attention=True`)",
                                f"{duel['attention_vs_fused_ratio']:.2f}",
                                "",
                            ]
                        ]
                        if "fused_step_seconds" in duel
                        else []
                    ),
                    [
                        "model FLOPs per second in training, against one large `torch.mm` (MFU)",
                        f"{use['model_flops_per_second'] / 1e9:.1f} G, {use['mfu']:.0%}",
                        f"{use['matmul_flops_per_second'] / 1e9:.1f} G (`torch.mm`, "
                        f"{use['matmul']['size']}²)",
                        "",
                        "",
                    ],
                    [
                        f"training, target tokens/s, same {ours['sentences']:,} sentences "
                        f"({ours['real_target_tokens']:,} target tokens)",
                        f"{ours['tokens_per_second']:,.0f}",
                        f"{ref['tokens_per_second']:,.0f} (the well-known notebook's loop)",
                        f"{b['pipeline']['speedup']:.1f}×",
                        "≥ 30× on a GPU (not measured)",
                    ],
                    [
                        "real tokens in training batches",
                        f"{b['padding']['ours']:.1%}",
                        f"{b['padding']['reference']:.1%} (every sentence padded to "
                        f"{ref['max_padding']})",
                        "",
                        "",
                    ],
                    [
                        "peak resident memory of the benchmark",
                        f"{b['peak_memory_mb'] / 1000:.2f} GB",
                        "",
                        "",
                        "",
                    ],
                ],
            ),
            "",
            f"Against `torch.nn.Transformer`: {prose(duel['note'])}. MFU: {prose(use['how'])}. "
            f"Padding: {prose(b['padding']['how'])}.",
            "",
        ]
    runs = make_runs(records)
    rows = [
        [
            f"`{r['commit']}`",
            r["machine"]["short"],
            f"{r['parameters']:,}" if r.get("parameters") else "not recorded",
            f"{r['greedy_test2016_seconds']:.1f} s",
            f"{r['beam4_test2016_seconds']:.1f} s",
            f"{r['beam4_test2016_seconds'] / r['greedy_test2016_seconds']:.1f}",
            link(r),
        ]
        for r in runs
    ]
    lines += [
        "### Decoding test2016",
        "",
        "The 1,000 test2016 sentences decoded by each recorded `make run`'s final model, "
        "newest first: greedily, and with beam search (4 beams); the last column is beam "
        "time over greedy time.",
        "",
        table(["commit", "machine", "parameters", "greedy", "beam 4", "ratio", "record"], rows),
    ]
    return "\n".join(lines)


def blocks_section(record: dict) -> str:
    """Appendix D's comparison: the paper's block and today's, the same preset and seeds."""
    runs = record["runs"]
    head = ["run", "block", "seed", "parameters", "val BLEU after epoch 0", "last epoch",
            "val loss, last epoch", "test2016 greedy", "test2016 beam", "s an epoch"]  # fmt: skip
    rows = [
        [
            r["run"],
            r["block"],
            str(r["seed"]),
            f"{r['parameters']:,}",
            f"{r['val_bleu_greedy_per_epoch'][0]:.1f}",
            f"{r['val_bleu_greedy_per_epoch'][-1]:.1f}",
            f"{r['val_loss_per_epoch'][-1]:.3f}",
            f"{r['test2016_bleu_greedy']:.1f}",
            f"{r['test2016_bleu_beam']:.1f}",
            f"{sum(r['epoch_seconds_training']) / len(r['epoch_seconds_training']):.0f}",
        ]  # fmt: skip
        for r in runs
    ]
    parts = [
        "## Today's block beside the paper's",
        "",
        f"{link(record)}: the notebook's Appendix D states what it shows, and "
        "tests/test_records.py checks those sentences against it. "
        f"{sentence(record['source'])} Made {record['made']} on a {record['machine']['short']}, "
        f"with `{record['command']}`.",
        "",
        table(head, rows),
        "",
        "Validation BLEU (greedy) after each epoch:",
        "",
        per_epoch_table(
            [(f"{r['block']}, seed {r['seed']}", r["val_bleu_greedy_per_epoch"]) for r in runs]
        ),
        "",
        "Validation loss after each epoch:",
        "",
        per_epoch_table(
            [(f"{r['block']}, seed {r['seed']}", r["val_loss_per_epoch"]) for r in runs], digits=3
        ),
    ]
    if record.get("speed"):
        parts += ["", sentence(record["speed"]["summary"])]
    return "\n".join(parts)


def machines_section(records: list[dict]) -> str:
    """One row per machine as the records describe it, with the records made on it."""
    machines: dict[tuple, list[str]] = {}
    for r in sorted(records, key=lambda r: (r["machine"]["short"], r["file"])):
        m = r["machine"]
        key = (m["short"], prose(m["cpu"]), str(m["cores"]), m.get("gpu") or "none")
        machines.setdefault(key + (m.get("torch", ""), m.get("python", "")), []).append(link(r))
    rows = [[*key, ", ".join(files)] for key, files in machines.items()]
    head = ["machine", "as the record describes it", "cores", "GPU", "torch", "Python"]
    return "\n".join(["## Machines", "", table([*head, "records"], rows)])


# The tuning records, by file, under the headings that the notebook links to.
TUNINGS = {
    "tuning-cpu-xeon.json": ("Tuning on a 2-core Xeon (first preset)", xeon_section),
    "tuning-cpu-epyc.json": ("Tuning on a 2-core AMD EPYC", epyc_section),
}


def document(records: list[dict]) -> str:
    """results/README.md, whole."""
    intro = (
        "# Records of past runs\n\n"
        "Generated by `tools/records.py` from the JSON records in this folder: never edit it "
        f"by hand; after changing a record, run {REGENERATE}. Each record names the machine, "
        "the commit and the command that made it, and where its figures came from (`source`). "
        "BLEU is sacreBLEU: cased, on detokenized output, against the raw references."
    )
    tunings = []
    order = list(TUNINGS)  # the known tunings in the order above, then any other
    found = [r for r in records if r["kind"] == "tuning"]
    found.sort(key=lambda r: order.index(r["file"]) if r["file"] in order else len(order))
    for r in found:
        heading, section = TUNINGS.get(
            r["file"], (f"Tuning on a {r['machine']['short']} ({r['file']})", epyc_section)
        )
        tunings.append(section(r, heading))
    blocks = [blocks_section(r) for r in records if r["kind"] == "blocks"]
    sections = [intro, make_run_section(records), *tunings, *blocks]
    sections += [bench_section(records), machines_section(records)]
    return "\n\n".join(sections) + "\n"


# Command line ---------------------------------------------------------------------------


def main(argv=None) -> None:
    """Rewrite (or, with --check, compare) results/README.md and README.md's blocks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if either disagrees")
    args = parser.parse_args(argv)
    records = load_records()
    readme = README.read_text(encoding="utf-8")
    files = {  # name: (path, its text now, its text from the records)
        "README.md": (README, readme, render(readme, records)),
        "results/README.md": (
            DOCUMENT,
            DOCUMENT.read_text(encoding="utf-8") if DOCUMENT.exists() else None,
            document(records),
        ),
    }
    stale = [name for name, (_, now, wanted) in files.items() if now != wanted]
    if args.check:
        if stale:
            sys.exit(
                f"records: {' and '.join(stale)} "
                f"{'disagrees' if len(stale) == 1 else 'disagree'} with results/*.json: "
                f"run {REGENERATE} (never edit generated text by hand)"
            )
        print("records: README.md and results/README.md agree with results/*.json")
        return
    for name in stale:
        path, _, wanted = files[name]
        write_atomically(path, wanted.encode("utf-8"))
        print(f"records: {name} rewritten from results/*.json")


if __name__ == "__main__":
    main()

"""Train the `cpu` preset with some settings changed and score it on the validation split.

    .venv/bin/python tools/tune.py lr_factor=0.35 epochs=10
    .venv/bin/python tools/tune.py --label long-warmup warmup=800
    .venv/bin/python tools/tune.py train_pairs=5000 clip_norm=none pre_norm=true

Each run trains with the notebook's own loop (`train`, from its `.py` twin) into its own
folder, data/tune/checkpoints/tune-<label>-<fingerprint>/ (a run that finished there is
loaded, not trained again: delete the folder to run again), prints a line per
epoch, then appends one JSON line to build/tune.jsonl: the changed settings, greedy
validation BLEU per epoch and of the averaged weights, beam validation BLEU of the final
model, and the minutes spent. It never touches the test split: this is the tool for
choosing settings.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
import typing
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer as at  # noqa: E402  (defines names, runs nothing)
import plumbing  # noqa: E402
from plumbing import prepare_cpu_memory  # noqa: E402

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_change(text: str) -> tuple[str, object]:
    """'lr_factor=0.35' -> ('lr_factor', 0.35), typed by the field's annotation.

    `int | None` and `float | None` fields also take `none`; a bool takes true/false; a
    field with a fixed set of values (a Literal, as `schedule`) takes one of them."""
    name, _, value = text.partition("=")
    types = typing.get_type_hints(at.Settings)
    types.pop("name")  # tune names its runs itself (--label)
    if name not in types or not value:
        raise SystemExit(
            f"tune: {text!r} is not name=value for a Settings field; "
            f"the fields are {', '.join(types)}"
        )
    if typing.get_origin(types[name]) is typing.Literal:
        allowed = typing.get_args(types[name])
        if value in allowed:
            return name, value
        raise SystemExit(f"tune: {text!r}: {name} takes one of {', '.join(allowed)}")
    members = typing.get_args(types[name])  # (int, NoneType) for `int | None`; () for `int`
    optional = type(None) in members
    kind = next(t for t in members if t is not type(None)) if members else types[name]
    if optional and value.lower() == "none":
        return name, None
    if kind is bool:
        if value.lower() in TRUE + FALSE:
            return name, value.lower() in TRUE
    else:
        with contextlib.suppress(ValueError):
            return name, kind(value)
    expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
    raise SystemExit(f"tune: {text!r}: {name} takes {expected}{' or none' if optional else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("changes", nargs="*", help="name=value for Settings fields")
    parser.add_argument("--label", help="the run's name (default: from the changes)")
    parser.add_argument("--out", default=str(ROOT / "build" / "tune.jsonl"))
    args = parser.parse_args()
    changes = dict(parse_change(c) for c in args.changes)
    label = args.label or ("-".join(f"{k}={v}" for k, v in changes.items()) or "cpu")
    settings = dataclasses.replace(at.get_settings("cpu"), name=f"tune-{label}", **changes)
    prepare_cpu_memory()  # as the notebook does before training (plumbing.py says why)
    data = at.prepare_data(settings, at.DATA_DIR)
    device = at.pick_device()
    folder = plumbing.run_folder(settings, data, vars(at), at.DATA_DIR / "tune")
    start = time.perf_counter()
    model, history = at.train(settings, data, folder, device=device)  # or loads it
    minutes = (time.perf_counter() - start) / 60
    model.eval()
    search = functools.partial(
        at.beam_search, beam_size=settings.beam_size, alpha=settings.length_penalty
    )
    beam = at.translate(model, [src for src, _ in data.val], data.vocabs, search=search)
    references = [en for _, en in data.val_text]
    beam_bleu = at.bleu_scores(beam, references)["bleu"]
    record = {
        "label": label,
        "changes": changes,
        "val_bleu": [round(h["val_bleu"], 2) for h in history],
        "val_loss": [round(h["val_loss"], 3) for h in history],
        "averaged": history[-1].get("averaged"),
        "final_val_bleu_beam": round(beam_bleu, 2),
        "precision": settings.precision,
        "epochs": len(history),
        "train_minutes": round(sum(h["seconds"] for h in history) / 60, 1),
        "minutes": round(minutes, 1),
        "torch_threads": torch.get_num_threads(),
    }
    append_record(record, Path(args.out))


def append_record(record: dict, path: Path) -> None:
    """Print `record` and append it to `path` as one JSON line (tools/blocks.py too)."""
    print(json.dumps(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()

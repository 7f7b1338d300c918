"""Train the `cpu` preset with the paper's block or today's (Appendix D) and score it.

    .venv/bin/python tools/blocks.py --block modern --seed 42
    .venv/bin/python tools/blocks.py --block 2017 --seed 43
    .venv/bin/python tools/blocks.py --speed

Both blocks are pre-norm, as today's must be: `--preset smoke` or `gpu`, which are
post-norm, are made pre-norm for both, so that the blocks differ only in the three new
parts. Each run trains with the notebook's own loop (`train`, from its `.py` twin; `--block
modern` hands it `modern_model_for`) into data/blocks/checkpoints/ (a finished run there is
loaded, not trained again), then appends one JSON line to build/blocks.jsonl: parameters,
loss and greedy validation BLEU per epoch, the seconds of each epoch's training, and
test2016 BLEU, greedy and beam, as Part 7 scores it. results/blocks-*.json hold such lines.

`--speed` trains neither to the end: it times both blocks' training steps in one process,
in turns, on the same batches, so that a busy or slow machine slows both alike, and prints
the seconds of a step of each and their ratio.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer as at  # noqa: E402  (defines names, runs nothing)
import plumbing  # noqa: E402
from plumbing import prepare_cpu_memory  # noqa: E402
from tools.tune import append_record  # noqa: E402

BUILDERS = {"2017": ("train",), "modern": ("train", "modern_model_for")}


def speed(settings, data, device, rounds: int = 6, steps: int = 20) -> dict:
    """Median seconds of a training step of each block, timed in turns on the same batches."""
    en = data.vocabs["en"]
    batches = at.batches_for(data.train, en.pad_id, settings, device)[: rounds * steps]
    if len(batches) < rounds * steps:
        raise SystemExit(
            f"blocks: --speed times {rounds * steps} batches, and an epoch of this preset "
            f"has {len(batches)}: use --preset cpu"
        )
    seconds: dict[str, list[float]] = {block: [] for block in BUILDERS}
    learners = {}
    steps_of_run = at.total_steps(data.train, settings)  # the run's schedule, its first steps
    for block in BUILDERS:
        model = (at.modern_model_for if block == "modern" else at.model_for)(settings, data.vocabs)
        criterion = at.FastLabelSmoothing(len(en), en.pad_id)
        optimizer, schedule = at.make_optimizer(model, settings, total_steps=steps_of_run)
        learners[block] = (model.to(device), criterion, optimizer, schedule)
    for r in range(rounds):
        for block in BUILDERS if r % 2 == 0 else list(BUILDERS)[::-1]:  # ABBA: fair to both
            part = batches[r * steps : (r + 1) * steps]
            began = time.perf_counter()
            at.run_epoch(part, *learners[block], clip_norm=settings.clip_norm)
            seconds[block].append((time.perf_counter() - began) / len(part))
    medians = {block: statistics.median(s) for block, s in seconds.items()}
    relative = {block: round(m / medians["2017"], 3) for block, m in medians.items()}
    return {"seconds_per_step": medians, "relative": relative, "rounds": rounds, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", choices=list(BUILDERS))
    parser.add_argument("--speed", action="store_true", help="time a step of each block")
    parser.add_argument("--seed", type=int, default=at.Settings.seed)
    parser.add_argument("--preset", default="cpu", choices=list(at.PRESETS))
    parser.add_argument("--out", default=str(ROOT / "build" / "blocks.jsonl"))
    args = parser.parse_args()
    if not (args.speed or args.block):
        parser.error("say which: --block 2017, --block modern, or --speed")
    # pre-norm for both blocks (the docstring says why)
    settings = dataclasses.replace(
        at.get_settings(args.preset), name=f"{args.preset}-{args.block or 'speed'}",
        seed=args.seed, pre_norm=True,
    )  # fmt: skip
    build = at.modern_model_for if args.block == "modern" else at.model_for
    prepare_cpu_memory()  # as the notebook does before training (plumbing.py says why)
    data = at.prepare_data(settings, at.DATA_DIR)
    device = at.pick_device()
    if args.speed:
        print(json.dumps(speed(settings, data, device)))
        return
    folder = plumbing.run_folder(
        settings, data, vars(at), at.DATA_DIR / "blocks", roots=BUILDERS[args.block]
    )
    model, history = at.train(settings, data, folder, device=device, build=build)
    model.eval()
    test = at.evaluate_test(model, data, settings)
    record = {
        "block": args.block,
        "preset": args.preset,
        "seed": args.seed,
        "parameters": at.count_parameters(model),
        "epochs": len(history),
        "val_loss_per_epoch": [round(h["val_loss"], 3) for h in history],
        "val_bleu_greedy_per_epoch": [round(h["val_bleu"], 2) for h in history],
        "train_loss_per_epoch": [round(h["train_loss"], 3) for h in history],
        "epoch_seconds_training": [round(h["seconds"], 1) for h in history],
        "test2016_bleu_greedy": round(test["test2016_bleu_greedy"], 2),
        "test2016_bleu_beam": round(test["test2016_bleu_beam"], 2),
        "bleu_signature": test["bleu_signature"],
        "torch_threads": torch.get_num_threads(),
        "folder": folder.name,
    }
    append_record(record, Path(args.out))


if __name__ == "__main__":
    main()

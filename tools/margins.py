"""Measure the margins of the notebook's checks of a trained outcome (tests/MARGINS.md).

Each check runs over seeds, on 1 and 2 threads, under each kernel set that `make
test-numerics` uses, every combination in a process of its own (the kernel variables are
read at start). One JSON line per run goes to stdout and to --out; `--summary FILE`
prints the worst case of each check against its limit from such a file.

    python tools/margins.py --out build/margins.jsonl            # everything (about an hour)
    python tools/margins.py --checks copy --seeds 10 --out ...   # one check
    python tools/margins.py --summary build/margins.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# the kernel sets of `make test-numerics`, each as the environment that selects it
KERNELS = {
    "native": {},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
CHECKS = ("copy", "prenorm", "reverse", "modern", "peeking", "smoke-loss")


def run_check(at, name: str, seed: int) -> dict:
    """One check of Part 3 or Part 11, as its cell runs it, on `seed`."""
    import torch

    held_out = at.copy_batch(100, 10, torch.Generator().manual_seed(12345))
    copies = at.decodes_exactly(held_out.src, held_out.src)
    small = at.ModelConfig(N=2, d_model=64, d_ff=128, h=4, dropout=0.0)
    if name == "copy":
        model, steps = at.train_copy_task(copies, seed=seed)
        return {"steps": steps, "passed": copies(model)}
    if name == "prenorm":
        config = at.dataclasses.replace(small, pre_norm=True)
        model, steps = at.train_copy_task(copies, seed=seed, config=config)
        return {"steps": steps, "passed": copies(model)}
    if name == "reverse":

        def reverse_batch(batch_size, length, generator):
            seq = at.copy_batch(batch_size, length, generator).src
            return at.Batch(src=seq, tgt=reversed_words(seq), pad_id=at.COPY_IDS.pad)

        def reversed_words(seq):
            return torch.cat([seq[:, :1], seq[:, 1:-1].flip(1), seq[:, -1:]], dim=1)

        test = reverse_batch(100, 10, torch.Generator().manual_seed(12345))
        reverses = at.decodes_exactly(test.src, reversed_words(test.src))
        model, steps = at.train_copy_task(reverses, seed=seed, make_batch=reverse_batch)
        return {"steps": steps, "passed": reverses(model)}
    if name == "modern":
        config = at.dataclasses.replace(small, pre_norm=True)

        def build(src, tgt, c):
            return at.modernise(at.make_model(src, tgt, c), c.h, c.d_ff)

        cached = at.decodes_exactly(held_out.src, held_out.src, at.CachedPrefix)
        model, steps = at.train_copy_task(cached, seed=seed, config=config, build=build)
        return {"steps": steps, "passed": cached(model)}
    if name == "peeking":  # Part 3's experiment, as its cell measures it
        model, _ = at.train_copy_task(make_batch=at.without_causal_mask, max_steps=200, seed=seed)
        criterion = at.LabelSmoothing(at.COPY_VOCAB, at.COPY_IDS.pad, smoothing=0.0)
        unseen = torch.Generator().manual_seed(12345)
        loss = at.evaluate([at.without_causal_mask(100, 10, unseen)], model, criterion)
        sources = at.copy_batch(100, 10, unseen).src
        mask = (sources != at.COPY_IDS.pad).unsqueeze(-2)
        decoded = at.greedy_decode(model, sources, mask, 12, ids=at.COPY_IDS)
        copied = [
            r[: sources.size(1)].tolist() == s.tolist()
            for r, s in zip(decoded, sources, strict=True)
        ]
        return {"loss": loss, "copied_share": sum(copied) / len(copied)}
    if name == "smoke-loss":  # Part 6's training cell under make test: validation loss falls
        import tempfile
        from pathlib import Path

        import plumbing

        settings = at.dataclasses.replace(at.PRESETS["smoke"], seed=seed)
        with tempfile.TemporaryDirectory() as folder:
            data = at.prepare_data(settings, Path(folder))
            run = plumbing.run_folder(settings, data, vars(at), Path(folder))
            _, history = at.train(settings, data, run, device=torch.device("cpu"))
        return {"first": history[0]["val_loss"], "last": history[-1]["val_loss"]}
    raise ValueError(f"unknown check {name!r}: use one of {', '.join(CHECKS)}")


def worker(checks: list[str], seeds: list[int], threads: int, kernel: str) -> None:
    import contextlib
    import io

    import torch

    torch.set_num_threads(threads)
    import annotated_transformer as at

    for name in checks:
        for seed in seeds:
            with contextlib.redirect_stdout(io.StringIO()):  # the epochs' lines
                row = run_check(at, name, seed)
            row |= {"check": name, "seed": seed, "threads": threads, "kernel": kernel,
                    "capability": torch.backends.cpu.get_cpu_capability()}  # fmt: skip
            print(json.dumps(row), flush=True)


def summary(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for name in CHECKS:
        mine = [r for r in rows if r["check"] == name]
        if not mine:
            continue
        seeds, threads = len({r["seed"] for r in mine}), sorted({r["threads"] for r in mine})
        runs = f"{seeds} seeds x threads {threads} x kernels {sorted({r['kernel'] for r in mine})}"
        runs += f": {len(mine)} runs"
        if name == "smoke-loss":
            drops = [r["first"] - r["last"] for r in mine]
            print(f"{name}: {runs}; smallest fall of the validation loss {min(drops):.3f} "
                  f"(from {max(r['first'] for r in mine):.3f} at most; must be > 0)")  # fmt: skip
        elif name == "peeking":
            worst_loss = max(r["loss"] for r in mine)
            worst_share = max(r["copied_share"] for r in mine)
            print(f"{name}: {runs}; worst loss {worst_loss:.4f} (limit 0.5), "
                  f"worst copied share {worst_share:.0%} (limit 10%)")  # fmt: skip
        else:
            worst = max(mine, key=lambda r: r["steps"])
            failed = [r for r in mine if not r["passed"]]
            print(f"{name}: {runs}; slowest {worst['steps']} steps (seed {worst['seed']}, "
                  f"{worst['threads']} thread(s), {worst['kernel']}); "
                  f"not passed: {len(failed)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--seeds", type=int, default=10, help="seeds 42, 43, ...")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--summary", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summary:
        return summary(args.summary)
    checks, seeds = args.checks.split(","), list(range(42, 42 + args.seeds))
    if args.worker:
        return worker(checks, seeds, int(args.threads), args.kernels)
    out = args.out.open("a") if args.out else None
    root = Path(__file__).resolve().parent.parent
    for kernel in args.kernels.split(","):
        for threads in args.threads.split(","):
            env = os.environ | KERNELS[kernel] | {"OMP_NUM_THREADS": threads}
            env["PYTHONPATH"] = str(root)
            command = [sys.executable, __file__, "--worker", "--checks", args.checks, "--seeds",
                       str(args.seeds), "--threads", threads, "--kernels", kernel]  # fmt: skip
            with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as proc:
                for line in proc.stdout:
                    print(line, end="", flush=True)
                    if out:
                        out.write(line)
                        out.flush()
            if proc.returncode:
                sys.exit(f"the worker for {kernel}, {threads} thread(s) failed")


if __name__ == "__main__":
    main()

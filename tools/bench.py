"""Benchmarks of the notebook's model, data pipeline and decoding; writes build/bench.json.

    make bench                                  # the preset for this machine (or AT_PRESET)
    .venv/bin/python tools/bench.py --preset smoke --repeats 2 --out /tmp/bench.json
    .venv/bin/python tools/bench.py --compile   # also our model under torch.compile

Four comparisons, each measured side by side in one run because machines are noisy:
warm-up excluded, the median of several repeats, the two contenders interleaved.

1. one training step of our model against torch.nn.Transformer of the same size;
2. target tokens per second of our data pipeline and loop against a loop set up as the
   well-known 2022 notebook sets it up (72-token padding, 32 sentences, fp32, spaCy in
   the DataLoader's collate, dense KL label smoothing);
3. the share of real tokens in training batches for both pipelines;
4. greedy and beam decoding of test2016 with the trained final checkpoint, with and
   without cached keys and values.

Peak memory and the machine's facts go into the same JSON file.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Importing the notebook's twin runs its small demonstration cells, which print; the
# benchmark's own output is easier to read without them.
with contextlib.redirect_stdout(io.StringIO()):
    import annotated_transformer as at


# bf16 autocast on CUDA; float32 on a CPU, where the reference pipeline also runs in it
PRECISION = {"cuda": "bf16", "cpu": "fp32", "mps": "fp32"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much work each comparison does for one preset."""

    step_batches: int  # fixed training batches timed per round (model against PyTorch)
    pipeline_tokens: int  # real target tokens that both pipelines train on
    warmup_pairs: int = 64  # two reference batches of 32 sentences, untimed


# Chosen so that `make bench` with the cpu preset takes about 6 minutes on 2 CPU cores.
SIZES = {
    "smoke": Sizes(step_batches=4, pipeline_tokens=3_000),
    "cpu": Sizes(step_batches=8, pipeline_tokens=15_000),
    "gpu": Sizes(step_batches=10, pipeline_tokens=300_000),
}
REFERENCE = {"max_padding": 72, "batch_size": 32, "accum_iter": 10}  # the 2022 notebook's
PLAIN_BEAM_SENTENCES = 200  # beam search without a cache is slow: time it on these only


def parse_args(argv=None) -> argparse.Namespace:
    """The command line: preset, repeats, output file, data folder and threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="smoke, cpu or gpu (default: AT_PRESET, then auto)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument("--out", type=Path, default=at.BUILD_DIR / "bench.json")
    parser.add_argument("--data-dir", type=Path, default=at.DATA_DIR, help="data and checkpoints")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--compile", action="store_true", help="also time our model under torch.compile"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


# Timing helpers


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, work):
    """Run work() between two synchronisations; return (seconds, what it returned)."""
    synchronize(device)
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return time.perf_counter() - start, result


def fresh_training(settings: at.Settings, build, device: torch.device):
    """A model from build() under the preset's seed, with the notebook's optimizer."""
    at.set_seed(settings.seed)
    model = build().to(device)
    # the rate's value does not change a step's cost; a linear schedule needs an end
    fused, end = device.type == "cuda", 10 * settings.warmup
    optimizer, schedule = at.make_optimizer(model, settings, fused, total_steps=end)
    return model, optimizer, schedule


# 1. Our model against torch.nn.Transformer


class TorchTransformer(nn.Module):
    """torch.nn.Transformer between our embeddings, positions and tied generator.

    It takes the same arguments as our EncoderDecoder, so at.batch_loss runs it, but it
    builds its masks from the tokens in PyTorch's convention: True where NOT allowed.
    """

    def __init__(self, settings: at.Settings, vocabs: dict):
        super().__init__()
        d_model, dropout = settings.d_model, settings.dropout
        self.src_pad_id, self.tgt_pad_id = vocabs["de"].pad_id, vocabs["en"].pad_id
        self.src_embed = nn.Sequential(
            at.TokenEmbedding(len(vocabs["de"]), d_model),
            at.PositionalEncoding(d_model, dropout, max(settings.max_len, 256)),
        )
        self.tgt_embed = nn.Sequential(
            at.TokenEmbedding(len(vocabs["en"]), d_model),
            at.PositionalEncoding(d_model, dropout, max(settings.max_len, 256)),
        )
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=settings.h,
            num_encoder_layers=settings.N,
            num_decoder_layers=settings.N,
            dim_feedforward=settings.d_ff,
            dropout=dropout,
            batch_first=True,
            norm_first=settings.pre_norm,
        )
        self.generator = at.Generator(d_model, len(vocabs["en"]))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        self.generator.proj.weight = self.tgt_embed[0].embedding.weight

    def forward(self, src, tgt, src_mask=None, tgt_mask=None):
        """Decoder states (B, T, d_model); our masks are ignored, the tokens give them."""
        T = tgt.size(1)
        src_padding = src == self.src_pad_id  # (B, S)
        future = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # (T, T)
        return self.transformer(
            self.src_embed(src),
            self.tgt_embed(tgt),
            tgt_mask=future,
            src_key_padding_mask=src_padding,
            tgt_key_padding_mask=tgt == self.tgt_pad_id,  # (B, T)
            memory_key_padding_mask=src_padding,
            tgt_is_causal=True,
        )


def fixed_batches(data: at.Multi30k, settings: at.Settings, count: int, device) -> list:
    """The first `count` bucketed training batches of epoch 0, on the device."""
    indices = at.bucket_batches(data.train, settings.batch_tokens, seed=settings.seed, epoch=0)
    pad_id = data.vocabs["en"].pad_id
    return [at.collate(data.train, b, pad_id).to(device) for b in indices[:count]]


def train_round(training, criterion, batches, device) -> float:
    """Mean seconds of one training step (forward, backward, Adam) over the batches."""
    model, optimizer, schedule = training
    model.train()
    autocast = at.autocast_for(device, PRECISION[device.type])

    def steps():
        for batch in batches:
            with autocast():
                loss = at.batch_loss(model, criterion, batch)
            (loss / batch.ntokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()

    seconds, _ = timed(device, steps)
    return seconds / len(batches)


def compiled(training):
    """The same training triple with the model wrapped by torch.compile (dynamic shapes)."""
    model, optimizer, schedule = training
    return torch.compile(model, dynamic=True), optimizer, schedule


def compare_models(settings, data, device, sizes: Sizes, repeats: int, compile_too=False):
    """Median training-step time of our model and of nn.Transformer, rounds interleaved.

    With compile_too, a third contender is our model under torch.compile; its first
    round (the warm-up, untimed in the medians) includes the compilation.
    """
    vocabs, batches = data.vocabs, fixed_batches(data, settings, sizes.step_batches, device)
    en = vocabs["en"]
    criterion = at.FastLabelSmoothing(len(en), en.pad_id, settings.label_smoothing)
    contenders = {
        "ours": fresh_training(settings, lambda: at.model_for(settings, vocabs), device),
        "pytorch": fresh_training(settings, lambda: TorchTransformer(settings, vocabs), device),
    }
    if compile_too:
        build = lambda: at.model_for(settings, vocabs)  # noqa: E731
        contenders["ours_compiled"] = compiled(fresh_training(settings, build, device))
    rounds = {name: [] for name in contenders}
    warmup = {}
    for repeat in range(repeats + 1):  # round 0 is the warm-up
        for name, training in contenders.items():
            seconds = train_round(training, criterion, batches, device)
            if repeat > 0:
                rounds[name].append(seconds)
            else:
                warmup[name] = seconds * len(batches)
    ours, pytorch = statistics.median(rounds["ours"]), statistics.median(rounds["pytorch"])
    return {
        "ours_step_seconds": ours,
        "pytorch_step_seconds": pytorch,
        "ratio": ours / pytorch,
        "ours_parameters": at.count_parameters(contenders["ours"][0]),
        "pytorch_parameters": at.count_parameters(contenders["pytorch"][0]),
        "batches": len(batches),
        "real_target_tokens_per_round": sum(b.ntokens for b in batches),
        "ours_round_step_seconds": rounds["ours"],
        "pytorch_round_step_seconds": rounds["pytorch"],
        **(
            {
                "compiled_step_seconds": statistics.median(rounds["ours_compiled"]),
                "compiled_ratio": statistics.median(rounds["ours_compiled"]) / ours,
                "compiled_warmup_round_seconds": warmup["ours_compiled"],
            }
            if compile_too
            else {}
        ),
        "note": "nn.Transformer adds a final LayerNorm to both stacks even in post-norm "
        "and drops out the feed-forward hidden activations; the paper and our model do "
        "neither",
    }


# 2. Our data pipeline and loop against the 2022 notebook's


def training_text(data: at.Multi30k, data_dir: Path, tokenizers: dict):
    """Raw text and (cached) spaCy tokens of the preset's training pairs."""
    return data.train_text, at.cached_tokens("train", data.train_text, tokenizers, data_dir)


def race_pairs(settings, text, tokens, vocabs, sizes: Sizes) -> dict:
    """The same pairs for both pipelines, as raw text and as ids: warm-up and timed.

    Pairs are drawn in a seeded random order, skipping any longer than our max_len or
    the reference's 72 tokens, so that neither pipeline drops or cuts a token of them.
    """
    limit = min(settings.max_len, REFERENCE["max_padding"])
    order = torch.randperm(len(text), generator=torch.Generator().manual_seed(settings.seed))
    fits = [
        i for i in order.tolist() if max(len(tokens["de"][i]), len(tokens["en"][i])) + 2 <= limit
    ]
    warmup, timed_pairs, target_tokens = fits[: sizes.warmup_pairs], [], 0
    for i in fits[sizes.warmup_pairs :]:
        if target_tokens >= sizes.pipeline_tokens:
            break
        timed_pairs.append(i)
        target_tokens += len(tokens["en"][i]) + 1  # y_1 ... y_n and </s>

    def both_forms(chosen):
        chosen_tokens = {lang: [tokens[lang][i] for i in chosen] for lang in ("de", "en")}
        return {"text": [text[i] for i in chosen], "ids": at.encode_pairs(chosen_tokens, vocabs)}

    return {"warmup": both_forms(warmup), "timed": both_forms(timed_pairs)}


def reference_collate(text_pairs, tokenizers: dict, vocabs: dict) -> at.Batch:
    """The reference's collate: tokenize, look up, add <s> </s>, cut or pad to 72."""
    width, sides = REFERENCE["max_padding"], []
    for lang, sentences in zip(("de", "en"), zip(*text_pairs, strict=True), strict=True):
        vocab, rows = vocabs[lang], []
        for sentence in sentences:
            words = [token.text for token in tokenizers[lang](sentence)]
            ids = [vocab.bos_id, *vocab.encode(words), vocab.eos_id][:width]
            rows.append(ids + [vocab.pad_id] * (width - len(ids)))
        sides.append(torch.tensor(rows))  # (32, 72)
    return at.Batch(sides[0], sides[1], vocabs["en"].pad_id)


def run_reference(text_pairs, training, tokenizers, settings, vocabs) -> at.TrainState:
    """One pass of the reference loop over raw text; returns what it counted."""
    model, optimizer, schedule = training
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(
        text_pairs,
        batch_size=REFERENCE["batch_size"],
        shuffle=True,
        generator=torch.Generator().manual_seed(settings.seed),
        collate_fn=functools.partial(reference_collate, tokenizers=tokenizers, vocabs=vocabs),
    )
    criterion = at.LabelSmoothing(len(vocabs["en"]), vocabs["en"].pad_id, settings.label_smoothing)
    state = at.TrainState()
    # the loader tokenizes and pads as it is drawn; run_epoch needs each optimizer step's
    # token count up front, so the epoch's batches are drawn first (inside the timing)
    at.run_epoch(
        [batch.to(device) for batch in loader],
        model,
        criterion,
        optimizer=optimizer,
        schedule=schedule,
        state=state,
        accum_iter=REFERENCE["accum_iter"],
    )
    return state


def run_ours(pairs, training, settings, vocabs) -> at.TrainState:
    """One pass of our pipeline and loop over cached ids; returns what it counted."""
    model, optimizer, schedule = training
    device, pad_id = next(model.parameters()).device, vocabs["en"].pad_id
    criterion = at.FastLabelSmoothing(len(vocabs["en"]), pad_id, settings.label_smoothing)
    indices = at.bucket_batches(pairs, settings.batch_tokens, seed=settings.seed, epoch=0)
    batches = [at.collate(pairs, b, pad_id).to(device) for b in indices]
    state = at.TrainState()
    at.run_epoch(
        batches,
        model,
        criterion,
        optimizer=optimizer,
        schedule=schedule,
        state=state,
        accum_iter=settings.accum_iter,
        autocast=at.autocast_for(device, PRECISION[device.type]),
    )
    return state


def compare_pipelines(settings, race: dict, tokenizers, vocabs, device, repeats: int) -> dict:
    """Target tokens per second of both pipelines on the same pairs, runs interleaved.

    Every run trains a fresh model (same seed), built before the clock starts.
    """

    def run(name: str, part: str) -> tuple[float, at.TrainState]:
        training = fresh_training(settings, lambda: at.model_for(settings, vocabs), device)
        if name == "ours":
            return timed(device, lambda: run_ours(race[part]["ids"], training, settings, vocabs))
        text = race[part]["text"]
        return timed(device, lambda: run_reference(text, training, tokenizers, settings, vocabs))

    names = ("ours", "reference")
    for name in names:
        run(name, "warmup")  # other pairs than the timed ones
    seconds, counts = {name: [] for name in names}, {}
    for _ in range(repeats):
        for name in names:
            elapsed, counts[name] = run(name, "timed")
            seconds[name].append(elapsed)
    if counts["ours"].tokens != counts["reference"].tokens:
        raise RuntimeError(f"the pipelines saw different target token counts: {counts}")
    result = {
        name: {
            "tokens_per_second": counts[name].tokens / statistics.median(seconds[name]),
            "real_target_tokens": counts[name].tokens,
            "sentences": counts[name].samples,
            "batches": counts[name].micro_batches,
            "seconds": seconds[name],
        }
        for name in names
    }
    result["ours"]["accum_iter"] = settings.accum_iter
    result["reference"].update(REFERENCE, fp32=True, loss="LabelSmoothing (dense KL)")
    ours, reference = (result[name]["tokens_per_second"] for name in names)
    result["speedup"] = ours / reference
    return result


# 3. Padding efficiency


def compare_padding(settings, data: at.Multi30k, tokens: dict) -> dict:
    """Share of real tokens (source and target) in the training batches of each pipeline."""
    batches = at.bucket_batches(data.train, settings.batch_tokens, seed=settings.seed, epoch=0)
    width, real = REFERENCE["max_padding"], 0
    for de, en in zip(tokens["de"], tokens["en"], strict=True):
        real += min(len(de) + 2, width) + min(len(en) + 2, width)  # with <s> and </s>
    return {
        "ours": at.padding_efficiency(data.train, batches),
        "reference": real / (len(tokens["de"]) * 2 * width),
        "ours_pairs": len(data.train),
        "reference_pairs": len(tokens["de"]),
        "how": "tokens counted with <s> and </s>. Ours: the bucketed batches of epoch 0 "
        f"over the training pairs kept by max_len={settings.max_len}. Reference: every "
        f"training pair, each side cut to {width} tokens and padded to {width}",
    }


# 4. Decoding


def timed_translate(model, sources, vocabs, device, **options):
    """(seconds, outputs) of at.translate."""
    return timed(device, lambda: at.translate(model, sources, vocabs, **options))


def decoding(settings, data: at.Multi30k, device, data_dir: Path) -> dict:
    """Greedy and beam decoding of the test split, cached against plain recomputation."""
    loaded = at.load_final(settings, data, data_dir, device)
    if loaded is None:
        return {
            "skipped": f"no trained model in {at.checkpoint_dir(settings, data_dir)}: "
            f"run `AT_PRESET={settings.name} make run` first"
        }
    model = loaded[0].eval()
    vocabs, sources = data.vocabs, [src for src, _ in data.test]
    first = sources[:PLAIN_BEAM_SENTENCES]
    beam = {"beam_size": settings.beam_size, "alpha": settings.length_penalty}
    for cached in (True, False):  # warm-up
        at.translate(model, sources[:8], vocabs, cached=cached)
        at.translate(model, sources[:8], vocabs, cached=cached, **beam)
    greedy_plain, greedy_plain_out = timed_translate(model, sources, vocabs, device, cached=False)
    greedy, greedy_out = timed_translate(model, sources, vocabs, device, cached=True)
    plain_first, plain_first_out = timed_translate(
        model, first, vocabs, device, cached=False, **beam
    )
    cached_first, cached_first_out = timed_translate(
        model, first, vocabs, device, cached=True, **beam
    )
    beam_all, _ = timed_translate(model, sources, vocabs, device, cached=True, **beam)
    return {
        "sentences": len(sources),
        "beam_size": settings.beam_size,
        "alpha": settings.length_penalty,
        "greedy_seconds": greedy,
        "greedy_plain_seconds": greedy_plain,
        "greedy_speedup": greedy_plain / greedy,
        "greedy_identical": greedy_out == greedy_plain_out,
        "beam_seconds": beam_all,
        "beam_first_sentences": len(first),
        "beam_first_seconds": cached_first,
        "beam_first_plain_seconds": plain_first,
        "beam_speedup": plain_first / cached_first,
        "beam_identical": cached_first_out == plain_first_out,
    }


# 5 and 6. Memory and the machine


def peak_memory(device: torch.device) -> dict:
    """Peak resident memory of this process, and peak CUDA memory allocated if any."""
    memory = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        memory["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return memory


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git(*command: str) -> str | None:
    """Output of a git command in the repository, or None where git cannot say."""
    try:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(settings: at.Settings, device: torch.device) -> dict:
    """Facts that a timing depends on."""
    changes = git("status", "--porcelain", "--untracked-files=no")
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "preset": settings.name,
        "settings": dataclasses.asdict(settings),
        "utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_uncommitted_changes": None if changes is None else bool(changes),
    }


# The report


def row(figure: str, value: str, goal: str = "", met: bool | None = None) -> tuple:
    """One line of the table; met is None where no goal applies."""
    return figure, value, goal, met


def goal_rows(report: dict, device: torch.device) -> list[tuple]:
    """The table's rows: each figure, and its goal where one exists."""
    models, pipes, pad = report["model_vs_pytorch"], report["pipeline"], report["padding"]
    ratio, speedup = models["ratio"], pipes["speedup"]
    rows = [
        row("step, ours", f"{models['ours_step_seconds']:.4f} s"),
        row("step, torch.nn.Transformer", f"{models['pytorch_step_seconds']:.4f} s"),
        row("step ratio ours / PyTorch", f"{ratio:.3f}", "<= 1.10", ratio <= 1.10),
        *(
            [
                row("step, ours compiled", f"{models['compiled_step_seconds']:.4f} s"),
                row("compiled / eager", f"{models['compiled_ratio']:.3f}"),
                row("compile round", f"{models['compiled_warmup_round_seconds']:.0f} s"),
            ]
            if "compiled_ratio" in models
            else []
        ),
        row("pipeline, ours", f"{pipes['ours']['tokens_per_second']:,.0f} tok/s"),
        row("pipeline, reference", f"{pipes['reference']['tokens_per_second']:,.0f} tok/s"),
        row(
            "pipeline speedup",
            f"{speedup:.1f}x",
            ">= 30x on GPU",
            speedup >= 30 if device.type == "cuda" else None,
        ),
        row("padding efficiency, ours", f"{pad['ours']:.1%}"),
        row("padding efficiency, reference", f"{pad['reference']:.1%}"),
    ]
    if "skipped" in report["decoding"]:
        rows.append(row("decoding", "skipped"))
    else:
        rows += decoding_rows(report["decoding"])
    return [*rows, row("peak memory", f"{report['peak_memory_mb']:,.0f} MB")]


def decoding_rows(dec: dict) -> list[tuple]:
    """Rows of the decoding figures; the goals are for all 1,000 test2016 sentences."""
    n, k, first = dec["sentences"], dec["beam_size"], dec["beam_first_sentences"]
    greedy, beam = dec["greedy_seconds"], dec["beam_seconds"]
    full = n == 1000
    return [
        row(f"greedy, {n} sentences", f"{greedy:.1f} s", "<= 10 s", greedy <= 10 if full else None),
        row(f"greedy uncached, {n} sentences", f"{dec['greedy_plain_seconds']:.1f} s"),
        row(f"beam {k}, {n} sentences", f"{beam:.1f} s", "<= 60 s", beam <= 60 if full else None),
        row(f"beam {k} uncached, first {first}", f"{dec['beam_first_plain_seconds']:.1f} s"),
        row(f"beam {k} cached, first {first}", f"{dec['beam_first_seconds']:.1f} s"),
        row(
            "cached output = uncached",
            f"greedy {dec['greedy_identical']}, beam {dec['beam_identical']}",
        ),
    ]


def table(rows: list[tuple]) -> str:
    """A markdown table of the rows."""
    marks = {True: "yes", False: "NO", None: ""}
    lines = ["| figure | value | goal | met |", "|---|---|---|---|"]
    lines += [f"| {f} | {v} | {g} | {marks[m]} |" for f, v, g, m in rows]
    return "\n".join(lines)


def summary(report: dict) -> dict:
    """The headline figures that DESIGN.md lists, at the top of bench.json."""
    dec = report["decoding"]
    return {
        "model_vs_pytorch_step_ratio": report["model_vs_pytorch"]["ratio"],
        "pipeline_speedup_vs_reference_loop": report["pipeline"]["speedup"],
        "padding_efficiency_ours": report["padding"]["ours"],
        "padding_efficiency_reference": report["padding"]["reference"],
        "greedy_test2016_seconds": dec.get("greedy_seconds"),
        "beam4_test2016_seconds": dec.get("beam_seconds"),
        "peak_memory_mb": report["peak_memory_mb"],
    }


def main(argv=None) -> None:
    """Run the four comparisons, write the JSON report and print the table."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings, device = at.get_settings(args.preset), at.pick_device()
    sizes, tokenizers = SIZES[settings.name], at.make_tokenizers()
    print(f"bench: preset {settings.name!r} on {device}, {args.repeats} repeats")
    data = at.prepare_data(settings, args.data_dir)
    text, tokens = training_text(data, args.data_dir, tokenizers)
    report = {"preset": settings.name, "device": str(device)}
    print("1/4 training step: our model against torch.nn.Transformer")
    report["model_vs_pytorch"] = compare_models(
        settings, data, device, sizes, args.repeats, compile_too=args.compile
    )
    print("2/4 pipeline: ours against the reference loop")
    race = race_pairs(settings, text, tokens, data.vocabs, sizes)
    report["pipeline"] = compare_pipelines(
        settings, race, tokenizers, data.vocabs, device, args.repeats
    )
    print("3/4 padding efficiency")
    report["padding"] = compare_padding(settings, data, tokens)
    print("4/4 decoding")
    report["decoding"] = decoding(settings, data, device, args.data_dir)
    if "skipped" in report["decoding"]:
        print(report["decoding"]["skipped"])
    report["memory"] = peak_memory(device)
    memory = report["memory"]
    report["peak_memory_mb"] = memory.get("cuda_max_allocated_mb", memory["peak_rss_mb"])
    report["machine"] = machine(settings, device)
    report = summary(report) | report
    at.write_atomically(args.out, json.dumps(report, indent=2).encode())
    print(table(goal_rows(report, device)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

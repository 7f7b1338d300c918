"""Benchmarks of the notebook's model, data pipeline and decoding; writes build/bench.json.

    make bench                                  # the preset for this machine (or AT_PRESET)
    .venv/bin/python tools/bench.py --preset smoke --repeats 2 --out /tmp/bench.json
    .venv/bin/python tools/bench.py --compile   # also our model under torch.compile

It measures what `make run` does, with the notebook's functions from its `.py` twin.
Training runs in the preset's precision (or --precision), with the run's loss, through
the notebook's `at.run_epoch`, which clips and steps as a run does; decoding loads the
run's finished model from its folder (`plumbing.run_folder`) and goes through the run's
own `at.evaluate_test`, with the preset's beam size and length penalty.

Four comparisons, each measured side by side in one run because machines are noisy:
warm-up excluded, the median of several repeats, the two contenders interleaved.

1. one training step of our model against torch.nn.Transformer of the same size, both
   in the run's precision; from it, the model FLOPs per second and the MFU: their share
   of this machine's matrix-multiply throughput, measured in the same precision;
2. target tokens per second of our data pipeline and loop against a loop set up as the
   well-known 2022 notebook sets it up (72-token padding, 32 sentences, spaCy in the
   DataLoader's collate, dense KL label smoothing), in the same precision as ours;
3. the share of real tokens in training batches for both pipelines;
4. greedy and beam decoding of test2016 with the run's trained model, with and
   without cached keys and values.

Peak memory and the machine's facts go into the same JSON file; the README's Performance
section explains the figures.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import annotated_transformer as at  # noqa: E402  (defines names, runs nothing)
import plumbing  # noqa: E402
from plumbing import peak_memory_gb, prepare_cpu_memory, read_checkpoint  # noqa: E402


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
# The machine's limit for the MFU: one square product of this size, large enough that a
# CPU's or GPU's matrix units run at full speed; the best of MATMUL_REPEATS per repeat of
# the steps, or of as many as fit in MATMUL_SECONDS per repeat (bf16 forced on a CPU without
# bf16 units takes a minute each).
MATMUL_SIZE = {"cpu": 2048, "mps": 2048, "cuda": 8192}
MATMUL_REPEATS, MATMUL_SECONDS = 3, 1.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the products' inputs


def parse_args(argv=None) -> argparse.Namespace:
    """The command line: preset, repeats, output file, data folder and threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="smoke, cpu or gpu (default: AT_PRESET, then auto)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("AT_BUILD_DIR", "build")) / "bench.json"
    )
    parser.add_argument("--data-dir", type=Path, default=at.DATA_DIR, help="data and checkpoints")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--precision",
        choices=sorted(DTYPES),
        help="train in this precision (default: the preset's; "
        "bf16 on a CPU without bf16 instructions is very slow)",
    )
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
    elif device.type == "mps":
        torch.mps.synchronize()


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
    optimizer, schedule = at.make_optimizer(model, settings, fused=fused, total_steps=end)
    return model, optimizer, schedule


def run_loss(settings: at.Settings, data: at.Multi30k) -> nn.Module:
    """The label-smoothed loss that the notebook's `train` builds."""
    en = data.vocabs["en"]
    return at.FastLabelSmoothing(len(en), en.pad_id)


# 1. Our model against torch.nn.Transformer


class TorchTransformer(nn.Module):
    """torch.nn.Transformer between our embeddings, positions and tied generator.

    It takes the same arguments as our EncoderDecoder, so at.batch_loss runs it, but it
    builds its masks from the tokens in PyTorch's convention: True where NOT allowed.
    """

    def __init__(self, settings: at.Settings, vocabs: dict):
        super().__init__()
        # a fresh model of ours lends its embeddings, positions and generator (tied to the
        # target embedding), so only the stacks between them differ
        ours = at.model_for(settings, vocabs)
        self.src_embed, self.tgt_embed, self.generator = (
            ours.src_embed,
            ours.tgt_embed,
            ours.generator,
        )
        self.src_pad_id, self.tgt_pad_id = vocabs["de"].pad_id, vocabs["en"].pad_id
        self.transformer = nn.Transformer(
            d_model=settings.d_model,
            nhead=settings.h,
            num_encoder_layers=settings.N,
            num_decoder_layers=settings.N,
            dim_feedforward=settings.d_ff,
            dropout=settings.dropout,
            batch_first=True,
            norm_first=settings.pre_norm,
        )
        for p in self.transformer.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)  # as make_model initialises ours

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


def autocast_for(device, precision: str):
    """The autocast context factory that the notebook's `train` builds."""
    return functools.partial(
        torch.autocast, device.type, torch.bfloat16, enabled=precision == "bf16"
    )


def as_a_run_trains(settings: at.Settings, device, precision: str) -> dict:
    """The clipping and mixed precision that the notebook's `train` gives run_epoch."""
    return {
        "clip_norm": settings.clip_norm,
        "autocast": autocast_for(device, precision),
    }


def train_round(training, criterion, batches, settings: at.Settings, precision: str) -> float:
    """Mean seconds of one training step (forward, backward, clipping, Adam) over the batches.

    Each batch is one optimizer step through the notebook's own loop, as a run takes it.
    """
    model, optimizer, schedule = training
    device = next(model.parameters()).device

    options = as_a_run_trains(settings, device, precision)

    def steps():
        at.run_epoch(batches, model, criterion, optimizer, schedule, **options)

    seconds, _ = timed(device, steps)
    return seconds / len(batches)


class FusedAttention(at.MultiHeadAttention):
    """The lesson's attention block on PyTorch's fused kernel, F.scaled_dot_product_attention.

    A fused kernel computes softmax(Q K^T / sqrt(d_k)) V in one routine, without writing
    the (T_q, T_k) weights out to memory between steps. Same weights, same function: only
    `attend` differs. Under bf16 autocast on a CPU it runs the lesson's own attention
    instead, because the fused kernel's bf16 backward pass is slow there.
    """

    def attend(self, q, k, v, mask):
        if torch.is_autocast_enabled("cpu"):
            return super().attend(q, k, v, mask)
        mask = None if mask is None else mask.unsqueeze(1)  # one mask for every head
        p = self.dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.w_o(out.transpose(1, 2).flatten(2))  # Concat, then W^O


def with_fused_attention(model: nn.Module) -> nn.Module:
    """`model` itself, every attention block now a FusedAttention: same weights, in place."""
    for block in model.modules():
        if isinstance(block, at.MultiHeadAttention):
            block.__class__ = FusedAttention
    return model


def compiled(training):
    """The same training triple with the model wrapped by torch.compile (dynamic shapes)."""
    model, optimizer, schedule = training
    return torch.compile(model, dynamic=True), optimizer, schedule


def compare_models(settings, data, device, sizes: Sizes, *, repeats, precision, compile_too=False):
    """Median training-step time of our model and of nn.Transformer, rounds interleaved.

    Both train in `precision`. With compile_too, a third contender is our model under
    torch.compile; its first round (the warm-up, untimed in the medians) includes the
    compilation.
    """
    vocabs, batches = data.vocabs, fixed_batches(data, settings, sizes.step_batches, device)
    criterion = run_loss(settings, data)
    fused = lambda: with_fused_attention(at.model_for(settings, vocabs))  # noqa: E731
    contenders = {
        "ours": fresh_training(settings, lambda: at.model_for(settings, vocabs), device),
        "pytorch": fresh_training(settings, lambda: TorchTransformer(settings, vocabs), device),
        "ours_fused": fresh_training(settings, fused, device),  # PyTorch's attention kernel
    }
    if compile_too:
        build = lambda: at.model_for(settings, vocabs)  # noqa: E731
        contenders["ours_compiled"] = compiled(fresh_training(settings, build, device))
    rounds = {name: [] for name in contenders}
    warmup = {}
    for repeat in range(repeats + 1):  # round 0 is the warm-up
        for name, training in contenders.items():
            seconds = train_round(training, criterion, batches, settings, precision)
            if repeat > 0:
                rounds[name].append(seconds)
            else:
                warmup[name] = seconds * len(batches)
    ours, pytorch = statistics.median(rounds["ours"]), statistics.median(rounds["pytorch"])
    fused_seconds = statistics.median(rounds["ours_fused"])
    model = contenders["ours"][0]
    step_flops = training_flops(model, settings, batches, vocabs["en"].pad_id) / len(batches)
    return {
        "precision": precision,
        "ours_step_seconds": ours,
        "pytorch_step_seconds": pytorch,
        "ratio": ours / pytorch,
        "ours_parameters": at.count_parameters(contenders["ours"][0]),
        "pytorch_parameters": at.count_parameters(contenders["pytorch"][0]),
        "batches": len(batches),
        "real_target_tokens_per_round": sum(b.ntokens for b in batches),
        "model_flops_per_step": step_flops,
        "ours_round_step_seconds": rounds["ours"],
        "pytorch_round_step_seconds": rounds["pytorch"],
        # our model with the lesson's attention() against PyTorch's fused kernel in its place
        "fused_step_seconds": fused_seconds,
        "attention_vs_fused_ratio": ours / fused_seconds,
        "fused_round_step_seconds": rounds["ours_fused"],
        **(
            {
                "compiled_step_seconds": statistics.median(rounds["ours_compiled"]),
                "compiled_ratio": statistics.median(rounds["ours_compiled"]) / ours,
                "compiled_warmup_round_seconds": warmup["ours_compiled"],
            }
            if "ours_compiled" in rounds
            else {}
        ),
        "note": "nn.Transformer adds a final LayerNorm to both stacks even in post-norm "
        "and drops out the feed-forward hidden activations; the paper and our model do "
        "neither. Under bf16 autocast on a CPU our attention leaves PyTorch's fused kernel "
        "(slow to backpropagate in bf16 there); nn.Transformer keeps it",
    }


# MFU: the model's arithmetic against the machine's


def weight_matrix_parameters(module: nn.Module) -> int:
    """Entries of the module's weight matrices: biases and LayerNorm gains are not products."""
    return sum(p.numel() for p in module.parameters() if p.dim() > 1)


def training_flops(model, settings: at.Settings, batches: list, pad_id: int) -> float:
    """Model FLOPs of a forward and backward pass over the batches: the products the
    model needs for its real tokens, not what the kernels do (padding is not counted).

    A product of an (m x k) and a (k x n) matrix is 2mkn FLOPs, a multiply and an add per
    term. A weight matrix with P entries applied to one token costs 2P forward and 4P
    backward (the gradients of its input and of itself): 6P a token. The encoder's
    matrices run over the real source tokens; the decoder's and the generator's over the
    real target tokens. (The decoder's encoder-decoder attention projects the memory with
    W^K and W^V, which really run over the source tokens; we count them with the target's,
    which differ in number by a few percent in Multi30k.) Embedding lookups, biases, layer
    norms, softmax and Adam are left out, as MFU usually leaves them: element-wise work.

    Attention's own products, in each layer, per query-key pair: Q K^T is d_k
    multiply-adds for each of the h heads, 2 d_model FLOPs; the weights times V another
    2 d_model. Forward 4 d_model, backward twice that (two products each): 12 d_model. The
    pairs between real tokens, per sentence of S source and T target tokens: S^2 in each
    encoder layer's self-attention; T (T + 1) / 2 in each decoder layer's masked
    self-attention (a position attends to itself and those before it); T S in each
    encoder-decoder attention.
    """
    per_source_token = 6 * weight_matrix_parameters(model.encoder)
    per_target_token = 6 * (
        weight_matrix_parameters(model.decoder) + weight_matrix_parameters(model.generator)
    )
    per_pair = 12 * settings.d_model * settings.N  # all N layers of one stack
    flops = 0
    for batch in batches:
        S = (batch.src != pad_id).sum(dim=1)  # (B,) real source tokens with <s> and </s>
        T = (batch.tgt_out != pad_id).sum(dim=1)  # (B,) real target tokens predicted
        flops += per_source_token * int(S.sum()) + per_target_token * int(T.sum())
        pairs = S * S + T * (T + 1) // 2 + T * S  # (B,) encoder, decoder, encoder-decoder
        flops += per_pair * int(pairs.sum())
    return float(flops)


def matmul_throughput(device: torch.device, precision: str, repeats: int) -> dict:
    """FLOPs per second of one large square product in the training precision, best time.

    This is the machine's practical ceiling for the model's products: on a CPU, its vector
    or matrix units (AMX for bf16 where the CPU has them) on all of torch's threads.
    """
    n = MATMUL_SIZE[device.type]
    a, b = (torch.randn(n, n, device=device, dtype=DTYPES[precision]) for _ in range(2))
    times = [timed(device, lambda: torch.mm(a, b))[0]]  # the first one only warms up
    while len(times) <= MATMUL_REPEATS * repeats and (
        len(times) < 2 or sum(times) < MATMUL_SECONDS * repeats
    ):
        times.append(timed(device, lambda: torch.mm(a, b))[0])
    best = min(times[1:])
    return {"size": n, "precision": precision, "best_seconds": best, "flops": 2 * n**3}


def utilisation(models: dict, matmul: dict) -> dict:
    """Model FLOPs per second of our training step and of PyTorch's, and their MFU."""
    peak = matmul["flops"] / matmul["best_seconds"]
    ours = models["model_flops_per_step"] / models["ours_step_seconds"]
    pytorch = models["model_flops_per_step"] / models["pytorch_step_seconds"]
    return {
        "model_flops_per_second": ours,
        "matmul_flops_per_second": peak,
        "mfu": ours / peak,
        "pytorch_mfu": pytorch / peak,
        "matmul": matmul,
        "how": "model FLOPs: 6 per weight-matrix entry per real token (encoder: source "
        "tokens; decoder and generator: target tokens) plus 12 d_model per query-key pair "
        "of real tokens in each attention layer (masked self-attention: the causal half); "
        "forward and backward. Divided by the FLOPs per second of one large torch.mm in the "
        "same precision, measured in the same run",
    }


# 2. Our data pipeline and loop against the 2022 notebook's


def training_text(settings, data_dir: Path, tokenizers: dict):
    """Raw text and spaCy tokens of the preset's training pairs, long ones included."""
    text = at.load_pairs("train", data_dir)[: settings.train_pairs]
    return text, at.tokenize_pairs(text, tokenizers)


def race_pairs(settings, text, tokens, vocabs, sizes: Sizes) -> dict:
    """The same pairs for both pipelines, as raw text and as ids: warm-up and timed.

    Pairs are drawn in a seeded random order, skipping any longer than our max_train_len or
    the reference's 72 tokens, so that neither pipeline drops or cuts a token of them.
    """
    limit = min(at.MAX_TRAIN_LEN, REFERENCE["max_padding"])
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


def run_reference(text_pairs, training, tokenizers, settings, vocabs, *, precision: str):
    """One pass of the reference loop over raw text; returns what it trained on.

    It keeps the reference's recipe (no gradient clipping) but runs in our precision, so
    that the comparison is one of pipelines, not of number formats.
    """
    model, optimizer, schedule = training
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(
        text_pairs,
        batch_size=REFERENCE["batch_size"],
        shuffle=True,
        generator=torch.Generator().manual_seed(settings.seed),
        collate_fn=functools.partial(reference_collate, tokenizers=tokenizers, vocabs=vocabs),
    )
    criterion = at.LabelSmoothing(len(vocabs["en"]), vocabs["en"].pad_id)
    # the loader tokenizes and pads as it is drawn; run_epoch needs each optimizer step's
    # token count up front, so the epoch's batches are drawn first (inside the timing)
    batches = [batch.to(device) for batch in loader]
    at.run_epoch(
        batches,
        model,
        criterion,
        optimizer,
        schedule,
        accum_iter=REFERENCE["accum_iter"],
        autocast=autocast_for(device, precision),
    )
    return counted(batches)


def counted(batches) -> dict:
    """What one pass over `batches` trained on: real target tokens, sentences, batches."""
    return {
        "tokens": sum(b.ntokens for b in batches),
        "samples": sum(b.src.size(0) for b in batches),
        "micro_batches": len(batches),
    }


def run_ours(pairs, training, settings, vocabs, criterion, *, precision: str) -> dict:
    """One pass of our pipeline and loop over cached ids, as a run trains (with the run's
    loss, `criterion`); returns what it trained on."""
    model, optimizer, schedule = training
    device, pad_id = next(model.parameters()).device, vocabs["en"].pad_id
    indices = at.bucket_batches(pairs, settings.batch_tokens, seed=settings.seed, epoch=0)
    batches = [at.collate(pairs, b, pad_id).to(device) for b in indices]
    at.run_epoch(
        batches,
        model,
        criterion,
        optimizer,
        schedule,
        accum_iter=settings.accum_iter,
        **as_a_run_trains(settings, device, precision),
    )
    return counted(batches)


def compare_pipelines(
    settings, race, tokenizers, vocabs, device, *, criterion, repeats, precision
) -> dict:
    """Target tokens per second of both pipelines on the same pairs, runs interleaved.

    Both train in `precision`; ours with the run's loss, `criterion`. Every run trains a
    fresh model (same seed), built before the clock starts.
    """

    def run(name: str, part: str) -> tuple[float, dict]:
        training = fresh_training(settings, lambda: at.model_for(settings, vocabs), device)
        if name == "ours":
            pairs = race[part]["ids"]
            return timed(
                device,
                lambda: run_ours(pairs, training, settings, vocabs, criterion, precision=precision),
            )
        text = race[part]["text"]
        return timed(
            device,
            lambda: run_reference(
                text, training, tokenizers, settings, vocabs, precision=precision
            ),
        )

    names = ("ours", "reference")
    for name in names:
        run(name, "warmup")  # other pairs than the timed ones
    seconds, counts = {name: [] for name in names}, {}
    for _ in range(repeats):
        for name in names:
            elapsed, counts[name] = run(name, "timed")
            seconds[name].append(elapsed)
    if counts["ours"]["tokens"] != counts["reference"]["tokens"]:
        raise RuntimeError(f"the pipelines saw different target token counts: {counts}")
    result = {
        name: {
            "tokens_per_second": counts[name]["tokens"] / statistics.median(seconds[name]),
            "real_target_tokens": counts[name]["tokens"],
            "sentences": counts[name]["samples"],
            "batches": counts[name]["micro_batches"],
            "seconds": seconds[name],
        }
        for name in names
    }
    result["ours"]["accum_iter"] = settings.accum_iter
    result["reference"].update(REFERENCE, loss="LabelSmoothing (dense KL)", clip_norm=None)
    result["precision"] = precision
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
        f"over the training pairs kept by MAX_TRAIN_LEN={at.MAX_TRAIN_LEN}. Reference: every "
        f"training pair, each side cut to {width} tokens and padded to {width}",
    }


# 4. Decoding


def timed_translate(model, sources, vocabs, device, **options):
    """(seconds, outputs) of at.translate."""
    return timed(device, lambda: at.translate(model, sources, vocabs, **options))


def decoding(settings, data: at.Multi30k, device, data_dir: Path) -> dict:
    """Greedy and beam decoding of the test split as `make run` decodes it (its own
    at.evaluate_test, which also scores BLEU), and cached against plain recomputation
    with the same keywords: the preset's beam size and length penalty. The model is the
    finished run in its folder under data_dir, as `make run` left it."""
    folder = plumbing.run_folder(settings, data, vars(at), data_dir)
    last = folder / "last.pt"
    if not last.is_file() or len(read_checkpoint(last)["history"]) < settings.epochs:
        return {
            "skipped": f"no trained model in {folder}: "
            f"run `AT_PRESET={settings.name} make run` first"
        }
    model = at.train(settings, data, folder, device=device)[0].eval()  # finished: it loads
    vocabs, sources = data.vocabs, [src for src, _ in data.test]
    first = sources[:PLAIN_BEAM_SENTENCES]
    alpha = settings.length_penalty
    greedy = {"search": at.greedy_decode}  # evaluate_test's two calls
    beam = {"search": functools.partial(at.beam_search, beam_size=settings.beam_size, alpha=alpha)}
    for cached in (True, False):  # warm-up
        at.translate(model, sources[:8], vocabs, cached=cached, **greedy)
        at.translate(model, sources[:8], vocabs, cached=cached, **beam)
    run = at.evaluate_test(model, data, settings)  # greedy, then beam: timed and scored
    greedy_plain, greedy_plain_out = timed_translate(
        model, sources, vocabs, device, cached=False, **greedy
    )
    greedy_cached, greedy_out = timed_translate(
        model, sources, vocabs, device, cached=True, **greedy
    )
    plain_first, plain_first_out = timed_translate(
        model, first, vocabs, device, cached=False, **beam
    )
    cached_first, cached_first_out = timed_translate(
        model, first, vocabs, device, cached=True, **beam
    )
    same = {
        "greedy": sum(a == b for a, b in zip(greedy_out, greedy_plain_out, strict=True)),
        "beam": sum(a == b for a, b in zip(cached_first_out, plain_first_out, strict=True)),
    }
    return {
        "sentences": len(sources),
        "beam_size": settings.beam_size,
        "alpha": alpha,
        "greedy_seconds": run["greedy_seconds"],
        "beam_seconds": run["beam_seconds"],
        "test2016_bleu_greedy": run["test2016_bleu_greedy"],
        "test2016_bleu_beam": run["test2016_bleu_beam"],
        "bleu_signature": run["bleu_signature"],
        "greedy_cached_seconds": greedy_cached,
        "greedy_plain_seconds": greedy_plain,
        "greedy_speedup": greedy_plain / greedy_cached,
        "greedy_same_sentences": same["greedy"],
        "greedy_identical": same["greedy"] == len(sources),
        "beam_first_sentences": len(first),
        "beam_first_seconds": cached_first,
        "beam_first_plain_seconds": plain_first,
        "beam_speedup": plain_first / cached_first,
        "beam_same_sentences": same["beam"],
        "beam_identical": same["beam"] == len(first),
    }


# 5 and 6. Memory and the machine


def peak_memory(device: torch.device) -> dict:
    """Peak resident memory of this process, and peak CUDA memory allocated if any, in MB
    (10^6 bytes); the resident figure is None where the system cannot say (Windows)."""
    resident = peak_memory_gb()
    memory = {"peak_rss_mb": None if resident is None else resident * 1e3}
    if device.type == "cuda":
        memory["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 1e6
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


MFU_MEANING = (
    "MFU: the share of this machine's own matrix-multiply speed (same precision) that "
    "training turns into the model's arithmetic; far below 100%, more speed can still come "
    "from the code (larger products, fewer small operations), near 100% only from the hardware."
)


def goal_rows(report: dict, device: torch.device) -> list[tuple]:
    """The table's rows: each figure, and its goal where one exists."""
    models, pipes, pad = report["model_vs_pytorch"], report["pipeline"], report["padding"]
    ratio, speedup, util = models["ratio"], pipes["speedup"], report["utilisation"]
    precision, matmul = report["precision"], report["utilisation"]["matmul"]
    rows = [
        row("training precision", f"{precision} ({precision_source(report)})"),
        row("step, ours", f"{models['ours_step_seconds']:.4f} s"),
        row("step, torch.nn.Transformer", f"{models['pytorch_step_seconds']:.4f} s"),
        row("step ratio ours / PyTorch", f"{ratio:.3f}", "<= 1.10", ratio <= 1.10),
        row("step, ours with PyTorch's fused attention", f"{models['fused_step_seconds']:.4f} s"),
        row("step ratio our attention / fused", f"{models['attention_vs_fused_ratio']:.3f}"),
        *(
            [
                row("step, ours compiled", f"{models['compiled_step_seconds']:.4f} s"),
                row("compiled / eager", f"{models['compiled_ratio']:.3f}"),
                row("compile round", f"{models['compiled_warmup_round_seconds']:.0f} s"),
            ]
            if "compiled_ratio" in models
            else []
        ),
        row(
            "model FLOP/s in a training step, ours", f"{util['model_flops_per_second'] / 1e9:.1f} G"
        ),
        row(
            f"matmul FLOP/s, {matmul['size']}x{matmul['size']} {matmul['precision']}",
            f"{util['matmul_flops_per_second'] / 1e9:.1f} G",
        ),
        row("MFU, ours (PyTorch's)", f"{util['mfu']:.1%} ({util['pytorch_mfu']:.1%})"),
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
    memory = report["peak_memory_mb"]
    return [*rows, row("peak memory", "unknown" if memory is None else f"{memory:,.0f} MB")]


def precision_source(report: dict) -> str:
    """Where the training precision came from, in a few words."""
    return "--precision" if report["precision_forced"] else "the preset's, as make run trains"


def decoding_rows(dec: dict) -> list[tuple]:
    """Rows of the decoding figures; the goals are for all 1,000 test2016 sentences."""
    n, k, first = dec["sentences"], dec["beam_size"], dec["beam_first_sentences"]
    greedy, beam, alpha = dec["greedy_seconds"], dec["beam_seconds"], dec["alpha"]
    full = n == 1000
    return [
        row(f"greedy, {n} sentences", f"{greedy:.1f} s", "<= 10 s", greedy <= 10 if full else None),
        row(f"greedy uncached, {n} sentences", f"{dec['greedy_plain_seconds']:.1f} s"),
        row(
            f"beam {k} (alpha {alpha:g}), {n} sentences",
            f"{beam:.1f} s",
            "<= 60 s",
            beam <= 60 if full else None,
        ),
        row(f"beam {k} uncached, first {first}", f"{dec['beam_first_plain_seconds']:.1f} s"),
        row(f"beam {k} cached, first {first}", f"{dec['beam_first_seconds']:.1f} s"),
        row(
            "cached output = uncached (sentences)",
            f"greedy {dec['greedy_same_sentences']}/{n}, beam {dec['beam_same_sentences']}/{first}",
        ),
        row(
            "test2016 BLEU, greedy / beam",
            f"{dec['test2016_bleu_greedy']:.1f} / {dec['test2016_bleu_beam']:.1f}",
        ),
    ]


def table(rows: list[tuple]) -> str:
    """A markdown table of the rows."""
    marks = {True: "yes", False: "NO", None: ""}
    lines = ["| figure | value | goal | met |", "|---|---|---|---|"]
    lines += [f"| {f} | {v} | {g} | {marks[m]} |" for f, v, g, m in rows]
    return "\n".join(lines)


def summary(report: dict) -> dict:
    """The headline figures (the `build/bench.json` contract's, then the MFU's), at the top."""
    dec, util = report["decoding"], report["utilisation"]
    return {
        "model_vs_pytorch_step_ratio": report["model_vs_pytorch"]["ratio"],
        "attention_vs_fused_step_ratio": report["model_vs_pytorch"]["attention_vs_fused_ratio"],
        "pipeline_speedup_vs_reference_loop": report["pipeline"]["speedup"],
        "padding_efficiency_ours": report["padding"]["ours"],
        "padding_efficiency_reference": report["padding"]["reference"],
        "greedy_test2016_seconds": dec.get("greedy_seconds"),
        "beam4_test2016_seconds": dec.get("beam_seconds"),
        "peak_memory_mb": report["peak_memory_mb"],
        "precision": report["precision"],
        "model_flops_per_second": util["model_flops_per_second"],
        "matmul_flops_per_second": util["matmul_flops_per_second"],
        "mfu": util["mfu"],
    }


def training_precision(args, settings, data, device) -> dict:
    """The precision of every training figure: --precision, else the preset's."""
    return {
        "precision": args.precision or settings.precision,
        "precision_forced": bool(args.precision),
        "precision_calibration": None if args.precision else "the preset's setting",
    }


def main(argv=None) -> None:
    """Run the four comparisons, write the JSON report and print the table."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings, device = at.get_settings(args.preset), at.pick_device()
    prepare_cpu_memory()  # as `make run` does before training (plumbing.py says why)
    sizes, tokenizers = SIZES[settings.name], at.make_tokenizers()
    print(f"bench: preset {settings.name!r} on {device}, {args.repeats} repeats")
    data = at.prepare_data(settings, args.data_dir)
    text, tokens = training_text(settings, args.data_dir, tokenizers)
    report = {"preset": settings.name, "device": str(device)}
    report |= training_precision(args, settings, data, device)
    precision = report["precision"]
    print(f"1/4 training step in {precision}: our model against torch.nn.Transformer")
    matmul_before = matmul_throughput(device, precision, args.repeats)
    report["model_vs_pytorch"] = compare_models(
        settings,
        data,
        device,
        sizes,
        repeats=args.repeats,
        precision=precision,
        compile_too=args.compile,
    )
    # the machine's limit, timed before and after the steps; the faster of the two, in
    # case something else used the cores for a moment
    matmul = min(
        matmul_before,
        matmul_throughput(device, precision, args.repeats),
        key=lambda m: m["best_seconds"],
    )
    report["utilisation"] = utilisation(report["model_vs_pytorch"], matmul)
    print(f"2/4 pipeline in {precision}: ours against the reference loop")
    race = race_pairs(settings, text, tokens, data.vocabs, sizes)
    report["pipeline"] = compare_pipelines(
        settings,
        race,
        tokenizers,
        data.vocabs,
        device,
        criterion=run_loss(settings, data),
        repeats=args.repeats,
        precision=precision,
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
    print(MFU_MEANING)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

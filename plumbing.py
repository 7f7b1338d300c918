"""The plumbing under the notebook: files, checkpoints, machine facts, the exercises' checks.

Nothing here teaches the Transformer, so it lives outside the lesson. What it guarantees:

* every file it writes goes to a temporary file in the target folder that is renamed into
  place when complete, so a crash never leaves half a file under the real name;
* every Multi30k file is checked against the SHA-256 pinned here before it is read;
* every problem with an input raises one line (`DataError`, `CheckpointError`) that
  names the file and says what to do;
* checkpoints are read with `torch.load(weights_only=True)`: they cannot run code;
* a run's folder is named by what training reaches (`run_folder`, `code_reached`): the
  settings that shape it, the data, torch's version and the code that `train` calls.

This module never imports the notebook; the notebook imports it.
"""

import ast
import contextlib
import ctypes
import dataclasses
import gzip
import hashlib
import inspect
import io
import json
import math
import numbers
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import textwrap
import time
import types
import urllib.request
from pathlib import Path

import torch


class DataError(Exception):
    """A problem with an input file or folder; the message says what to do."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says what to do."""


# --- messages, in the notebook's language -------------------------------------------------

# The language of the messages below, and each English message's translation.
MESSAGES: dict = {"language": "en", "table": {}}


def use_language(language: str) -> None:
    """Say this project's messages in `language`, here and in the processes started from here:
    "en", or "zh_CN", which the Chinese notebook asks for. The translations are entries of
    context "messages" in the catalogue that translates the notebook (locale/zh_CN); where it
    or polib is missing, English."""
    table = {}
    path = Path(__file__).resolve().parent / "locale" / language / "LC_MESSAGES"
    try:
        import polib

        for catalogue in path.glob("*.po"):  # the one catalogue of the notebook
            entries = polib.pofile(str(catalogue)).translated_entries()
            table.update({e.msgid: e.msgstr for e in entries if e.msgctxt == "messages"})
    except (ImportError, OSError):
        pass  # English
    MESSAGES.update(language=language, table=table if language != "en" else {})
    os.environ["AT_LANGUAGE"] = language  # for the processes it starts: DDP's workers


def say(message: str, **fields) -> str:
    """`message` in the language that use_language chose, its {fields} filled in."""
    return MESSAGES["table"].get(message, message).format(**fields)


# --- files --------------------------------------------------------------------------------


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except PermissionError as error:
        raise DataError(
            say("cannot write {path}: the folder is not writable; fix its permissions", path=path)
        ) from error
    except (FileExistsError, NotADirectoryError) as error:
        blocker = next((p for p in [path.parent, *path.parent.parents] if p.is_file()), None)
        what = say("{blocker} is a file", blocker=blocker) if blocker else error.strerror.lower()
        raise DataError(
            say(
                "cannot create the folder {folder}: {what}; "
                "move it away or choose another data folder",
                folder=path.parent,
                what=what,
            )
        ) from error
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(temporary, 0o644)  # mkstemp makes files private; ours are for reading
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)  # never leave a half-written file behind
        raise


def fingerprint(value) -> str:
    """A short SHA-256 of a JSON-serialisable value: a cache key that changes with it."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


# --- Multi30k files -----------------------------------------------------------------------

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{name}"
SHA256 = {  # pinned when the project first fetched the files
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2018_flickr.de.gz": "ddd0130c7d97482dc5197a02141dae8dd79f20f03586c480d675c09a32daf608",
    "test_2018_flickr.en.gz": "ef4f4844037d4c5dea75c9a8ed5fd78905967a26f67c255e230cc9780032654d",
}


def download(name: str, target: Path, url_pattern: str = MULTI30K_URL) -> Path:
    """Download one file into `target`, checked, through a temporary file."""
    url = url_pattern.format(name=name)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except OSError as error:
        raise DataError(
            say(
                "could not download {url} ({error}): check the connection, or set MULTI30K_DIR "
                "to a folder that holds the Multi30k .gz files",
                url=url,
                error=error,
            )
        ) from error
    expected = SHA256.get(name)
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise DataError(say("download of {url} has the wrong SHA-256: try again later", url=url))
    write_atomically(target, data)
    return target


def split_file(split: str, lang: str, data_dir: Path = Path("data")) -> Path:
    """Path of `<split>.<lang>.gz`: from MULTI30K_DIR if set, else downloaded to data_dir;
    checked against its pinned SHA-256 either way."""
    name = f"{split}.{lang}.gz"
    mirror = os.environ.get("MULTI30K_DIR")
    if mirror:
        folder = Path(mirror)
        if not folder.is_dir():
            raise DataError(
                say(
                    "MULTI30K_DIR={mirror} is not a folder: point it at the Multi30k .gz files "
                    "or unset it to download them",
                    mirror=mirror,
                )
            )
        path = folder / name
        if not path.is_file():
            raise DataError(
                say("{path} is missing: copy {name} into {folder} or unset MULTI30K_DIR",
                    path=path, name=name, folder=folder)
            )  # fmt: skip
    else:
        path = Path(data_dir) / name
        if not path.is_file():
            download(name, path)
    expected = SHA256.get(name)
    if expected is not None and hashlib.sha256(path.read_bytes()).hexdigest() != expected:
        raise DataError(
            say("{path} has the wrong SHA-256 (damaged or altered): delete it and fetch it again",
                path=path)
        )  # fmt: skip
    return path


def read_lines(path: Path) -> list[str]:
    """Lines of a gzip-compressed UTF-8 text file, without line endings or a byte-order
    mark (which some editors put at the start of a UTF-8 file)."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except EOFError as error:
        raise DataError(
            say("{path} is truncated: delete it and fetch it again", path=path)
        ) from error
    except (OSError, gzip.BadGzipFile) as error:
        raise DataError(
            say("{path} is not a valid gzip file: delete it and fetch it again", path=path)
        ) from error
    try:
        return raw.decode("utf-8-sig").splitlines()  # -sig: drop a leading byte-order mark
    except UnicodeDecodeError as error:
        raise DataError(
            say("{path} is not UTF-8 text (byte {byte}): re-save it as UTF-8",
                path=path, byte=error.start)
        ) from error  # fmt: skip


def load_pairs(split: str, data_dir: Path = Path("data")) -> list[tuple[str, str]]:
    """(German, English) sentence pairs of a split; pairs with an empty side are skipped."""
    de_path, en_path = split_file(split, "de", data_dir), split_file(split, "en", data_dir)
    de, en = read_lines(de_path), read_lines(en_path)
    if len(de) != len(en):
        raise DataError(
            say(
                "{de_path} has {de} lines but {en_path} has {en}: "
                "the two files must be line-aligned; fetch both again",
                de_path=de_path, de=len(de), en_path=en_path, en=len(en),
            )
        )  # fmt: skip
    pairs = [(d.strip(), e.strip()) for d, e in zip(de, en, strict=True)]
    kept = [(d, e) for d, e in pairs if d and e]
    if len(kept) < len(pairs):
        print(say("{split}: skipped {n} pairs with an empty line", split=split,
                  n=len(pairs) - len(kept)))  # fmt: skip
    return kept


# --- the code that training reaches, for a run's name ------------------------------------

# A message, title or label (two words apart by a space, a comma, semicolon or colon between
# them allowed: " parameters, in "; or Chinese) is prose: the Chinese notebook translates it
# (tools/translations.py), and neither edition's wording changes what training computes, so
# a run's key leaves it out.
PROSE = r"[A-Za-z]{2,}[,;:]?\s+[A-Za-z]{2,}|[\u2e80-\u9fff\uff00-\uffef]"


def canonical(node) -> str:
    """A syntax tree as text, without positions, docstrings or fields that differ between
    Python 3.11, 3.12 and 3.13, so one piece of code reads the same on each. Prose (PROSE)
    is masked: only the fields of an f-string count, in any order."""
    if isinstance(node, list):
        return "[" + ", ".join(canonical(n) for n in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return "Expr()"  # a docstring, or a statement that computes nothing
    if isinstance(node, ast.Constant | ast.JoinedStr):
        parts = node.values if isinstance(node, ast.JoinedStr) else [node]
        words = "".join(p.value for p in parts if isinstance(getattr(p, "value", 0), str))
        if re.search(PROSE, words):
            fields = sorted(canonical(p) for p in parts if not isinstance(p, ast.Constant))
            return f"Prose({', '.join(fields)})"
    skip = {"ctx", "kind", "type_comment", "type_params"}
    fields = [(k, v) for k, v in ast.iter_fields(node) if k not in skip and v not in (None, [])]
    return f"{type(node).__name__}({', '.join(f'{k}={canonical(v)}' for k, v in fields)})"


def in_project(value) -> bool:
    """Whether a module, function or class is defined in a file of this project."""
    with contextlib.suppress(TypeError):  # built in, or a class of a kernel: no file
        return Path(inspect.getfile(value)).resolve().parent == Path(__file__).resolve().parent
    return False


def is_lesson_code(value, home: str) -> bool:
    """A function or class of the lesson (module `home`) or of a file of this project."""
    definition = inspect.isfunction(value) or isinstance(value, type)
    return definition and (value.__module__ == home or in_project(value))


def read_code(value, home: str) -> tuple[str, list[tuple[str, dict]]]:
    """A definition's code, and the names it uses, each with where to look it up.

    A function counts by its syntax tree, decorators and default arguments included; a name
    is looked up in its module, and in the project's modules it names (`trainer.save_last`). A
    class of the lesson counts by its bases, its dataclass fields and its members, so a
    method assigned in a later cell counts; the methods that @dataclass writes count by
    those fields. A class of a project file counts by its text in the file."""
    if isinstance(value, type) and value.__module__ == home:
        bases = [b.__qualname__ for b in value.__bases__]
        text = [f"class {value.__qualname__}{bases}", repr(vars(value).get("__annotations__"))]
        used = [(b.__name__, {b.__name__: b}) for b in value.__bases__]
        made = {"<string>", dataclasses.__file__}  # where @dataclass writes its methods
        for name, member in sorted(vars(value).items()):
            function = inspect.unwrap(getattr(member, "fget", getattr(member, "__func__", member)))
            if isinstance(member, int | float | str | bool | tuple | None) and name[:2] != "__":
                text.append(f"{name} = {member!r}")  # a field's default, or a constant
            elif inspect.isfunction(function) and function.__code__.co_filename in made:
                text.append(name)  # made from the fields
            elif inspect.isfunction(function) and is_lesson_code(function, home):  # no stand-in
                code, names = read_code(function, home)
                text, used = [*text, f"{name}: {code}"], used + names
        return "\n".join(text), used
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(value)))
    except (OSError, TypeError, SyntaxError) as error:
        raise CheckpointError(
            say("cannot read the code of {name} ({error}): define it in a cell or a file, "
                "so that the run's folder can be named by it", name=value.__qualname__,
                error=error)
        ) from error  # fmt: skip
    names = {getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(tree)} - {None}
    scope = vars(sys.modules[value.__module__]) if isinstance(value, type) else value.__globals__
    modules = [scope[n] for n in names if isinstance(scope.get(n), types.ModuleType)]
    scopes = [scope, *(vars(m) for m in modules if in_project(m))]
    return canonical(tree), [(n, s) for n in sorted(names) for s in scopes if n in s]


def code_reached(namespace: dict, roots=("train",)) -> dict[str, str]:
    """A hash of each function and class that `roots` reach, and the repr of each constant
    (a name in capitals), name by name.

    `namespace` is the notebook's (its `globals()`) or the twin's: an edited cell counts.
    A definition that training never calls (beam search, the heatmaps, Part 8's sentence)
    is not reached, so editing it keeps the trained model.
    """
    home = namespace.get("__name__")
    todo = [(name, namespace) for name in roots]
    found: dict[str, str] = {}
    while todo:
        name, scope = todo.pop()
        value = inspect.unwrap(scope[name]) if callable(scope.get(name)) else scope.get(name)
        module = scope.get("__name__", getattr(value, "__module__", home))
        label = name if module in (home, None) else f"{module}.{name}"
        if label in found or name not in scope:
            continue
        if is_lesson_code(value, home):
            code, used = read_code(value, home)
            found[label] = fingerprint(code)
            todo += used
        elif name.isupper() and isinstance(value, int | float | str | bool | tuple | frozenset):
            found[label] = repr(value)  # MAX_POSITIONS, SPECIALS and the like
    return dict(sorted(found.items()))


# --- a run's folder, named by what training reaches -------------------------------------


def manifest(settings, data, namespace: dict, roots=("train",)) -> dict:
    """What a run is made of. All but "python" and "torch build" name its folder: another
    torch release may compute otherwise, but the same code computes the same on every Python,
    and the folder names torch's release without the build's local tag (+cpu, +cu128), so
    that a run trained under one build loads under another (a teacher's run on a student's
    Mac). A run resumed under another build says so (trainer.load_last)."""
    vocabs = data.vocabs
    not_training = ("name", "beam_size", "length_penalty")  # they change no training step
    return {
        "settings": {
            k: v for k, v in dataclasses.asdict(settings).items() if k not in not_training
        },
        "data": {
            "vocabularies": fingerprint([vocabs["de"].itos, vocabs["en"].itos]),
            "training pairs": fingerprint(data.train),
        },
        "code": code_reached(namespace, roots),
        "torch": torch.__version__.split("+")[0],  # the release: 2.13.0 for 2.13.0+cpu
        "torch build": torch.__version__,  # recorded, not part of the name
        "python": platform.python_version(),  # recorded, not part of the name
    }


def run_folder(settings, data, namespace: dict, data_dir: Path, *, roots=("train",),
               retrain: bool = False) -> Path:  # fmt: skip
    """data/checkpoints/<preset>-<8 hex digits of the manifest>, with its manifest.json.

    `retrain=True` moves an earlier run of the same name into checkpoints/replaced/, so
    the next training starts afresh and nothing is lost."""
    made_of = manifest(settings, data, namespace, roots)
    key = fingerprint({k: v for k, v in made_of.items() if k not in ("python", "torch build")})
    folder = Path(data_dir) / "checkpoints" / f"{settings.name}-{key[:8]}"
    if retrain and folder.is_dir():
        kept = folder.parent / "replaced" / f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(folder, kept)
        print(say("moved the earlier run to {kept}", kept=kept))
    if (folder / "manifest.json").is_file():
        return folder
    earlier = list(folder.parent.glob(f"{settings.name}-*/manifest.json"))
    if earlier:  # a new folder beside earlier runs of the preset: say what changed since
        newest = json.loads(max(earlier, key=lambda m: m.stat().st_mtime).read_text())
        print(say("trained before with {changed}; this run trains anew",
                  changed=differences(made_of, newest)))  # fmt: skip
    write_atomically(folder / "manifest.json", json.dumps(made_of, indent=1).encode())
    return folder


def differences(mine: dict, theirs: dict) -> str:
    """How one run's manifest differs from another's, in a few words ("" if in nothing)."""
    changes = []
    for part in ("settings", "code"):
        ours, other = mine.get(part, {}), theirs.get(part, {})
        names = sorted(k for k in ours.keys() | other.keys() if ours.get(k) != other.get(k))
        listed = ", ".join(names[:5])
        if len(names) > 5:
            listed = say("{names} and {n} more", names=listed, n=len(names) - 5)
        if names and part == "settings":
            changes.append(say("other settings for: {names}", names=listed))
        elif names:
            changes.append(say("other code for: {names}", names=listed))
    data = {
        "vocabularies": say("other vocabularies"),
        "training pairs": say("other training pairs"),
    }
    for part in sorted(set(mine.get("data", {})) | set(theirs.get("data", {}))):
        if mine.get("data", {}).get(part) != theirs.get("data", {}).get(part):
            changes.append(data.get(part, part))
    if mine.get("torch") != theirs.get("torch"):
        changes.append(say("torch {mine} (was {theirs})", mine=mine.get("torch"),
                           theirs=theirs.get("torch")))  # fmt: skip
    return say("; ").join(changes)


# --- checkpoints --------------------------------------------------------------------------


def save_checkpoint(path: Path, **content) -> None:
    """torch.save to a buffer, then an atomic write: a crash never leaves half a file."""
    buffer = io.BytesIO()
    torch.save(content, buffer)
    write_atomically(path, buffer.getvalue())


def read_checkpoint(path: Path) -> dict:
    """torch.load with weights_only=True (tensors and plain containers, never code)."""
    if not Path(path).is_file():
        raise CheckpointError(
            say("{path} is missing: train the run first, or check the folder", path=path)
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            say("{path} is damaged or truncated ({kind}): delete it", path=path,
                kind=type(error).__name__)
        ) from error  # fmt: skip


# --- several processes --------------------------------------------------------------------


def distributed() -> bool:
    """Whether this process is one rank of a running distributed job."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_from_ranks(value) -> list:
    """`value` of every rank of a distributed job, in rank order ([value] in one process)."""
    if not distributed():
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def sum_over_ranks(values: list[float], device) -> list[float]:
    """Sum numbers over all ranks of a distributed job (unchanged in a single process)."""
    if not distributed():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total)
    return total.tolist()


def free_port() -> int:
    """A TCP port that is free right now, for the ranks to meet on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- machine facts and progress -----------------------------------------------------------


def prepare_cpu_memory() -> bool:
    """Settings of the C library and of oneDNN that make CPU training faster and leaner.

    Call it before the first bf16 matrix product. Two things, both first measured on a
    2-core Xeon with `cpu`-preset training batches in bf16 (one run each):

    * glibc serves every block over 32 MiB with its own mmap and unmaps it when freed,
      so each step's (tokens x vocabulary) tensors fault in fresh pages. Raising the
      mmap and trim thresholds to 256 MiB keeps such blocks for reuse: 4,712 target
      tokens/s against 3,743 over 50 batches. In float32, the cpu preset's precision, 60
      batches ran at 4,647 and 4,690 target tokens/s against 3,851 and 4,184 without it
      (a 2-core Zen 4 EPYC, two runs each, timed by hand and kept in no record: a rough
      guide). Where the C library is not glibc (macOS,
      Windows, musl) this part does nothing, and the function returns False.
    * bf16 products run through oneDNN, which caches a kernel for every matrix shape
      it meets, up to 1,024 of them, and batches of many sizes fill that cache. Capping
      it (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, read when oneDNN first runs) lowered the
      peak resident memory of a whole epoch from 3.15 GB to 2.15 GB at 64 kernels, and
      that of 100 batches from 2.13 GB at 64 to 1.76 GB at 16, at the same speed.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    size = 256 << 20
    try:
        return bool(libc.mallopt(m_mmap_threshold, size) and libc.mallopt(m_trim_threshold, size))
    except AttributeError:
        return False


def peak_memory_gb() -> float | None:
    """This process's peak resident memory so far, in GB (10^9 bytes); None on Windows."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9  # bytes or KiB


# --- the exercises' checks ----------------------------------------------------------------


def gap_is_empty(name: str, namespace: dict) -> bool:
    """Whether the learner's answer `name` in `namespace` still holds its gap: a `...` where
    the ✎ points. It says which answer the check below the cell will test."""
    answer = namespace.get(name, ...)
    if callable(answer):
        empty = re.search(r"\.\.\.\s*# ✎", inspect.getsource(answer)) is not None
    else:
        empty = answer is ...
    if empty:
        print(say("the check of {name} below tests our answer: your gap is still empty", name=name))
    else:
        print(say("the check of {name} below tests your answer", name=name))
    return empty


def shown(value) -> str:
    """An answer as a check names it: a tensor by its shape and first values, a number
    rounded, anything else by its repr, shortened."""
    if isinstance(value, torch.Tensor):
        first = ", ".join(map(shown, value.detach().flatten()[:6].tolist()))
        first += ", …" if value.numel() > 6 else ""
        kind = str(value.dtype).removeprefix("torch.")
        return say(
            "a tensor of {kind}, shape {shape}, [{values}]",
            kind=kind,
            shape=tuple(value.shape),
            values=first,
        )
    if isinstance(value, tuple):
        return "(" + ", ".join(map(shown, value)) + ")"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return f"{value:.6g}"
    text = repr(value)
    return text if len(text) <= 200 else text[:199] + "…"


def matches(yours, wanted, rel_tol: float) -> bool:
    """Whether an answer is the wanted one: a tensor of the same shape, or a tuple of the
    same length, with every number within `rel_tol`; a whole number exactly."""
    if isinstance(wanted, torch.Tensor):
        return (
            isinstance(yours, torch.Tensor)
            and yours.shape == wanted.shape
            and (yours.dtype == torch.bool) == (wanted.dtype == torch.bool)
            and torch.allclose(yours.double(), wanted.double(), rtol=rel_tol, atol=1e-6)
        )
    if isinstance(wanted, tuple):
        return (
            isinstance(yours, tuple)
            and len(yours) == len(wanted)
            and all(matches(a, b, rel_tol) for a, b in zip(yours, wanted, strict=True))
        )
    if isinstance(wanted, bool) or not isinstance(wanted, numbers.Real):
        return type(yours) is type(wanted) and yours == wanted
    if not isinstance(yours, numbers.Real) or isinstance(yours, bool):
        return False
    if isinstance(wanted, numbers.Integral):
        return yours == wanted
    return math.isclose(yours, wanted, rel_tol=rel_tol, abs_tol=1e-9)


def filled(answer):
    """An answer, after checking that its gap (✎) holds something."""
    assert answer is not ..., say(
        "the gap (✎) has no answer yet: write yours there, run that cell, then this one"
    )
    return answer


def expect(what: str, yours, wanted, hint: str, rel_tol: float = 1e-5) -> None:
    """Assert that a learner's answer is the wanted one. An empty gap says so; a wrong answer
    says in one line what was checked, yours, the expected one and a hint."""
    assert matches(filled(yours), wanted, rel_tol), say(
        "{what}: yours is {yours}, expected {wanted}; {hint}",
        what=what,
        yours=shown(yours),
        wanted=shown(wanted),
        hint=hint,
    )

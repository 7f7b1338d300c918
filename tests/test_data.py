"""Multi30k loading, tokenization cache, vocabulary and batching."""

import dataclasses
import gzip
import hashlib
import io
from pathlib import Path

import conftest
import pytest

import annotated_transformer as at
import plumbing


def write_gz(path: Path, text: str | bytes) -> Path:
    data = text.encode() if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data))
    return path


@pytest.fixture
def tiny_mirror(tmp_path, monkeypatch):
    """An empty MULTI30K_DIR; tests put files named tiny.<lang>.gz into it."""
    folder = tmp_path / "tiny_mirror"
    folder.mkdir()
    monkeypatch.setenv("MULTI30K_DIR", str(folder))
    return folder


def test_missing_mirror_folder_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(at.DataError, match="is not a folder: point it at") as error:
        at.load_pairs("train", tmp_path)
    assert "\n" not in str(error.value)


def test_missing_split_file(tiny_mirror):
    with pytest.raises(at.DataError, match=r"tiny\.de\.gz is missing"):
        at.load_pairs("tiny", tiny_mirror)


def test_truncated_gzip(tiny_mirror):
    full = gzip.compress(b"ein Hund\n" * 1000)
    (tiny_mirror / "tiny.de.gz").write_bytes(full[: len(full) // 2])
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\n" * 1000)
    with pytest.raises(at.DataError, match="is truncated: delete it"):
        at.load_pairs("tiny", tiny_mirror)


def test_corrupt_gzip(tiny_mirror):
    (tiny_mirror / "tiny.de.gz").write_bytes(b"this is not gzip at all")
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\n")
    with pytest.raises(at.DataError, match="is not a valid gzip file"):
        at.load_pairs("tiny", tiny_mirror)


def test_checksum_mismatch_is_reported_and_the_file_kept(tiny_mirror, monkeypatch):
    path = write_gz(tiny_mirror / "tiny.de.gz", "ein Hund\n")
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\n")
    monkeypatch.setitem(plumbing.SHA256, "tiny.de.gz", "0" * 64)
    before = path.read_bytes()
    with pytest.raises(at.DataError, match="wrong SHA-256"):
        at.load_pairs("tiny", tiny_mirror)
    assert path.read_bytes() == before


def test_line_counts_must_match(tiny_mirror):
    write_gz(tiny_mirror / "tiny.de.gz", "ein Hund\nzwei Hunde\n")
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\n")
    with pytest.raises(at.DataError, match="has 2 lines but .* has 1"):
        at.load_pairs("tiny", tiny_mirror)


def test_text_must_be_utf8(tiny_mirror):
    write_gz(tiny_mirror / "tiny.de.gz", "ein Hund\n".encode("utf-16"))
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\n")
    with pytest.raises(at.DataError, match="is not UTF-8 text"):
        at.load_pairs("tiny", tiny_mirror)


def test_empty_lines_are_skipped_with_a_count(tiny_mirror, capsys):
    write_gz(tiny_mirror / "tiny.de.gz", "ein Hund\n\nzwei Hunde\n")
    write_gz(tiny_mirror / "tiny.en.gz", "a dog\nsomething\ntwo dogs\n")
    assert at.load_pairs("tiny", tiny_mirror) == [("ein Hund", "a dog"), ("zwei Hunde", "two dogs")]
    assert "skipped 1 pairs with an empty line" in capsys.readouterr().out


def test_download_is_checked_and_atomic(tmp_path, monkeypatch):
    """A download cut off halfway leaves no file under the real name; a retry succeeds."""
    payload = gzip.compress(b"ein Hund\n")
    monkeypatch.setitem(plumbing.SHA256, "tiny.de.gz", hashlib.sha256(payload).hexdigest())

    class Broken(io.BytesIO):
        def read(self, *args):
            raise ConnectionResetError("connection reset halfway")

    responses = [Broken(payload[:5]), io.BytesIO(payload)]
    monkeypatch.setattr(plumbing.urllib.request, "urlopen", lambda url, timeout: responses.pop(0))
    target = tmp_path / "tiny.de.gz"
    with pytest.raises(at.DataError, match="could not download"):
        plumbing.download("tiny.de.gz", target)
    assert not target.exists() and list(tmp_path.iterdir()) == []
    plumbing.download("tiny.de.gz", target)
    assert target.read_bytes() == payload


@pytest.fixture
def published(monkeypatch):
    """Six small stand-ins for the Multi30k files, with their SHA-256 as the published ones."""
    names = [f"{split}.{lang}.gz" for split in conftest.SPLITS for lang in ("de", "en")]
    payloads = {name: gzip.compress(name.encode()) for name in names}
    for name, payload in payloads.items():
        monkeypatch.setitem(plumbing.SHA256, name, hashlib.sha256(payload).hexdigest())
    return payloads


@pytest.fixture
def fetched(published, monkeypatch):
    """A fake plumbing.download that serves the stand-ins; yields the names it was asked for."""
    names = []

    def fake_download(name, target, url_pattern=plumbing.MULTI30K_URL):
        names.append(name)
        plumbing.write_atomically(target, published[name])
        return target

    monkeypatch.setattr(plumbing, "download", fake_download)
    return names


def test_tests_find_the_data_in_multi30k_dir_first(tmp_path, monkeypatch, fetched):
    monkeypatch.setenv("MULTI30K_DIR", str(tmp_path / "tiny_mirror"))
    folder, source = conftest.find_multi30k(tmp_path / "data")
    assert (
        folder == tmp_path / "tiny_mirror" and "tiny_mirror is not a folder: point it at" in source
    )
    (tmp_path / "tiny_mirror").mkdir()
    assert conftest.find_multi30k(tmp_path / "data")[1].startswith("Multi30k from MULTI30K_DIR=")
    assert fetched == []


def test_tests_find_the_data_in_data_downloading_only_what_is_missing(
    tmp_path, monkeypatch, published, fetched
):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    (data / "val.de.gz").write_bytes(published["val.de.gz"])
    folder, source = conftest.find_multi30k(data)
    assert folder == data and "checked by SHA-256" in source
    assert sorted(fetched) == sorted(set(published) - {"val.de.gz"})
    assert all((data / name).read_bytes() == payload for name, payload in published.items())
    fetched.clear()
    assert conftest.find_multi30k(data)[0] == data and fetched == []  # all there: no download


def test_tests_without_network_get_a_missing_folder_and_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)

    def no_network(url, timeout):
        raise OSError("Name or service not known")

    monkeypatch.setattr(plumbing.urllib.request, "urlopen", no_network)
    folder, source = conftest.find_multi30k(tmp_path / "data")
    assert not folder.exists()
    assert source.startswith("no Multi30k data: could not download https://")


def test_tests_never_download_over_a_damaged_file(tmp_path, monkeypatch, published, fetched):
    monkeypatch.delenv("MULTI30K_DIR", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.de.gz").write_bytes(b"damaged")
    folder, source = conftest.find_multi30k(data)
    assert not folder.exists() and "train.de.gz has the wrong SHA-256" in source
    assert (data / "train.de.gz").read_bytes() == b"damaged" and fetched == []


def test_unwritable_folder_is_one_clear_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "vocab.json"
    target.write_text("old")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(plumbing.tempfile, "mkstemp", refuse)  # root ignores chmod, so simulate it
    with pytest.raises(at.DataError, match="not writable; fix its permissions"):
        at.write_atomically(target, b"new")
    assert target.read_text() == "old"


@pytest.fixture(scope="module")
def real_train(tmp_path_factory, multi30k):
    """The real training split, encoded, as the cpu preset sees it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MULTI30K_DIR", str(multi30k))
    settings = at.get_settings("cpu")
    text = at.load_pairs("train", at.DATA_DIR)
    tokens = at.tokenize_pairs(text, at.make_tokenizers())
    vocabs = at.vocabularies(tokens)
    mp.undo()
    return settings, vocabs, at.encode_pairs(tokens, vocabs, at.MAX_TRAIN_LEN)


def test_vocabulary_comes_from_training_data_only(real_train):
    _, vocabs, _ = real_train
    assert vocabs["de"].itos[:4] == list(at.SPECIALS)
    assert 5000 < len(vocabs["en"]) < len(vocabs["de"]) < 10000


@pytest.mark.parametrize("preset", ["smoke", "cpu", "gpu"])
def test_padding_efficiency_on_the_real_split(real_train, preset):
    _, _, pairs = real_train
    budget = at.get_settings(preset).batch_tokens
    batches = at.bucket_batches(pairs, budget, seed=1, epoch=0)
    assert at.padding_efficiency(pairs, batches) >= 0.9


def test_each_pair_once_per_epoch_and_reshuffled(real_train):
    settings, _, pairs = real_train
    epochs = [at.bucket_batches(pairs, settings.batch_tokens, seed=7, epoch=e) for e in (0, 1)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(pairs)))
        for b in batches:  # the budget holds, padding included
            longest = max(max(len(pairs[i][0]), len(pairs[i][1])) for i in b)
            assert longest * len(b) <= settings.batch_tokens or len(b) == 1
    assert epochs[0] != epochs[1]
    assert epochs[0] == at.bucket_batches(pairs, settings.batch_tokens, seed=7, epoch=0)


def test_collated_masks(real_train):
    _, vocabs, pairs = real_train
    pad = vocabs["en"].pad_id
    batch = at.collate(pairs, [0, 1, 2, 3], pad)
    for row, i in enumerate([0, 1, 2, 3]):
        src, tgt = pairs[i]
        assert batch.src_mask[row, 0].sum() == len(src)
        assert batch.src[row, : len(src)].tolist() == src
        assert (batch.tgt_out[row] != pad).sum() == len(tgt) - 1
    assert batch.ntokens == sum(len(pairs[i][1]) - 1 for i in range(4))
    assert batch.tgt_mask.shape[1:] == (batch.tgt_in.size(1), batch.tgt_in.size(1))


def test_long_sentences_are_dropped_with_a_count(capsys):
    vocabs = {lang: at.build_vocab([["a"]], min_freq=1) for lang in ("de", "en")}
    tokens = {"de": [["a"], ["a"] * 10], "en": [["a"], ["a"]]}
    pairs = at.encode_pairs(tokens, vocabs, max_train_len=5)
    assert len(pairs) == 1 and "dropped 1 of 2 pairs longer than 5" in capsys.readouterr().out


def test_unknown_preset_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("AT_PRESET", "laptop")
    with pytest.raises(ValueError, match="^unknown preset 'laptop': set AT_PRESET to one of "):
        at.get_settings()
    assert at.get_settings("smoke").name == "smoke"


def test_preparing_the_data_writes_no_cache(tmp_path, monkeypatch):
    """Tokens, vocabularies and merges are computed afresh each time: an edited cell that
    makes them reaches the data (tests/test_runs.py edits each), and only downloads and
    runs live on disk."""
    settings = dataclasses.replace(at.PRESETS["smoke"], train_pairs=50, eval_pairs=5)
    subwords = lambda tokens: at.subword_vocabularies(tokens, merges=50)  # noqa: E731
    conftest.prepared_data(settings, tmp_path, monkeypatch, make_vocabs=subwords)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # MULTI30K_DIR: no download


def test_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.de.gz"
    path.write_bytes(gzip.compress("\ufeffEin Hund\nZwei Katzen\n".encode()))
    assert plumbing.read_lines(path) == ["Ein Hund", "Zwei Katzen"]


def test_a_file_in_the_way_of_the_data_folder_is_one_clear_line(tmp_path):
    blocker = tmp_path / "data"
    blocker.write_text("I am a file, not a folder")
    with pytest.raises(at.DataError, match="is a file; move it away") as error:
        at.write_atomically(blocker / "tokens" / "train.json.gz", b"{}")
    assert "\n" not in str(error.value) and str(blocker) in str(error.value)
    assert blocker.read_text() == "I am a file, not a folder"  # nothing lost
    with pytest.raises(at.DataError, match="is a file"):  # the folder itself is the file
        at.write_atomically(blocker / "vocab.json", b"[]")

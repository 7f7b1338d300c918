"""Explicit interfaces: a setting outside its values is refused, and knobs travel as small
typed records. (A run's folder, named by what shapes its training: test_runs.py.)"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

import annotated_transformer as at


@pytest.mark.parametrize(
    "change, message",
    [
        ({"precision": "bf61"}, "precision='bf61': use one of fp32, bf16"),
    ],
)
def test_a_setting_outside_its_values_is_refused_in_one_line(change, message):
    """A misspelt precision stops at once, naming the setting and the values
    it takes, whether the settings are made or changed from a preset."""
    for make in (
        lambda: at.Settings(name="x", **change),
        lambda: dataclasses.replace(at.get_settings("cpu"), **change),
    ):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == message


def test_every_value_a_setting_allows_is_accepted():
    for precision in ("fp32", "bf16"):
        assert at.Settings(name="x", precision=precision).precision == precision


def test_evaluate_measures_the_mean_loss_per_real_target_token():
    """The summed loss of all batches over all their real target tokens (test_training.py
    checks that evaluation changes nothing and keeps no graph)."""
    torch.manual_seed(0)
    model = at.make_model(9, 9, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2))
    batches = [
        at.Batch(torch.tensor([[1, 5, 2]]), torch.tensor([[1, 7, 8, 2]]), 0),
        at.Batch(torch.tensor([[1, 6, 2]]), torch.tensor([[1, 7, 2, 0]]), 0),
    ]
    criterion = at.LabelSmoothing(9, 0, 0.1)
    loss = at.evaluate(batches, model, criterion)
    with torch.no_grad():
        summed = sum(at.batch_loss(model, criterion, b).item() for b in batches)
    assert [b.ntokens for b in batches] == [3, 2]  # unequal: a mean of means would differ
    assert loss == pytest.approx(summed / 5, rel=1e-6)


def test_the_model_settings_travel_as_one_config_and_reach_every_layer():
    config = at.ModelConfig(N=2, d_model=16, d_ff=24, h=4, dropout=0.2, pre_norm=True)
    model = at.make_model(11, 13, config)
    layers = [*model.encoder.layers, *model.decoder.layers]
    attentions = [m for m in model.modules() if isinstance(m, at.MultiHeadAttention)]
    sublayers = [m for m in model.modules() if isinstance(m, at.ResidualSublayer)]
    assert len(layers) == 4 and len(attentions) == 2 + 2 * 2  # encoder self; decoder self, cross
    assert all(a.h == 4 and a.d_k == 4 and a.dropout.p == 0.0 for a in attentions)
    assert len(sublayers) == 2 * 2 + 2 * 3
    assert all(s.pre_norm and s.dropout.p == 0.2 for s in sublayers)
    assert all(layer.feed_forward.linear1.out_features == 24 for layer in layers)
    assert isinstance(model.encoder.final_norm, nn.LayerNorm)  # pre-norm's last norm


def test_a_model_config_defaults_to_the_papers_base_model():
    config = at.ModelConfig()
    assert (config.N, config.d_model, config.d_ff, config.h) == (6, 512, 2048, 8)
    assert (config.dropout, config.pre_norm) == (0.1, False)  # P_drop 0.1, post-norm


def test_max_positions_sizes_the_positional_tables():
    model = at.make_model(11, 11, at.ModelConfig(N=1, d_model=8, d_ff=16, h=2, max_positions=40))
    assert model.src_embed[1].table.size(0) == 40
    preset_model = at.model_for(at.PRESETS["smoke"], {"de": range(11), "en": range(13)})
    assert preset_model.src_embed[1].table.size(0) == at.MAX_POSITIONS


def test_special_ids_come_from_the_vocabulary_in_one_record():
    vocab = at.Vocab([*at.SPECIALS, "a", "dog"])
    ids = vocab.special_ids()
    assert ids == at.SpecialIds(start=vocab.bos_id, end=vocab.eos_id, pad=vocab.pad_id)
    assert len({ids.start, ids.end, ids.pad}) == 3


def test_greedy_and_beam_search_take_the_same_special_ids():
    """Both decoders start every row with ids.start and pad after ids.end. (Whether beam 1
    equals greedy is tested in test_checkpoint.py, tolerant of near ties.)"""
    torch.manual_seed(0)
    model = at.make_model(9, 9, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0))
    src = torch.tensor([[1, 5, 6, 7, 2], [1, 5, 2, 0, 0]])
    mask = (src != 0).unsqueeze(-2)
    ids = at.SpecialIds(start=4, end=3, pad=0)  # deliberately not the usual 1, 2, 0
    for out in (
        at.greedy_decode(model, src, mask, 8, ids=ids),
        at.beam_search(model, src, mask, 8, beam_size=2, alpha=0.6, ids=ids),
    ):
        assert (out[:, 0] == ids.start).all()
        for row in out.tolist():
            if ids.end in row:
                assert all(w == ids.pad for w in row[row.index(ids.end) + 1 :])


# --- the direction of imports -------------------------------------------------------------

# What each module of the project may import of the project: nothing below reaches up.
MAY_IMPORT = {
    "plumbing": set(),
    "presets": {"plumbing"},  # plumbing.say: its messages in the notebook's language
    "trainer": {"plumbing"},
    "annotated_transformer": {"plumbing", "presets", "trainer"},
}


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project's modules that the file at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def test_no_module_reaches_up_and_the_imports_have_no_cycle():
    """trainer.py imports plumbing only, never the lesson or its twin; the lesson imports
    its helpers; tools sit above all and import no test; and no import cycle."""
    tools = {f"tools.{p.stem}": p for p in (ROOT / "tools").glob("*.py")}
    files = {name: ROOT / f"{name}.py" for name in MAY_IMPORT} | tools
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
    graph = {name: project_imports(path, set(files) | tests) for name, path in files.items()}
    for name, allowed in MAY_IMPORT.items():
        assert graph[name] <= allowed, f"{name} imports {graph[name] - allowed}"
    for name in tools:
        assert not graph[name] & tests, f"{name} imports a test: {graph[name] & tests}"

    def reaches(start: str, seen: set) -> set:
        for module in graph[start] - seen:
            seen.add(module)
            reaches(module, seen)
        return seen

    cycles = [name for name in graph if name in reaches(name, set())]
    assert not cycles, f"import cycles through {cycles}"

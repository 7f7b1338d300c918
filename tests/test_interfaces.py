"""Explicit interfaces: misspelt settings are errors, knobs travel as small typed records."""

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import annotated_transformer as at


def test_a_misspelt_model_setting_is_a_type_error():
    """`pre_nrom=True` must not silently build the paper's post-norm model."""
    with pytest.raises(TypeError, match="pre_nrom"):
        at.make_model(11, 11, pre_nrom=True)
    with pytest.raises(TypeError, match="pre_nrom"):
        at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, pre_nrom=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda: at.run_epoch([], nn.Linear(2, 2), None, None, None, accum_iters=2),
        lambda: at.evaluate([], nn.Linear(2, 2), None, autocasts=None),
        lambda: at.translate(nn.Linear(2, 2), [], {}, beam=4),
        lambda: at.LoopExtras(clip=1.0),
        lambda: at.train_copy_task(epochs=1, make_batches=at.copy_batch),
        lambda: at.train_model(at.SMOKE, None, devices="cpu"),
        lambda: at.load_trained_model(at.SMOKE, None, device_name="cpu"),
    ],
    ids=[
        "run_epoch",
        "evaluate",
        "translate",
        "LoopExtras",
        "train_copy_task",
        "train_model",
        "load_trained_model",
    ],
)
def test_misspelt_keywords_are_refused_before_any_work(call):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        call()


def test_the_loop_extras_change_nothing_by_default():
    """run_epoch with NO_EXTRAS takes the same step as with an explicit plain record."""
    torch.manual_seed(0)
    model = at.make_model(9, 9, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0))
    batch = at.Batch(torch.tensor([[1, 5, 6, 2]]), torch.tensor([[1, 7, 8, 2]]), 0)
    criterion = at.LabelSmoothing(9, 0, 0.1)
    after = []
    for extras in (at.NO_EXTRAS, at.LoopExtras(clip_norm=None, ranks=1, totals=(0.0, 0))):
        copy = at.make_model(9, 9, at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0))
        copy.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(copy.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        at.run_epoch([batch], copy, criterion, optimizer, schedule, extras=extras)
        after.append(torch.cat([p.detach().flatten() for p in copy.parameters()]))
    assert torch.equal(after[0], after[1])
    assert not torch.equal(after[0], torch.cat([p.flatten() for p in model.parameters()]))


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
    config = at.ModelConfig(
        N=2, d_model=16, d_ff=24, h=4, dropout=0.2, attention_dropout=0.3, pre_norm=True
    )
    model = at.make_model(11, 13, config)
    layers = [*model.encoder.layers, *model.decoder.layers]
    attentions = [m for m in model.modules() if isinstance(m, at.MultiHeadAttention)]
    sublayers = [m for m in model.modules() if isinstance(m, at.ResidualSublayer)]
    assert len(layers) == 4 and len(attentions) == 2 + 2 * 2  # encoder self; decoder self, cross
    assert all(a.h == 4 and a.d_k == 4 and a.dropout.p == 0.3 for a in attentions)
    assert len(sublayers) == 2 * 2 + 2 * 3
    assert all(s.pre_norm and s.dropout.p == 0.2 for s in sublayers)
    assert all(layer.feed_forward.linear1.out_features == 24 for layer in layers)
    assert isinstance(model.encoder.final_norm, nn.LayerNorm)  # pre-norm's last norm


def test_a_model_config_is_frozen_and_defaults_to_the_base_model():
    config = at.ModelConfig()
    assert (config.N, config.d_model, config.d_ff, config.h) == (6, 512, 2048, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 16


def test_max_positions_sizes_the_positional_tables():
    model = at.make_model(11, 11, at.ModelConfig(N=1, d_model=8, d_ff=16, h=2, max_positions=40))
    assert at.positions_of(model) == 40
    preset_model = at.model_for(at.SMOKE, {"de": range(11), "en": range(13)})
    assert at.positions_of(preset_model) == at.MAX_POSITIONS


def test_one_name_for_each_length():
    """max_train_len filters training pairs; MAX_POSITIONS sizes the tables; the decoders
    take max_output_len. The old max_len, which meant all three, is gone."""
    fields = {f.name for f in dataclasses.fields(at.Settings)}
    assert "max_train_len" in fields and "max_len" not in fields
    source = Path(at.__file__).read_text()
    assert "max_len" not in source.replace("max_train_len", "")


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


def test_the_run_is_built_with_keywords_only():
    with pytest.raises(TypeError):
        at.Run(at.SMOKE, None, Path("data"))  # positional fields are refused


def test_a_position_round_trips_through_a_checkpoint_dict():
    position = at.Position(epoch=3, batches=7, loss=12.5, tokens=400, seconds=9.0)
    assert at.Position(**dataclasses.asdict(position)) == position
    assert at.Position(epoch=2) == at.Position(2, 0, 0.0, 0, 0.0)  # the start of an epoch


def test_checkpoint_files_are_named_in_one_place(tmp_path):
    folder = at.checkpoint_dir(at.SMOKE, tmp_path)
    assert at.checkpoint_path(at.SMOKE, tmp_path, "last") == folder / "last.pt"
    assert at.checkpoint_path(at.SMOKE, tmp_path, "epoch-4") == folder / "epoch-4.pt"
    source = Path(at.__file__).read_text()
    assert source.count('"last.pt"') == source.count('"final.pt"') == 0, "use checkpoint_path"

"""Part 3's copy task, as its cells run it. nbval's cells carry no marker, so this is how
`make test-numerics` runs the proof under every kernel set the machine has (on one thread,
as the tests run): the verdict waits until every held-out sequence is copied, and the
limit on its steps is over twice the slowest that tests/MARGINS.md measured."""

import inspect

import nbformat
import pytest
from conftest import ROOT

import annotated_transformer as at

NOTEBOOK = ROOT / "annotated_transformer.ipynb"


def cell_with(text: str) -> str:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    (source,) = [c.source for c in notebook.cells if c.cell_type == "code" and text in c.source]
    return source


@pytest.mark.numerics
def test_the_copy_proof_copies_every_held_out_sequence(capsys):
    namespace = dict(vars(at))
    exec(cell_with("copy_model, copy_steps = train_copy_task("), namespace)  # its asserts hold
    assert (
        namespace["copy_steps"]
        < inspect.signature(at.train_copy_task).parameters["max_steps"].default
    )
    assert f"copied after {namespace['copy_steps']} optimizer steps" in capsys.readouterr().out


@pytest.mark.numerics
def test_the_causal_mask_experiment_reads_the_answer_and_cannot_copy():
    namespace = dict(vars(at))
    exec(cell_with("peeking_model, _ = train_copy_task("), namespace)  # its assert holds
    assert namespace["copied_share"] < 0.1


def test_training_stops_once_the_test_passes_and_at_the_limit_else():
    calls = []

    def after_three(model) -> bool:
        calls.append(model)
        return len(calls) == 3

    config = at.ModelConfig(N=1, d_model=16, d_ff=32, h=2, dropout=0.0)
    _, steps = at.train_copy_task(after_three, config=config)
    assert steps == 3 * 20 and len(calls) == 3  # 20 optimizer steps an epoch
    _, steps = at.train_copy_task(lambda model: False, max_steps=40, config=config)
    assert steps == 40

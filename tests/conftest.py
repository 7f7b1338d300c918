"""Shared test set-up: make the notebook's .py twin importable."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MIRROR = ROOT.parent / "shared" / "multi30k"  # the read-only Multi30k mirror beside the repo
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Unit-test tensors are tiny: a second thread only adds synchronisation (10-100x
    slower when the cores are busy). Notebook kernels and spawned ranks are other
    processes and keep their own settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

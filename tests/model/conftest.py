"""Model tests run torch single-threaded: on a shared, oversubscribed CPU, OpenMP threads that spin
waiting for each other made a 135M-parameter forward ~15x slower than one thread (measured)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

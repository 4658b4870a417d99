"""The batch that ``self.log`` infers its batch size from (the logger connector's results)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Trainer


@contextmanager
def logging_batch(trainer: Trainer, batch: Any) -> Iterator[None]:
    """Inside, ``self.log`` without ``batch_size`` weighs its epoch means by ``batch``'s size (a micro-batch's
    samples, not the loader's whole batch); the loop's batch is back afterwards."""
    results = trainer._results
    if results is None:
        yield
        return
    outer, outer_size = results.batch, results.batch_size
    results.batch, results.batch_size = batch, None
    try:
        yield
    finally:
        results.batch, results.batch_size = outer, outer_size

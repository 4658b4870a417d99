"""Where a stop signal's consensus checkpoint goes, and how a checkpoint file is written whole.

A stop signal (SIGTERM; SIGINT under torchrun or SLURM) makes every rank save the consensus with
ElChe's state and the epoch's coverage at the next round (see :mod:`lightning_elche.session`).
The file is ``last-preempted.ckpt`` in the directory of the fit's first ``ElCheCheckpoint``,
else of its first ``ModelCheckpoint``, else in the Trainer's ``default_root_dir``. Its name
starts with ``last``, so ``Trainer.fit(ckpt_path="last")`` finds it when it is the newest
``last*`` checkpoint of a ``ModelCheckpoint`` directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

STOP_CHECKPOINT_NAME = "last-preempted.ckpt"
RANKS_LOST_CHECKPOINT_NAME = "last-ranks-lost.ckpt"


def stop_checkpoint_path(trainer: Trainer, name: Optional[str] = None) -> str:
    """The file a stop signal's checkpoint is written to (the same on every rank); ``name``
    replaces :data:`STOP_CHECKPOINT_NAME` (a fit ended by lost ranks)."""
    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    # An ElCheCheckpoint (every_n_syncs) is where the user keeps the checkpoints to resume from.
    callbacks.sort(key=lambda cb: getattr(cb, "every_n_syncs", None) is None)
    directory = callbacks[0].dirpath if callbacks else trainer.default_root_dir
    return os.path.join(str(directory), name or STOP_CHECKPOINT_NAME)


def unsaved_note(trainer: Trainer) -> str:
    """What a stop that ended the process without a sync leaves to resume from (for its message):
    nothing was saved; the newest checkpoint in the stop checkpoint's directory, if any."""
    directory = Path(os.path.dirname(stop_checkpoint_path(trainer)))
    saved = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    where = (f"the newest checkpoint there is {saved[-1]}: resume with Trainer.fit(ckpt_path=...)" if saved
             else f"no checkpoint in {directory} to resume from")
    return ("Nothing was saved: without a sync, this rank holds its own replica, not the consensus; "
            f"{where}.")


def is_local_path(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


@contextmanager
def written_whole(path: Any) -> Iterator[str]:
    """Yield a temporary name beside ``path`` to write to; on success it replaces ``path``
    atomically, so a reader (or a resumed job) never sees half a checkpoint, whatever kills the
    writer. Remote paths are yielded unchanged (their stores write objects whole)."""
    if not is_local_path(path):
        yield str(path)
        return
    target = Path(str(path).removeprefix("file://"))
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        yield str(temporary)
        if temporary.exists():
            os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()

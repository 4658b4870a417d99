"""Pick multiplicity (flodl's ``augment``) and deterministic per-pick transforms (``transform``).

With ``augment = k`` every sample of the dataset is dispatched ``k`` times per epoch: the epoch's
*pick space* is ``len(dataset) * k``, shuffled as one permutation, so the repeats of a sample are
spread over the epoch and over the ranks like any other pick. Pick ``p`` is sample
``p % len(dataset)``, repeat ``p // len(dataset)``. The dispatch hands out each pick exactly once,
so each ``(index, repeat)`` pair is trained exactly once per epoch.

The variation between repeats comes only from the transform, which receives the pick's key
``(index, repeat, epoch)`` and a generator seeded from it: the same pick gives the same sample on
any rank, in any run, whatever the DataLoader's workers or the dispatch's interleaving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

import torch
from torch.utils.data import Dataset

from lightning_elche.checks import as_int, invalid, require_int

_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    # splitmix64's finaliser: a stable, well-spread hash of an integer (Python's hash() of
    # ints is the identity and of tuples is salted per process, so neither is usable).
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class PickKey(NamedTuple):
    """One pick of an epoch: which sample, which repeat of it, in which epoch."""

    # The public name shadows tuple.index on purpose: PickKey(index, repeat, epoch) is the documented
    # key of a transform, and nothing searches a key with .index().
    index: int  # type: ignore[assignment]  # NamedTuple field over the tuple.index method
    repeat: int
    epoch: int

    def seed(self, base_seed: int = 0) -> int:
        """A 63-bit seed determined by ``(base_seed, epoch, index, repeat)`` alone."""
        value = _mix64(base_seed)
        for part in (self.epoch, self.index, self.repeat):
            value = _mix64(value ^ (part & _MASK64))
        return value & ((1 << 63) - 1)

    def generator(self, base_seed: int = 0) -> torch.Generator:
        """A CPU generator seeded from the key, for the transform's random choices."""
        return torch.Generator().manual_seed(self.seed(base_seed))


Transform = Callable[[Any, PickKey, torch.Generator], Any]


class AugmentedDataset(Dataset):
    """Wraps a map-style dataset: ``augment`` picks per sample and epoch, each transformed
    deterministically from its :class:`PickKey`.

    Under :class:`~lightning_elche.ElCheStrategy` the sampler hands this dataset
    :class:`PickKey` objects that carry the epoch. Outside it (validation, a single device), an
    integer pick ``p`` is read as sample ``p % len(dataset)``, repeat ``p // len(dataset)``, in
    the epoch last given to :meth:`set_epoch` (0 by default).

    Args:
        dataset: the map-style dataset to wrap.
        augment: picks per sample and epoch (flodl's ``augment``), at least 1.
        transform: ``transform(sample, key, generator) -> sample``; draw every random choice from
            ``generator`` (seeded from ``seed`` and the key) so that the pick is reproducible.
            ``None`` returns the sample unchanged.
        seed: base seed folded into every pick's generator.
    """

    def __init__(
        self, dataset: Dataset, augment: int = 1, transform: Optional[Transform] = None, seed: int = 0
    ) -> None:
        augment = require_int(f"AugmentedDataset(augment={augment!r})", augment, 1)
        if transform is not None and not callable(transform):
            raise TypeError(
                f"AugmentedDataset(transform={transform!r}) is invalid: expected a callable "
                "transform(sample, key, generator) or None."
            )
        if as_int(seed) is None:
            raise invalid(f"AugmentedDataset(seed={seed!r})", "expected an integer")
        seed = int(seed)
        try:
            self.base_len = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError("AugmentedDataset needs a map-style dataset with a length.") from None
        self.dataset = dataset
        self.augment = augment
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return self.base_len * self.augment

    def set_epoch(self, epoch: int) -> None:
        """The epoch used for integer picks (``PickKey`` picks carry their own)."""
        self.epoch = epoch

    def key(self, pick: Union[int, PickKey]) -> PickKey:
        """The key of a pick, from a ``PickKey`` or an integer pick in ``[0, len(self))``."""
        if isinstance(pick, PickKey):
            if not 0 <= pick.index < self.base_len or not 0 <= pick.repeat < self.augment:
                raise IndexError(f"{pick} is outside this dataset ({self.base_len} samples x {self.augment}).")
            return pick
        pick = int(pick)
        if not 0 <= pick < len(self):
            raise IndexError(f"pick {pick} is outside [0, {len(self)}).")
        return PickKey(pick % self.base_len, pick // self.base_len, self.epoch)

    def __getitem__(self, pick: Union[int, PickKey]) -> Any:
        key = self.key(pick)
        sample = self.dataset[key.index]
        if self.transform is None:
            return sample
        return self.transform(sample, key, key.generator(self.seed))

"""The one builder of a rank's sampler: from the run mode's :class:`~lightning_elche.config.Dispatch`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning_elche.config import Dispatch
from lightning_elche.dispatch.pool import PoolDispatch
from lightning_elche.dispatch.sampler import ElCheSampler, JoinState
from lightning_elche.dispatch.store import CHUNK_KEY_PREFIX, ChunkCounter
from lightning_elche.dispatch.streams import EqualDispatch, FixedDispatch

POLICIES: dict[Dispatch, type[ElCheSampler]] = {
    Dispatch.EQUAL: EqualDispatch,
    Dispatch.FIXED: FixedDispatch,
    Dispatch.POOL: PoolDispatch,
}


def policy_of(dispatch: Any) -> type[ElCheSampler]:
    """The policy class of ``dispatch``; a clear error for anything but a :class:`Dispatch` member."""
    if not isinstance(dispatch, Dispatch):
        members = ", ".join(f"Dispatch.{member.name}" for member in Dispatch)
        raise ValueError(
            f"build_sampler(dispatch={dispatch!r}) is invalid: expected a lightning_elche.config.Dispatch "
            f"({members}); a run mode's is RunMode.dispatch, a name converts with Dispatch(name)."
        )
    return POLICIES[dispatch]


def build_sampler(
    dispatch: Dispatch,
    num_samples: int,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    shuffle: bool,
    seed: int,
    counter: Optional[ChunkCounter] = None,
    key_prefix: str = CHUNK_KEY_PREFIX,
    partition_ratios: Optional[Sequence[float]] = None,
    max_chunk_batches: int = 4,
    drop_last: bool = False,
    augment: int = 1,
    pick_keys: bool = False,
) -> ElCheSampler:
    """The sampler of the policy ``dispatch`` names (arguments: :class:`ElCheSampler`)."""
    return policy_of(dispatch)(
        num_samples, batch_size, rank, world_size, shuffle=shuffle, seed=seed, counter=counter,
        key_prefix=key_prefix, partition_ratios=partition_ratios, max_chunk_batches=max_chunk_batches,
        drop_last=drop_last, augment=augment, pick_keys=pick_keys,
    )


def sampler_for_joiner(state: JoinState, rank: int, counter: Optional[ChunkCounter] = None) -> ElCheSampler:
    """The sampler of a rank that joined the fit as new rank ``rank``, built from a survivor's
    :meth:`~ElCheSampler.state_for_joiner` (at the new world size) and taking the epoch over.
    ``counter``: this rank's connection to the job's store (required by the pooled dispatch)."""
    if not 0 <= rank < state.world_size:
        raise ValueError(f"sampler_for_joiner(rank={rank}) is invalid: expected a rank of 0..{state.world_size - 1}.")
    sampler = build_sampler(
        state.dispatch, state.dataset_len, state.batch_size, rank, state.world_size, shuffle=state.shuffle,
        seed=state.seed, counter=counter, key_prefix=state.key_prefix,
        partition_ratios=state.partition_ratios, max_chunk_batches=state.max_chunk_batches,
        drop_last=state.drop_last, augment=state.augment, pick_keys=state.pick_keys,
    )
    sampler.adopt(state)
    return sampler

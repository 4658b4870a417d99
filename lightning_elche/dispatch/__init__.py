"""Heterogeneity-aware dispatch of training samples, one room per job.

Every rank draws from one permutation of the dataset per epoch, built from ``(seed, epoch)``
exactly as ``torch.utils.data.DistributedSampler`` builds it. How the permutation is shared out
depends on the run mode's :class:`~lightning_elche.config.Dispatch`:

* sync modes split it equally, interleaved like ``DistributedSampler`` (without its padding);
* cadence and async modes cut it into chunks of whole batches that ranks *claim* with an atomic
  counter in the job's ``torch.distributed`` store, so a faster rank simply claims more chunks,
  from the first epoch on, and adapts within an epoch if a rank slows down;
* ``partition_ratios`` gives each rank a fixed contiguous share.

Whatever the dispatch, every sample of an epoch is handed to exactly one rank exactly once, also
across membership changes (:meth:`ElCheSampler.apply_change`: lost ranks' untrained work goes
back to the epoch, a joiner takes over a survivor's :meth:`~ElCheSampler.state_for_joiner`).
Claimed chunks are always trained (prefetching DataLoader workers only claim ahead), so windows
and syncs never change which indices a rank reads. With ``augment = k`` the epoch is ``k`` picks
per sample and the sampler yields :class:`~lightning_elche.augment.PickKey` objects.

The rooms:

* :mod:`~lightning_elche.dispatch.order`: the epoch's order and how it is cut (pure);
* :mod:`~lightning_elche.dispatch.cursor`: the sampler's lifecycle within an epoch (one state);
* :mod:`~lightning_elche.dispatch.sampler`: the interface every policy implements, and
  :class:`JoinState`;
* :mod:`~lightning_elche.dispatch.streams`: the own-stream splits (equal, fixed);
* :mod:`~lightning_elche.dispatch.pool` and :mod:`~lightning_elche.dispatch.store`: the pool and
  its store protocol (claims, claim records, queues of returned work, keys);
* :mod:`~lightning_elche.dispatch.tail`: the end-of-epoch tail rule (pure);
* :mod:`~lightning_elche.dispatch.build`: :func:`build_sampler`, from a ``Dispatch``.

Coverage and resume records (what a mid-epoch checkpoint keeps) are :mod:`lightning_elche.coverage`.
"""

from lightning_elche.dispatch.build import build_sampler, policy_of, sampler_for_joiner
from lightning_elche.dispatch.cursor import Cursor, Phase
from lightning_elche.dispatch.order import (
    SMALLEST_LAYOUT_SHARE,
    batches_of,
    chunk_layout,
    epoch_permutation,
    fixed_share_batches,
)
from lightning_elche.dispatch.pool import PoolDispatch, PoolPlan
from lightning_elche.dispatch.sampler import DispatchRecord, ElCheSampler, JoinState
from lightning_elche.dispatch.store import CHUNK_KEY_PREFIX, COUNTER_METHODS, ChunkCounter, EpochKeys
from lightning_elche.dispatch.streams import EqualDispatch, FixedDispatch, OwnStreamDispatch, StreamChange, StreamLog
from lightning_elche.dispatch.tail import TailRule

__all__ = [
    "CHUNK_KEY_PREFIX",
    "COUNTER_METHODS",
    "SMALLEST_LAYOUT_SHARE",
    "ChunkCounter",
    "Cursor",
    "DispatchRecord",
    "ElCheSampler",
    "EpochKeys",
    "EqualDispatch",
    "FixedDispatch",
    "JoinState",
    "OwnStreamDispatch",
    "Phase",
    "PoolDispatch",
    "PoolPlan",
    "StreamChange",
    "StreamLog",
    "TailRule",
    "batches_of",
    "build_sampler",
    "chunk_layout",
    "epoch_permutation",
    "fixed_share_batches",
    "policy_of",
    "sampler_for_joiner",
]

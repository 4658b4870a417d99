"""The wire format of a round: one float64 metadata vector per rank, and its checks.

Every plane gathers these vectors first; from the same table every rank derives the same
weights, plan and decisions, and every rank refuses the same inconsistent table, so a
mismatch fails everywhere at once instead of leaving one rank waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional


class Meta(IntEnum):
    """Slots of the per-rank metadata vector exchanged at every round."""

    STEPS = 0
    SAMPLES = 1
    COMPUTE_S = 2
    LAST_SYNC_S = 3
    LOSS_SUM = 4
    LR = 5
    OUT_OF_DATA = 6
    STOP_REQUESTED = 7
    FINITE = 8
    EPOCH = 9
    ROUND = 10
    SIGNATURE = 11
    HAS_DIVERGENCE = 12  # the three norms below come from the previous realized round
    DELTA_NORM = 13
    PRE_NORM = 14
    POST_NORM = 15
    WIRE = 16  # 0: f32 wire, 1: bf16 wire (CPU plane); must agree on every rank
    STALL_MS = 17  # device stall of this rank's previous sync (cpu_async on CUDA), -1 when unmeasured
    EPOCH_BATCHES = 18  # batches this rank started in the current epoch (all trained by the round)
    JOINERS = 19  # rank 0's row: accepted joiners waiting for admission (read from the store once per round)
    MICRO_BATCH = 20  # samples this rank trains per forward and backward (micro_batch set); 0: not reported
    REQUESTS_READ = 21  # rank 0's row: join requests it has read so far (each judged: queued, refused or stale)


META_SIZE = len(Meta)


class StopRequest(IntEnum):
    """A rank's request to stop, carried in the ``STOP_REQUESTED`` slot; a round acts on the
    largest request of any rank, so a larger value is more urgent."""

    NONE = 0
    GRACEFUL = 1  # Trainer.should_stop set on one rank (EarlyStopping, a user callback)
    SIGTERM = 2  # the process was asked to terminate: every rank saves a consensus checkpoint and exits
    REQUEUE = 3  # SLURM's requeue signal: as SIGTERM, saved as Lightning's HPC checkpoint, then requeued
    RANKS_LOST = 4  # max_failure reached: every survivor saves a consensus checkpoint and exits with an error

    @property
    def saves(self) -> bool:
        """Every rank saves a consensus checkpoint with the epoch's coverage, then the fit ends."""
        return self >= StopRequest.SIGTERM


class RanksOutOfStep(RuntimeError):
    """Ranks disagree on what round or epoch they are in, or on the model they average."""


@dataclass(frozen=True)
class RankReport:
    """One rank's row of a round's metadata."""

    steps: int
    samples: int
    compute_s: float
    last_sync_s: float
    loss_sum: float
    lr: float
    out_of_data: bool
    stop_level: StopRequest
    finite: bool
    divergence: Optional[tuple[float, float, float]]
    stall_ms: Optional[float]
    epoch: int = 0
    epoch_batches: int = 0
    joiners: int = 0
    micro_batch: Optional[int] = None
    """This rank's micro-batch in samples (``ElCheStrategy(micro_batch=...)``), None when not reported."""
    requests_read: int = 0
    """Rank 0's row: how many join requests it had read when it built its row."""

    @classmethod
    def from_row(cls, row: list[float]) -> RankReport:
        return cls(
            steps=int(row[Meta.STEPS]),
            samples=int(row[Meta.SAMPLES]),
            compute_s=row[Meta.COMPUTE_S],
            last_sync_s=row[Meta.LAST_SYNC_S],
            loss_sum=row[Meta.LOSS_SUM],
            lr=row[Meta.LR],
            out_of_data=row[Meta.OUT_OF_DATA] > 0.5,
            stop_level=StopRequest(int(row[Meta.STOP_REQUESTED])),
            finite=row[Meta.FINITE] > 0.5,
            divergence=(row[Meta.DELTA_NORM], row[Meta.PRE_NORM], row[Meta.POST_NORM])
            if row[Meta.HAS_DIVERGENCE] > 0.5
            else None,
            stall_ms=row[Meta.STALL_MS] if row[Meta.STALL_MS] >= 0 else None,
            epoch=int(row[Meta.EPOCH]),
            epoch_batches=int(row[Meta.EPOCH_BATCHES]),
            joiners=int(row[Meta.JOINERS]),
            micro_batch=int(row[Meta.MICRO_BATCH]) or None,
            requests_read=int(row[Meta.REQUESTS_READ]),
        )


def validate_table(table: list[list[float]]) -> None:
    """Raise the same error on every rank when the gathered table cannot be averaged."""
    round_index = int(table[0][Meta.ROUND])
    wire = [row[Meta.WIRE] for row in table]
    if any(w != wire[0] for w in wire):
        raise RanksOutOfStep(
            f"ElCheConfig.bf16_wire differs across ranks at round {round_index}: "
            f"{['bf16' if w > 0.5 else 'f32' for w in wire]}. Set bf16_wire identically on every rank."
        )
    for slot in (Meta.ROUND, Meta.EPOCH, Meta.SIGNATURE):
        column = [row[slot] for row in table]
        if any(v != column[0] for v in column):
            raise RanksOutOfStep(
                f"ElChe ranks disagree on {slot.name.lower()} at round {round_index}: {column}. "
                "Every rank must run the same model, data and trainer settings; a rank that "
                "stepped outside ElChe's rounds (manual collectives, rank-local stops) breaks this."
            )
    bad = [k for k, row in enumerate(table) if row[Meta.FINITE] < 0.5]
    if bad:
        raise FloatingPointError(
            f"ElChe round {round_index}: parameters of rank(s) {bad} are NaN or infinite; "
            "averaging would spread them to every replica. Lower the learning rate or clip gradients."
        )

"""Memory-limited ranks in the benchmark: ``--memory-fraction`` and ``--micro-batch`` (no torch import).

A rank limited to a fraction of its GPU's memory (``--memory-fraction 1=0.02``: the rank's worker
calls ``torch.cuda.set_per_process_memory_fraction`` around each throughput fit) cannot train the
loader's batch ``B`` whole; with ``--micro-batch`` (``auto``, a size, or ``RANK=SIZE,...``) the
ElChe arms train it in micro-batches (``ElCheStrategy(micro_batch=...)``) while every other rank
trains its batches whole.

The other arms and the ideal are measured as honestly as a memory limit allows:

* **solo fits** (the ideal): each rank trains alone at its own micro-batch ``m_r`` as batches of
  ``m_r`` with ``accumulate_grad_batches = ceil(B / m_r)``: the same samples per optimizer step
  and the same forward and backward sizes as that rank in the ElChe arms.
* **DDP and post-local SGD** cannot give ranks different batches: every rank runs the smallest
  ``m = min_r m_r`` with ``accumulate_grad_batches = ceil(B / m)``, the job sized for the smallest
  card as Lightning would run it today (the same samples per optimizer step as ElChe).

``m_r`` is the rank's size (``SIZE``), ``B`` for a rank left out, and for ``auto`` what a search
before the plan finds on that rank's GPU under its limit (``micro_batch_auto``: ``B`` on a CPU).
The convergence section and the microbenchmark run without the limit and without micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

AUTO = "auto"

RankSize = Union[None, int, str]
"""One rank's ``--micro-batch`` setting: ``None`` (the whole batch), a size, or ``"auto"``."""

MICRO_BATCH_FORM = ("expected 'auto', a positive whole number of samples (every rank), or RANK=SIZE pairs, "
                    "comma-separated (SIZE a whole number or auto; ranks left out train the whole batch), e.g. "
                    "--micro-batch auto, --micro-batch 64, --micro-batch 1=auto or --micro-batch 1=64,3=32")
MEMORY_FORM = ("expected RANK=FRACTION pairs, comma-separated, each rank at most once and FRACTION in (0, 1] "
               "(the share of the rank's GPU memory its process may allocate), e.g. --memory-fraction 1=0.02")


def _pairs(flag: str, text: str, world: int, form: str) -> dict[int, str]:
    """``"1=a,2=b"`` as {1: "a", 2: "b"}, every rank a rank of the rig and named once."""
    pairs: dict[int, str] = {}
    for item in text.split(","):
        rank_text, sep, value = item.partition("=")
        try:
            rank = int(rank_text.strip())
        except ValueError:
            rank = -1
        if not sep or rank < 0 or not value.strip():
            raise ValueError(f"{flag}={text!r} is invalid: {form}")
        if rank >= world:
            raise ValueError(f"{flag}={text!r} is invalid: rank {rank} does not exist, the rig has {world} ranks "
                             f"(0 to {world - 1})")
        if rank in pairs:
            raise ValueError(f"{flag}={text!r} is invalid: rank {rank} is named twice; {form}")
        pairs[rank] = value.strip()
    return pairs


def _size(flag: str, text: str, value: str, batch: int) -> RankSize:
    if value == AUTO:
        return AUTO
    try:
        size = int(value)
    except ValueError:
        raise ValueError(f"{flag}={text!r} is invalid: {value!r} is not a size; {MICRO_BATCH_FORM}") from None
    if size < 1:
        raise ValueError(f"{flag}={text!r} is invalid: a micro-batch of {size} samples; {MICRO_BATCH_FORM}")
    if size > batch:
        raise ValueError(f"{flag}={text!r} is invalid: a micro-batch of {size} samples is larger than the throughput "
                         f"batch of {batch} (--tp-batch); expected at most {batch}")
    return size


def parse_micro_batch(text: str, world: int, batch: int) -> tuple[RankSize, ...]:
    """``--micro-batch`` as one setting per rank; ``batch`` is the throughput section's ``B``."""
    flag = "--micro-batch"
    text = text.strip()
    if "=" not in text:
        if not text or "," in text:
            raise ValueError(f"{flag}={text!r} is invalid: {MICRO_BATCH_FORM}")
        return (_size(flag, text, text, batch),) * world
    pairs = _pairs(flag, text, world, MICRO_BATCH_FORM)
    return tuple(_size(flag, text, pairs[r], batch) if r in pairs else None for r in range(world))


def parse_memory_fractions(text: str, world: int) -> tuple[Optional[float], ...]:
    """``--memory-fraction`` as one fraction (or None: no limit) per rank."""
    flag = "--memory-fraction"
    pairs = _pairs(flag, text.strip(), world, MEMORY_FORM)
    fractions: list[Optional[float]] = []
    for rank in range(world):
        if rank not in pairs:
            fractions.append(None)
            continue
        try:
            fraction = float(pairs[rank])
        except ValueError:
            fraction = math.nan
        if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(f"{flag}={text!r} is invalid: rank {rank}'s fraction {pairs[rank]!r}; {MEMORY_FORM}")
        fractions.append(fraction)
    return tuple(fractions)


def check_limits(accelerator: str, memory: tuple[Optional[float], ...], micro: tuple[RankSize, ...],
                 memory_text: Optional[str]) -> None:
    """A memory limit needs a CUDA rig and ``--micro-batch`` (else the limited rank could only fail)."""
    if not any(f is not None for f in memory):
        return
    if accelerator != "cuda":
        raise ValueError(f"--memory-fraction={memory_text!r} is invalid: it limits a rank's GPU memory and this rig "
                         "runs on CPU; expected a GPU rig (gpu2-homo or gpu2-hetero, with --share-gpu on one GPU)")
    if not any(m is not None for m in micro):
        raise ValueError(f"--memory-fraction={memory_text!r} is invalid without --micro-batch: a memory-limited rank "
                         "that trains the whole batch runs out of memory; add --micro-batch auto (or a size, or "
                         "RANK=SIZE for the limited rank)")


def planned_sizes(micro: tuple[RankSize, ...], batch: int, searched: dict[int, int]) -> list[int]:
    """Each rank's micro-batch before the fits: its size, ``batch`` when left out, the search's for ``auto``."""
    sizes = []
    for rank, setting in enumerate(micro):
        if setting == AUTO:
            sizes.append(searched[rank])
        else:
            sizes.append(batch if setting is None else int(setting))
    return sizes


def accumulation(size: int, batch: int) -> int:
    """Batches of ``size`` samples per optimizer step that make up a batch of ``batch``."""
    return math.ceil(batch / size)


def describe_limits(memory: tuple[Optional[float], ...], micro: tuple[RankSize, ...]) -> str:
    """The limits in words, for the setting's description (empty when there are none)."""
    parts = [f"rank {r} limited to {f:.3g} of its GPU's memory" for r, f in enumerate(memory) if f is not None]
    sizes = [f"rank {r} {m}" for r, m in enumerate(micro) if m is not None]
    if sizes:
        parts.append(f"micro_batch: {', '.join(sizes)} (the others the whole batch)")
    return "; ".join(parts)


def optimizer_steps(batches: int, record: dict[str, object]) -> int:
    """Optimizer steps of a DDP-family fit that trained ``batches`` batches (accumulated ones count once)."""
    micro = record.get("micro_batch")
    accumulate = int(micro.get("accumulate", 1)) if isinstance(micro, dict) else 1
    return batches // max(1, accumulate)


@dataclass(frozen=True)
class FitShape:
    """How one rank runs one throughput fit under the limits.

    Args:
        batch: the DataLoader's batch size.
        accumulate: ``Trainer(accumulate_grad_batches=...)``.
        micro_batch: ``ElCheStrategy(micro_batch=...)`` (ElChe arms; one setting per rank, or None).
        memory_fraction: this rank's share of its GPU's memory during the fit (None: no limit).
    """

    batch: int
    accumulate: int = 1
    micro_batch: Optional[list[RankSize]] = None
    memory_fraction: Optional[float] = None

    def record(self, size: Optional[int]) -> dict[str, object]:
        """The record's ``micro_batch``: ``size`` is the rank's micro-batch in samples (None: unknown);
        ``per_step``: the forward and backward passes per optimizer step."""
        per_step = self.accumulate * math.ceil(self.batch / size) if size else None
        return {"size": size, "per_step": per_step, "accumulate": self.accumulate, "batch": self.batch,
                "memory_fraction": self.memory_fraction}


def solo_shape(memory: tuple[Optional[float], ...], rank: int, batch: int, planned: list[int]) -> FitShape:
    """Rank ``rank`` alone: batches of its micro-batch, accumulated to ``batch`` samples per step."""
    size = planned[rank]
    return FitShape(size, accumulation(size, batch), None, memory[rank] if memory else None)


def multi_shape(memory: tuple[Optional[float], ...], micro: tuple[RankSize, ...], elche: bool, rank: int,
                batch: int, planned: list[int]) -> FitShape:
    """An ElChe arm trains ``batch`` with each rank's own micro-batch; a DDP-family arm runs every rank
    at the smallest one, accumulated (it cannot give ranks different batches)."""
    fraction = memory[rank] if memory else None
    if elche:
        return FitShape(batch, 1, list(micro) if any(m is not None for m in micro) else None, fraction)
    smallest = min(planned)
    return FitShape(smallest, accumulation(smallest, batch), None, fraction)

"""Rigs, budgets and the command line of the benchmark (no torch import: the parent stays light)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from lightning_elche.bench.limits import (
    RankSize,
    check_limits,
    describe_limits,
    parse_memory_fractions,
    parse_micro_batch,
)
from lightning_elche.bench.workloads import THROUGHPUT_MODELS

WORLD_SIZE = 2
PG_TIMEOUT_S = 60
MIN_MEASURED_SLOWDOWN = 1.3
"""The throttled solo must be at least this many times slower per step, or the run stops."""


@dataclass(frozen=True)
class Setting:
    """One heterogeneity setting of a rig: how its ranks are slowed down.

    A 2-rank setting slows rank 1 only (``slowdown`` or ``sms``); an N-rank setting gives every
    rank its own throttle (``rank_slowdowns`` or ``rank_sms``, one entry per rank). Ranks with the
    same throttle form a *speed class*, whose solo rate is measured once (by its first rank).

    Args:
        label: short name used in job ids and tables (``k3``, ``sm32``, ``homo``).
        slowdown: ``Throttle`` factor of rank 1 for the ``sleep`` method (CPU); 1 = no throttle.
        sms: SMs left to rank 1 by a CUDA green context (GPU); ``None`` = no SM limit.
        rank_slowdowns: N-rank CPU settings: the ``sleep`` factor of each rank (1 = none).
        rank_sms: N-rank GPU settings: the SMs of each rank's green context (``None`` = all).
        rank_memory: ``--memory-fraction``: each rank's share of its GPU's memory in the throughput
            fits (``None`` = no limit; empty: no rank limited). See :mod:`lightning_elche.bench.limits`.
        rank_micro_batch: ``--micro-batch``: each rank's setting (``None``, a size, ``"auto"``; empty: none).
    """

    label: str
    slowdown: float = 1.0
    sms: Optional[int] = None
    rank_slowdowns: tuple[float, ...] = ()
    rank_sms: tuple[Optional[int], ...] = ()
    rank_memory: tuple[Optional[float], ...] = ()
    rank_micro_batch: tuple[RankSize, ...] = ()

    def __post_init__(self) -> None:
        if self.rank_slowdowns and self.rank_sms:
            raise ValueError(f"setting {self.label}: give rank_slowdowns or rank_sms, not both")
        if (self.rank_slowdowns or self.rank_sms) and (self.slowdown != 1.0 or self.sms is not None):
            raise ValueError(f"setting {self.label}: per-rank throttles exclude the 2-rank slowdown/sms")
        if any(not math.isfinite(k) or k < 1 for k in self.rank_slowdowns):
            raise ValueError(f"setting {self.label}: rank_slowdowns={self.rank_slowdowns} must be numbers >= 1")
        if any(n is not None and n < 1 for n in self.rank_sms):
            raise ValueError(f"setting {self.label}: rank_sms={self.rank_sms} must be SM counts >= 1 or None")

    @property
    def per_rank(self) -> bool:
        return bool(self.rank_slowdowns or self.rank_sms)

    @property
    def throttled(self) -> bool:
        if self.per_rank:
            return any(k > 1.0 for k in self.rank_slowdowns) or any(n is not None for n in self.rank_sms)
        return self.slowdown > 1.0 or self.sms is not None

    def check_world(self, world: int) -> None:
        """Refuse a per-rank setting whose length is not the world size."""
        length = len(self.rank_slowdowns or self.rank_sms)
        if self.per_rank and length != world:
            raise ValueError(f"setting {self.label} throttles {length} ranks but the rig has {world}")

    def rank_throttle(self, rank: int) -> tuple[float, Optional[int]]:
        """(sleep factor, SM count or None) of ``rank``: 2-rank settings throttle rank 1 only."""
        if self.rank_slowdowns:
            return self.rank_slowdowns[rank], None
        if self.rank_sms:
            return 1.0, self.rank_sms[rank]
        return (self.slowdown, self.sms) if rank == 1 else (1.0, None)

    def memory_fraction(self, rank: int) -> Optional[float]:
        """``rank``'s share of its GPU's memory in the throughput fits (None: no limit)."""
        return self.rank_memory[rank] if rank < len(self.rank_memory) else None

    def micro_batch(self, rank: int) -> RankSize:
        """``rank``'s ``--micro-batch`` setting (None: the whole batch)."""
        return self.rank_micro_batch[rank] if rank < len(self.rank_micro_batch) else None

    @property
    def limited(self) -> bool:
        """Some rank has a memory limit or a micro-batch setting."""
        return any(f is not None for f in self.rank_memory) or any(m is not None for m in self.rank_micro_batch)

    def representatives(self, world: int, per_rank: bool = False) -> list[int]:
        """Per rank, the rank whose solo fit measures it: the first rank with the same throttle,
        memory limit and micro-batch setting, or itself if ``per_rank``."""
        if per_rank:
            return list(range(world))
        first: dict[tuple[object, ...], int] = {}
        return [first.setdefault((*self.rank_throttle(rank), self.memory_fraction(rank), self.micro_batch(rank)), rank)
                for rank in range(world)]

    def solo_ranks(self, world: int, per_rank: bool = False) -> list[int]:
        """The ranks that run a solo fit: one per speed class, or every rank if ``per_rank``."""
        return sorted(set(self.representatives(world, per_rank)))

    def describe(self) -> str:
        limits = describe_limits(self.rank_memory, self.rank_micro_batch)
        return f"{self._describe_throttle()}; {limits}" if limits else self._describe_throttle()

    def _describe_throttle(self) -> str:
        if self.rank_sms:
            sms = ", ".join("all" if n is None else str(n) for n in self.rank_sms)
            return f"ranks 0-{len(self.rank_sms) - 1} on CUDA green contexts of {sms} SMs"
        if self.rank_slowdowns:
            ks = ", ".join(f"{k:g}" for k in self.rank_slowdowns)
            return (f"ranks 0-{len(self.rank_slowdowns) - 1} throttled k = {ks} (each sleeps k - 1 times its "
                    "step time after each step)")
        if self.sms is not None:
            return f"rank 1 on a CUDA green context of {self.sms} SMs"
        if self.slowdown > 1.0:
            return f"rank 1 sleeps {self.slowdown - 1:g}x its step time after each step (k = {self.slowdown:g})"
        return "no throttle"


@dataclass(frozen=True)
class Rig:
    """A machine layout of the protocol: accelerator, backend, heterogeneity, workloads."""

    name: str
    accelerator: str
    backend: str
    settings: tuple[Setting, ...]
    conv_workload: str
    description: str
    world_size: int = 2
    """Rank processes, one per device (GPU rigs) or one per CPU core's worth of work (CPU rigs)."""

    def __post_init__(self) -> None:
        for setting in self.settings:
            setting.check_world(self.world_size)

    @property
    def solo_per_rank(self) -> bool:
        """Every rank runs its own solo fit, all at once. On a CPU rig the ranks share one machine:
        the solos then load it as the multi-rank arms do, and a rank whose cores are slower than its
        class's first rank's is measured, not assumed (one solo per class left ``cpu8``'s ranks 4-7
        unmeasured and the machine half as busy as in the arms; their batch shares read 6-10 % off)."""
        return self.accelerator == "cpu"


CPU_SPREAD = (1.0, 1.5, 2.0, 3.0)
"""Sleep factors of the N-rank CPU rigs (repeated for 8 ranks): a spread of speeds, not two."""
GPU_SM_SPREAD = (None, 96, 64, 32)
"""SMs of each rank's green context on the N-rank GPU rigs (None: the whole device, 132 on a H200)."""


def _cpu_rig(world: int) -> Rig:
    repeat = world // len(CPU_SPREAD)
    spread = CPU_SPREAD * repeat
    return Rig(
        name=f"cpu{world}",
        accelerator="cpu",
        backend="gloo",
        settings=(Setting("spread", rank_slowdowns=spread), Setting("k1", rank_slowdowns=(1.0,) * world)),
        conv_workload="digits",
        description=f"{world} CPU ranks (gloo), one torch thread each, sleep throttles "
                    f"k = {', '.join(f'{k:g}' for k in spread)}",
        world_size=world,
    )


def _gpu_hetero_rig(world: int) -> Rig:
    spread = GPU_SM_SPREAD * (world // len(GPU_SM_SPREAD))
    sms = ", ".join("all" if n is None else str(n) for n in spread)
    return Rig(
        name=f"gpu{world}-hetero",
        accelerator="cuda",
        backend="nccl",
        settings=(Setting("spread", rank_sms=spread),),
        conv_workload="char",
        description=f"{world} GPUs (NCCL), one process per GPU, CUDA green contexts of {sms} SMs",
        world_size=world,
    )


RIGS: dict[str, Rig] = {
    "cpu2": Rig(
        name="cpu2",
        accelerator="cpu",
        backend="gloo",
        settings=(Setting("k3", slowdown=3.0), Setting("k1", slowdown=1.0)),
        conv_workload="digits",
        description="2 CPU ranks (gloo), one torch thread each",
    ),
    "gpu2-hetero": Rig(
        name="gpu2-hetero",
        accelerator="cuda",
        backend="nccl",
        settings=(Setting("sm32", sms=32),),
        conv_workload="char",
        description="2 GPUs (NCCL), rank 1 limited to 32 SMs by a CUDA green context",
    ),
    "gpu2-homo": Rig(
        name="gpu2-homo",
        accelerator="cuda",
        backend="nccl",
        settings=(Setting("homo"),),
        conv_workload="char",
        description="2 identical GPUs (NCCL), no throttle",
    ),
    "cpu4": _cpu_rig(4),
    "cpu8": _cpu_rig(8),
    "gpu4-hetero": _gpu_hetero_rig(4),
    "gpu8-hetero": _gpu_hetero_rig(8),
}


@dataclass(frozen=True)
class Budget:
    """How long each part of the benchmark runs.

    Args:
        name: ``tiny`` (tests), ``quick`` (a look in a few minutes) or ``full`` (committed results).
        model: throughput model, ``resnet20`` or ``mlp``.
        tp_samples: training samples per epoch over both ranks (throughput section).
        tp_batch: per-device batch size (throughput section).
        tp_seconds: a throughput fit stops at the first epoch end after this many seconds
            (and after at least two epochs: epoch 0 is excluded from the measurement).
        tp_max_epochs: hard epoch limit of a throughput fit.
        tp_solo_seconds: as ``tp_seconds`` for the solo fits (``None``: ``tp_seconds``). A solo's
            epochs are a rank's share of the data, so a shorter fit still measures several.
        conv_epochs: epochs of each convergence fit (the same for every arm).
        conv_seeds: convergence seeds (median and spread are reported).
        conv_batch: per-device batch size (convergence section).
        conv_max_seconds: safety cap of one convergence fit (a capped fit is flagged).
        char_bytes: training text of the byte-level transformer.
        char_model: shape of the byte-level transformer (``tiny``, ``small``, ``medium``;
            ``None``: ``small`` on GPUs, ``tiny`` on CPU).
        deadline_s: groups of fits that would end after this many seconds are skipped (and listed).
        other_settings: also run the rig's non-headline heterogeneity settings (throughput only).
        micro_iters: timed iterations of the all-reduce microbenchmark.
    """

    name: str
    model: str
    tp_samples: int
    tp_batch: int
    tp_seconds: float
    tp_max_epochs: int
    conv_epochs: int
    conv_seeds: int
    conv_batch: int
    conv_max_seconds: float
    char_bytes: int
    deadline_s: float
    other_settings: bool = True
    micro_iters: int = 20
    char_model: Optional[str] = None
    churn_seconds: float = 45.0
    """``--churn``: measured wall time of each churn arm (``--churn-seconds``)."""
    tp_solo_seconds: Optional[float] = None

    @property
    def solo_seconds(self) -> float:
        """Stop-after seconds of a throughput solo fit."""
        return self.tp_seconds if self.tp_solo_seconds is None else self.tp_solo_seconds


_CPU_BUDGETS = {
    "tiny": Budget("tiny", "mlp", 1024, 32, 1.0, 4, 3, 1, 32, 60.0, 1 << 16, 150.0, micro_iters=5,
                   churn_seconds=15.0),
    "quick": Budget("quick", "resnet20", 1024, 32, 6.0, 20, 10, 1, 32, 120.0, 1 << 18, 420.0),
    "full": Budget("full", "resnet20", 2048, 32, 20.0, 40, 30, 3, 32, 240.0, 1 << 19, 840.0, churn_seconds=90.0),
}
_GPU_BUDGETS = {
    "tiny": Budget("tiny", "mlp", 8192, 256, 1.0, 4, 2, 1, 64, 60.0, 1 << 18, 150.0, micro_iters=5),
    "quick": Budget("quick", "resnet20", 32768, 256, 4.0, 20, 2, 1, 64, 60.0, 1 << 20, 240.0),
    # ResNet-20 with 4x the channels and the medium transformer: compute-bound enough that 32 SMs
    # slow a H200 2.2-2.9x (tools/sm_probe.py); the paper-width ResNet-20 slowed only 1.4-1.6x.
    "full": Budget("full", "resnet20x4", 32768, 256, 5.0, 40, 6, 3, 64, 60.0, 1 << 21, 530.0, micro_iters=50,
                   char_model="medium"),
}


N_RANK_FULL_SECONDS = 60.0
"""A ``full`` multi-rank throughput fit's length on an N-rank CPU rig. Its slowest rank trains a
tenth of the batches at a 4.5x spread: in 20 s that was 14-26 batches, so a 5 % share error was
under one claim from the pool, and two runs of one commit differed by a round's worth of efficiency
(``docs/benchmarks.md``, *cpu4 twice*). With 18 s epochs a 45 s fit measured only two epochs
(epoch 0 is left out); 60 s measures three."""
N_RANK_FULL_SOLO_SECONDS = 25.0
"""A ``full`` solo fit's length on an N-rank CPU rig: a solo's epochs are its rank's share of the
data (about 7 s), so 25 s measures three of them, and the two solo brackets of a pass leave the
time for the longer multi-rank fits inside one device call."""
N_RANK_FULL_EPOCH_SCALE = 2
"""A ``full`` epoch on an N-rank CPU rig holds this many times the 2-rank preset's samples per
rank (8,192 samples on ``cpu4``, about 18 s; CIFAR-10's epoch is 50,000). At an epoch's end the
fast ranks wait for the slow ones' last batches (the epoch-end drain, reported on its own), a cost
per epoch: epochs of 9 s made it 2-7 % of the fit (``docs/benchmarks.md``)."""


def budget_for(rig: Rig, name: str) -> Budget:
    """The preset of ``name`` for the rig's accelerator. The presets are sized for 2 ranks; on an
    N-rank rig ``quick`` and ``full`` keep the throughput samples per rank (an epoch lasts as long
    on each rank), while ``tiny`` (a structural check) keeps the total, so its epochs get shorter;
    ``full`` throughput fits on the N-rank CPU rigs last :data:`N_RANK_FULL_SECONDS` (solos
    :data:`N_RANK_FULL_SOLO_SECONDS`) and their epochs are :data:`N_RANK_FULL_EPOCH_SCALE` times as
    long."""
    table = _GPU_BUDGETS if rig.accelerator == "cuda" else _CPU_BUDGETS
    budget = table[name]
    if rig.world_size != 2 and name != "tiny":
        budget = replace(budget, tp_samples=budget.tp_samples * rig.world_size // 2)
    if rig.world_size != 2 and name == "full" and rig.accelerator == "cpu":
        budget = replace(budget, tp_seconds=max(budget.tp_seconds, N_RANK_FULL_SECONDS),
                         tp_solo_seconds=N_RANK_FULL_SOLO_SECONDS,
                         tp_samples=budget.tp_samples * N_RANK_FULL_EPOCH_SCALE)
    return budget


@dataclass(frozen=True)
class BenchConfig:
    """Everything the rank processes need (plain values: it is pickled into them)."""

    rig: Rig
    budget: Budget
    settings: tuple[Setting, ...]
    conv_workload: str
    throughput_seeds: int
    local_sgd_period: int
    local_sgd_warmup: int
    elche_modes: tuple[str, ...]
    target: Optional[float]
    min_slowdown: float
    out_dir: str
    plots: bool = True
    skipped_modes: dict[str, str] = field(default_factory=dict)
    conv_arms: Optional[tuple[str, ...]] = None
    """2-rank arms of the convergence section (``None``: every arm)."""
    bracket_solos: bool = False
    """Each throughput pass also ends with the solo fits (A-B-A): the ideal of the pass is the mean
    of the solo rates before and after its arms, so a drift of the machine's speed during the
    pass is measured, not charged to the arms (the CPU rigs' default but for the ``tiny`` structure
    check; ``--no-bracket``)."""
    tp_arms: Optional[tuple[str, ...]] = None
    """Multi-rank arms of the throughput section (``None``: every arm)."""
    share_gpu: bool = False
    """Every rank on ``cuda:0``, over gloo, each rank a one-device "node" for Lightning (hidden
    ``--share-gpu``): checks the memory columns on a one-GPU machine; its rates mean nothing (the
    processes time-share the GPU)."""
    rank_cpus: tuple[int, ...] = ()
    """``--pin-ranks``: the one logical CPU each rank process (and every thread it starts) runs on,
    indexed by rank; empty: the scheduler moves the ranks over every CPU the bench may use."""

    @property
    def headline(self) -> Setting:
        return self.settings[0]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_elche.bench",
        description="Run every arm of the lightning-elche benchmark protocol on one rig, in one invocation.",
    )
    parser.add_argument("--rig", choices=sorted(RIGS), help="machine layout (docs/benchmarks.md); required")
    parser.add_argument("--replot", type=Path, default=None,
                        help="rewrite the Markdown table and plots from an existing <rig>.json (nothing is run)")
    parser.add_argument("--budget", default="full", choices=("tiny", "quick", "full"), help="how long to run")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="where the results go")
    parser.add_argument("--seeds", type=int, default=None,
                        help="convergence seeds (default: 3 for full; 0: throughput and microbenchmark only)")
    parser.add_argument("--throughput-seeds", type=int, default=1, help="interleaved throughput passes")
    parser.add_argument("--model", choices=THROUGHPUT_MODELS, default=None,
                        help="throughput model (resnet20x4: 4x the channels, compute-bound on large GPUs)")
    parser.add_argument("--tp-batch", type=int, default=None, help="per-device batch size of the throughput section")
    parser.add_argument("--conv-batch", type=int, default=None, help="per-device batch size of the convergence section")
    parser.add_argument("--char-model", choices=("tiny", "small", "medium"), default=None,
                        help="byte-level transformer shape (default: small on GPUs, tiny on CPU)")
    parser.add_argument("--conv-workload", choices=("digits", "char"), default=None,
                        help="convergence workload (default: digits on CPU, char on GPU)")
    parser.add_argument("--slowdowns", default=None,
                        help="CPU rigs: comma-separated k values, the first is the headline (default 3,1)")
    parser.add_argument("--rank-slowdowns", default=None,
                        help="N-rank CPU rigs: comma-separated k of each rank, replacing the rig's headline spread "
                             "(default 1,1.5,2,3, repeated for cpu8)")
    parser.add_argument("--tp-seconds", type=float, default=None,
                        help="length of a throughput fit (solos too, unless --tp-solo-seconds is given)")
    parser.add_argument("--tp-solo-seconds", type=float, default=None,
                        help="length of a throughput solo fit (default: the budget's, else --tp-seconds)")
    parser.add_argument("--tp-epoch-samples", type=int, default=None,
                        help="training samples per throughput epoch over all ranks (default: the budget's; "
                             "gpu2-*: 262144 makes an ElChe epoch last >= 10 s on 2 H200s, docs/benchmarks.md)")
    parser.add_argument("--rank1-sms", default=None,
                        help="gpu2-hetero: comma-separated SM counts of rank 1's green context, the first is the "
                             "headline setting, labelled smN (default 32; 16 gives a >= 4x gap on a H200); each "
                             "between 1 and the GPU's SMs")
    parser.add_argument("--conv-epochs", type=int, default=None, help="epochs of a convergence fit")
    parser.add_argument("--local-sgd-period", type=int, default=8, help="K of the post-local-SGD arm")
    parser.add_argument("--local-sgd-warmup", type=int, default=16,
                        help="start_localSGD_iter of the post-local-SGD arm (steps of plain DDP first)")
    parser.add_argument("--target", type=float, default=None,
                        help="target held-out quality (default: Lightning DDP's median final quality, relaxed)")
    parser.add_argument("--min-slowdown", type=float, default=MIN_MEASURED_SLOWDOWN,
                        help="smallest solo slowdown that proves the throttle works")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip optional passes/seeds that would end later than this (default: the budget's)")
    parser.add_argument("--conv-arms", default=None,
                        help="comma-separated 2-rank arms of the convergence section (default: every arm)")
    parser.add_argument("--micro-iters", type=int, default=None,
                        help="timed iterations of the all-reduce microbenchmark")
    parser.add_argument("--tp-arms", default=None,
                        help="comma-separated multi-rank arms of the throughput section (default: every arm; ddp is "
                             "required, the speed-ups are against it)")
    parser.add_argument("--no-bracket", action="store_true",
                        help="CPU rigs: do not repeat the solo fits at the end of each throughput pass (A-B-A)")
    parser.add_argument("--only-headline", action="store_true", help="skip the rig's other heterogeneity settings")
    # Hidden: for checking the memory columns on one GPU (docs/benchmarks.md, "Memory").
    parser.add_argument("--share-gpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-fraction", default=None,
                        help="GPU rigs: RANK=FRACTION[,RANK=FRACTION]: the rank's process may allocate this share of "
                             "its GPU's memory in the throughput fits (torch.cuda.set_per_process_memory_fraction); "
                             "needs --micro-batch")
    parser.add_argument("--micro-batch", default=None,
                        help="auto, SIZE or RANK=SIZE[,RANK=SIZE] (SIZE a number or auto): ElChe arms of the "
                             "throughput section train with ElCheStrategy(micro_batch=...); DDP runs every rank at "
                             "the smallest micro-batch with gradient accumulation (lightning_elche/bench/limits.py)")
    parser.add_argument("--pin-ranks", action="store_true",
                        help="CPU rigs: pin rank r to the r-th CPU this process may use (taskset's set), for its "
                             "solo and its arms alike, so that the ranks stop trading cores between the fits")
    parser.add_argument("--no-plots", action="store_true", help="write no PNG files")
    churn = parser.add_argument_group("goodput under churn (lightning_elche/bench/churn.py; docs/benchmarks.md)")
    churn.add_argument("--churn", type=float, default=None, metavar="RATE",
                       help="run the churn benchmark instead: RATE faults (kill -9 of a rank other than rank 0) per "
                            "minute per four ranks")
    churn.add_argument("--churn-delay", type=float, default=5.0, metavar="S",
                       help="seconds from a kill to the start of its replacement (elche_joins arm)")
    churn.add_argument("--churn-seconds", type=float, default=None, metavar="S",
                       help="measured wall time of each churn arm (default: the budget's churn_seconds)")
    churn.add_argument("--churn-seed", type=int, default=0, help="seed of the fault schedule (same for every arm)")
    churn.add_argument("--churn-arms", default=None,
                       help="comma-separated churn arms (default: elche_fault_free, elche_joins, elche_shrink, "
                            "ddp_fault_free, ddp_torchrun)")
    churn.add_argument("--churn-mode", default="cpu_cadence", help="ElCheStrategy mode of the churn arms")
    churn.add_argument("--churn-cpus", default=None, metavar="SETS",
                       help="run the arms side by side, each pinned to its own CPUs: one CPU list per arm in "
                            "--churn-arms order, '/' between them (e.g. 0-3/4-7/8-11); default: one after the other")
    churn.add_argument("--churn-ckpt-every", type=int, default=25, metavar="N",
                       help="DDP churn arms: optimizer steps between checkpoints")
    parser.add_argument("--commit", default=None,
                        help="the commit to stamp the results with (a copied tree without git; else git's HEAD)")
    args = parser.parse_args(argv)
    if args.rig is None and args.replot is None:
        parser.error("--rig is required")
    for name in ("throughput_seeds", "conv_epochs", "tp_batch", "conv_batch", "micro_iters", "tp_epoch_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.seeds is not None and args.seeds < 0:
        parser.error(f"--seeds={args.seeds} must be >= 0 (0: no convergence section)")
    if args.local_sgd_period < 1 or args.local_sgd_warmup < 0:
        parser.error("--local-sgd-period must be >= 1 and --local-sgd-warmup >= 0")
    for name in ("tp_seconds", "tp_solo_seconds", "deadline_s"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive number")
    return args


def rank1_sms_settings(rig: Rig, rank1_sms: str) -> tuple[Setting, ...]:
    """``--rank1-sms`` (``"32,16"``) as gpu2-hetero settings ``sm32``, ``sm16``. Whether each count
    fits rank 1's GPU is checked where the GPU is known (``check_machine``, and again in the rank)."""
    if rig.name != "gpu2-hetero":
        raise ValueError(f"--rank1-sms={rank1_sms!r} applies to the gpu2-hetero rig only (rank 1's green context); "
                         f"--rig {rig.name} has no SM-limited rank 1")
    try:
        values = [int(v) for v in rank1_sms.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"--rank1-sms={rank1_sms!r}: expected distinct whole SM counts >= 1 (and at most the GPU's "
                         "SMs), comma-separated, e.g. 32 or 32,16")
    return tuple(Setting(f"sm{v}", sms=v) for v in values)


def settings_for(rig: Rig, slowdowns: Optional[str], rank_slowdowns: Optional[str] = None,
                 rank1_sms: Optional[str] = None) -> tuple[Setting, ...]:
    """The rig's settings, CPU ``--slowdowns`` (``"3,1"``) turned into settings, the N-rank
    CPU rigs' headline spread replaced by ``--rank-slowdowns`` (``"1,2,2,4"``), or gpu2-hetero's
    SM counts of rank 1 replaced by ``--rank1-sms`` (``"32,16"``)."""
    if rank1_sms is not None:
        return rank1_sms_settings(rig, rank1_sms)
    if rank_slowdowns is not None:
        if rig.accelerator != "cpu" or rig.world_size == 2:
            raise ValueError(f"--rank-slowdowns={rank_slowdowns!r} applies to the N-rank CPU rigs (cpu4, cpu8) only")
        try:
            values = tuple(float(v) for v in rank_slowdowns.split(",") if v.strip())
        except ValueError:
            values = ()
        if len(values) != rig.world_size or any(not math.isfinite(v) or v < 1 for v in values):
            raise ValueError(f"--rank-slowdowns={rank_slowdowns!r}: expected {rig.world_size} comma-separated "
                             "numbers >= 1, one per rank")
        return (Setting("custom", rank_slowdowns=values), *rig.settings[1:])
    if slowdowns is None:
        return rig.settings
    if rig.accelerator != "cpu" or rig.world_size != 2:
        raise ValueError(f"--slowdowns={slowdowns!r} applies to the cpu2 rig only (rank 1's k); GPU rigs throttle "
                         "by SM count and the N-rank CPU rigs take --rank-slowdowns")
    ks = [float(v) for v in slowdowns.split(",") if v.strip()]
    if not ks or any(not math.isfinite(v) or v < 1 for v in ks):
        raise ValueError(f"--slowdowns={slowdowns!r}: expected numbers >= 1")
    return tuple(Setting(f"k{v:g}", slowdown=v) for v in ks)


def build_config(args: argparse.Namespace, elche_modes: tuple[str, ...], skipped: dict[str, str]) -> BenchConfig:
    rig = RIGS[args.rig]
    budget = budget_for(rig, args.budget)
    if args.share_gpu:
        if rig.accelerator != "cuda":
            raise ValueError(f"--share-gpu puts every rank on cuda:0; --rig {rig.name} runs on CPU")
        # NCCL refuses two ranks on one GPU; gloo reduces CUDA tensors through the host.
        rig = replace(rig, backend="gloo", description=f"{rig.description}; every rank on cuda:0 (--share-gpu, gloo)")
    overrides: dict[str, object] = {}
    if args.model is not None:
        overrides["model"] = args.model
    if args.seeds is not None:
        overrides["conv_seeds"] = args.seeds
    for name in ("tp_batch", "conv_batch", "char_model", "micro_iters"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.tp_seconds is not None:  # every throughput fit, solos too, unless --tp-solo-seconds says otherwise
        overrides["tp_seconds"] = args.tp_seconds
        overrides["tp_solo_seconds"] = None
    if args.tp_solo_seconds is not None:
        overrides["tp_solo_seconds"] = args.tp_solo_seconds
    if args.conv_epochs is not None:
        overrides["conv_epochs"] = args.conv_epochs
    if args.only_headline:
        overrides["other_settings"] = False
    if args.deadline_s is not None:
        overrides["deadline_s"] = args.deadline_s
    budget = replace(budget, **overrides)  # type: ignore[arg-type]
    settings = settings_for(rig, args.slowdowns, args.rank_slowdowns, args.rank1_sms)
    if args.tp_epoch_samples is not None:
        smallest = rig.world_size * budget.tp_batch
        if args.tp_epoch_samples < smallest:
            raise ValueError(f"--tp-epoch-samples={args.tp_epoch_samples} is too small: each of the {rig.world_size} "
                             f"ranks needs at least one batch of {budget.tp_batch} (--tp-batch), so at least "
                             f"{smallest}")
        budget = replace(budget, tp_samples=args.tp_epoch_samples)
    conv_arms = None
    if args.conv_arms is not None:
        conv_arms = tuple(a.strip() for a in args.conv_arms.split(",") if a.strip())
        known = ("ddp", "ddp_post_local_sgd", *elche_modes)
        unknown = [a for a in conv_arms if a not in known]
        if unknown or "ddp" not in conv_arms:
            raise ValueError(f"--conv-arms={args.conv_arms!r} is invalid: expected a comma-separated subset of "
                             f"{', '.join(known)} that includes ddp (the target is set from it); unknown: {unknown}")
    tp_arms = None
    if args.tp_arms is not None:
        tp_arms = tuple(a.strip() for a in args.tp_arms.split(",") if a.strip())
        known = ("ddp", "ddp_post_local_sgd", *elche_modes)
        unknown = [a for a in tp_arms if a not in known]
        if unknown or "ddp" not in tp_arms:
            raise ValueError(f"--tp-arms={args.tp_arms!r} is invalid: expected a comma-separated subset of "
                             f"{', '.join(known)} that includes ddp (the speed-ups are against it); unknown: {unknown}")
    memory, micro = _limits(args, rig.world_size, rig.accelerator, budget.tp_batch)
    settings = tuple(replace(s, rank_memory=memory, rank_micro_batch=micro) for s in settings)
    if not budget.other_settings:
        settings = settings[:1]
    return BenchConfig(
        rig=rig,
        budget=budget,
        settings=settings,
        conv_workload=args.conv_workload or rig.conv_workload,
        throughput_seeds=args.throughput_seeds,
        local_sgd_period=args.local_sgd_period,
        local_sgd_warmup=args.local_sgd_warmup,
        elche_modes=elche_modes,
        target=args.target,
        min_slowdown=args.min_slowdown,
        out_dir=str(args.out),
        plots=not args.no_plots,
        skipped_modes=skipped,
        conv_arms=conv_arms,
        bracket_solos=rig.accelerator == "cpu" and budget.name != "tiny" and not args.no_bracket,
        tp_arms=tp_arms,
        share_gpu=bool(args.share_gpu),
        rank_cpus=rank_cpus(rig) if args.pin_ranks else (),
    )


def rank_cpus(rig: Rig) -> tuple[int, ...]:
    """One logical CPU per rank for ``--pin-ranks``: the lowest ``world_size`` of those this process
    may run on (``taskset`` narrows them)."""
    if rig.accelerator != "cpu":
        raise ValueError(f"--pin-ranks is invalid with --rig {rig.name}: expected a CPU rig (cpu2, cpu4, cpu8); "
                         "a GPU rig's ranks are placed by their GPUs")
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("--pin-ranks is invalid on this platform: expected Linux (os.sched_setaffinity); drop it")
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < rig.world_size:
        raise ValueError(f"--pin-ranks is invalid here: expected a usable CPU for each of --rig {rig.name}'s "
                         f"{rig.world_size} ranks, this process may use {len(usable)} ({usable}); widen the taskset "
                         "or drop --pin-ranks")
    return tuple(usable[:rig.world_size])


def _limits(args: argparse.Namespace, world: int, accelerator: str, batch: int
            ) -> tuple[tuple[Optional[float], ...], tuple[RankSize, ...]]:
    """``--memory-fraction`` and ``--micro-batch`` as the per-rank fields of every setting."""
    memory = parse_memory_fractions(args.memory_fraction, world) if args.memory_fraction is not None else ()
    micro = parse_micro_batch(args.micro_batch, world, batch) if args.micro_batch is not None else ()
    check_limits(accelerator, memory, micro, args.memory_fraction)
    return memory, micro

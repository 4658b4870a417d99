"""The ordered list of fits one invocation runs, identical in every rank process.

Fits are grouped: a throughput *pass* (the concurrent solo fits, one per speed class of the
setting, then every multi-rank arm, then, on the CPU rigs, the solo fits again: A-B-A) or a
convergence *seed* (rank 0's device alone, then every multi-rank arm). Arms are interleaved:
each group runs every arm once, and the order of the multi-rank arms rotates from group to group
so that a slow drift of the machine does not favour one arm. Every group but the first of each
section may be skipped when the budget's deadline is near (the report lists skipped groups).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elche.bench.config import BenchConfig, Setting

SOLO_PAIR = "solo"
SOLO_END_SUFFIX = "-end"
"""Job id suffix of the solo job that closes a bracketed throughput pass (A-B-A)."""
"""Throughput job in which the first rank of each speed class trains its device alone (with its
throttle), all of them concurrently; on 2 ranks, rank 0 and rank 1."""
SOLO_RANK0 = "solo_rank0"
SOLO_RANK1 = "solo_rank1"
DDP = "ddp"
LOCAL_SGD = "ddp_post_local_sgd"
THROUGHPUT = "throughput"
CONVERGENCE = "convergence"


@dataclass(frozen=True)
class Job:
    """One fit (or, for ``solo``, concurrent single-device fits, one per speed class)."""

    job_id: str
    section: str
    arm: str
    setting: Setting
    seed: int


@dataclass(frozen=True)
class Group:
    """Fits that run back to back; ``check_throttle``: verify the throttle after its solo job."""

    name: str
    section: str
    jobs: tuple[Job, ...]
    skippable: bool
    check_throttle: bool = False


def multi_rank_arms(config: BenchConfig) -> list[str]:
    """The multi-rank arms in their base order: Lightning DDP, post-local SGD, then each ElChe mode."""
    return [DDP, LOCAL_SGD, *config.elche_modes]


def throughput_arms(config: BenchConfig) -> list[str]:
    """The multi-rank arms of the throughput section: ``--tp-arms`` if given, else every arm."""
    arms = multi_rank_arms(config)
    if config.tp_arms is None:
        return arms
    return [arm for arm in arms if arm in config.tp_arms]


def convergence_arms(config: BenchConfig) -> list[str]:
    """The multi-rank arms of the convergence section: ``--conv-arms`` if given, else every arm."""
    arms = multi_rank_arms(config)
    if config.conv_arms is None:
        return arms
    return [arm for arm in arms if arm in config.conv_arms]


def _rotated(arms: list[str], shift: int) -> list[str]:
    if not arms:
        return arms
    shift %= len(arms)
    return arms[shift:] + arms[:shift]


def _throughput_groups(config: BenchConfig, setting: Setting, first_skippable: bool) -> list[Group]:
    groups = []
    for p in range(config.throughput_seeds):
        name = f"tp-{setting.label}-p{p}"
        jobs = [Job(f"{name}-{SOLO_PAIR}", THROUGHPUT, SOLO_PAIR, setting, p)]
        jobs += [Job(f"{name}-{arm}", THROUGHPUT, arm, setting, p) for arm in _rotated(throughput_arms(config), p)]
        if config.bracket_solos:
            jobs.append(Job(f"{name}-{SOLO_PAIR}{SOLO_END_SUFFIX}", THROUGHPUT, SOLO_PAIR, setting, p))
        groups.append(
            Group(name, THROUGHPUT, tuple(jobs), skippable=first_skippable or p > 0,
                  check_throttle=p == 0 and setting.throttled)
        )
    return groups


def build_plan(config: BenchConfig) -> list[Group]:
    """Headline throughput passes, then convergence seeds, then the rig's other settings."""
    headline = config.headline
    groups = _throughput_groups(config, headline, first_skippable=False)
    for s in range(config.budget.conv_seeds):
        name = f"cv-s{s}"
        jobs = [Job(f"{name}-{SOLO_RANK0}", CONVERGENCE, SOLO_RANK0, headline, s)]
        jobs += [Job(f"{name}-{arm}", CONVERGENCE, arm, headline, s) for arm in _rotated(convergence_arms(config), s)]
        groups.append(Group(name, CONVERGENCE, tuple(jobs), skippable=s > 0))
    for setting in config.settings[1:]:
        groups += _throughput_groups(config, setting, first_skippable=True)
    return groups

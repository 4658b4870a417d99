"""User-facing configuration: the five ElChe modes and every knob of the cadence controller.

The knob names and defaults follow flodl 0.7.0's ``ElCheConfig`` so that a flodl user finds the
same vocabulary here. Validation lives next to the fields so that a bad value fails where it is
written (``ElCheConfig(...)``, a LightningCLI YAML file), with a message naming the knob, the value
and what is allowed.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Optional, Union

from lightning_elche.checks import as_real, invalid, require_bool, require_int, require_real
from lightning_elche.membership.change import MaxFailure, check_max_failure
from lightning_elche.micro_batch import MicroBatch, check_micro_batch, check_micro_batch_ranks
from lightning_elche.outer import OuterOptimizer

DEFAULT_ANCHOR = 10
DEFAULT_MAX_ANCHOR = 1000
DEFAULT_OVERHEAD_TARGET = 0.05
OVERHEAD_TARGET_RANGE = (0.01, 0.50)
DEFAULT_ASYNC_EASGD_ALPHA = 0.5
PARTITION_SUM_TOLERANCE = 1e-6
EPOCH_CALLBACK_POLICIES: tuple[str, ...] = ("fastest", "rank0", "all")

FIT_KNOBS = ("outer_optimizer", "chunk_batches", "max_failure", "epoch_callback_policy", "log_every_n_syncs", "summary",
             "micro_batch")
"""ElCheConfig's knobs of the fit around the controller (not in flodl's ElCheConfig); ElCheStrategy
also takes each of them as a keyword argument of the same name."""


class Transport(str, Enum):
    """Where replicas are averaged."""

    DEVICE = "device"  # the job's default process group (NCCL on GPUs, gloo on CPU)
    HOST = "host"  # pinned host snapshots on a dedicated gloo group, reduced by a thread


class ElCheMode(str, Enum):
    """When replicas are averaged (sync / cadence / async) and over which transport (nccl / cpu).

    ``nccl_*`` modes average on the job's default process group (NCCL on GPUs, gloo on CPU);
    ``cpu_*`` modes average pinned host snapshots on a dedicated gloo group.
    Member names equal their values so that ``ElCheMode("cpu_async")`` and a YAML ``mode: cpu_async``
    both work.
    """

    nccl_sync = "nccl_sync"
    nccl_cadence = "nccl_cadence"
    cpu_sync = "cpu_sync"
    cpu_cadence = "cpu_cadence"
    cpu_async = "cpu_async"

    @property
    def is_sync(self) -> bool:
        """Lockstep-paced: anchor 1 and no window growth."""
        return self in (ElCheMode.nccl_sync, ElCheMode.cpu_sync)

    @property
    def is_async(self) -> bool:
        """Ranks keep training while a round is in flight."""
        return self is ElCheMode.cpu_async

    @property
    def transport(self) -> Transport:
        """Where this mode averages the replicas."""
        return _MODE_TRANSPORTS[self]

    @property
    def progressive_dispatch(self) -> bool:
        """Data is claimed chunk by chunk from a shared pool (cadence/async) rather than split equally."""
        return not self.is_sync

    def __str__(self) -> str:
        return self.value


_MODE_TRANSPORTS = {
    ElCheMode.nccl_sync: Transport.DEVICE,
    ElCheMode.nccl_cadence: Transport.DEVICE,
    ElCheMode.cpu_sync: Transport.HOST,
    ElCheMode.cpu_cadence: Transport.HOST,
    ElCheMode.cpu_async: Transport.HOST,
}


class Dispatch(str, Enum):
    """How an epoch's samples are shared out (see :mod:`lightning_elche.dispatch`)."""

    EQUAL = "equal"  # interleaved equal split (sync modes)
    POOL = "pool"  # chunks claimed from a shared pool: faster ranks claim more
    FIXED = "fixed"  # fixed contiguous shares (partition_ratios)


@dataclass(frozen=True)
class RunMode:
    """What a validated :class:`ElCheConfig` means for a fit, the one place the mode is interpreted.

    Every module reads these fields instead of testing the mode's name.
    """

    mode: ElCheMode
    transport: Transport
    blocking: bool
    """Ranks wait for each round's result (every mode but ``cpu_async``)."""
    window_growth: bool
    """The controller may grow the window (cadence and async modes)."""
    dispatch: Dispatch
    blend_alpha: float
    """Weight of the consensus when a replica adopts it: 1 overwrites, < 1 blends (EASGD)."""
    relax_up: bool
    bf16_wire: bool


def _fail(knob: str, value: Any, allowed: str) -> ValueError:
    return invalid(f"ElCheConfig.{knob}={value!r}", allowed)


def _check_int(knob: str, value: Any, minimum: int) -> int:
    return require_int(f"ElCheConfig.{knob}={value!r}", value, minimum)


def _check_real(knob: str, value: Any) -> float:
    return require_real(f"ElCheConfig.{knob}={value!r}", value)


def _check_mode(value: Any) -> ElCheMode:
    try:
        return ElCheMode(value)
    except ValueError:
        allowed = ", ".join(m.value for m in ElCheMode)
        raise _fail("mode", value, f"expected one of {allowed}") from None


def clamp_overhead_target(value: Optional[float]) -> float:
    """``overhead_target`` (None: the default) inside the controller's working range."""
    target = DEFAULT_OVERHEAD_TARGET if value is None else value
    low, high = OVERHEAD_TARGET_RANGE
    return min(max(float(target), low), high)


@dataclass
class ElCheConfig:
    """Every knob of the ElChe cadence controller, with flodl 0.7.0's names and defaults.

    ``ElCheConfig()`` is the ``nccl_cadence`` preset. Fields left at ``None`` take the mode's
    default when the object is built: ``anchor`` is 1 for the sync modes and 10 otherwise, and
    ``easgd_alpha`` is 0.5 for ``cpu_async`` (elsewhere replicas are overwritten by the consensus).

    Args:
        mode: averaging mode, an :class:`ElCheMode` or its string value.
        anchor: batches the slowest rank runs per averaging window at the start (>= 1).
        max_anchor: ceiling for window growth (default 1000).
        min_anchor: floor for window growth (default: the initial anchor). Guard nudges may go
            below it, never below 1.
        overhead_target: per-window fixed cost (sync + pipeline fill) as a fraction of the slow
            rank's window wall time that the controller aims for, in (0, 1); default 0.05. Values
            outside [0.01, 0.5] are clamped, with a warning.
        max_batch_diff: largest change of a rank's per-window batch count per update, and (CPU
            modes) the largest lead of the fastest rank over the slowest. 0 = strict lockstep.
        relax_up: let the anchor creep up by one on each stable verdict (``cpu_async`` only).
        partition_ratios: fixed per-rank data shares (positive, summing to 1, one per rank).
            Disables throughput-proportional dispatch.
        meta_controller: LR-aware meta-controller that shrinks the window on LR cliffs and on
            sustained divergence.
        convergence_guard: a custom guard (any object with ``report(report, k_used, k_max)``).
        easgd_alpha: elastic blend weight in (0, 1] for ``cpu_async``; 1 = overwrite.
        divergence_threshold: threshold of the default trend guard (default 0.05, or 0.3 with
            EASGD blending), > 0.
        no_divergence_guard: disable the convergence guard.
        max_overshoot: batches a ``cpu_async`` rank may run past its planned sync (None = auto).
        gamma: exponent of the realized-work weight n_k**gamma of each rank's parameters (finite).
        bf16_wire: ship each rank's parameter change since the last consensus as bfloat16; the
            weights, the reference and the sums stay f32 (``cpu_*`` modes only: the ``nccl_*``
            reduce never leaves the devices, so the knob is refused there).
        outer_optimizer: applied to every realized parameter consensus, identically on every rank:
            :class:`~lightning_elche.OuterAvg` (``None``, the default: plain averaging),
            :class:`~lightning_elche.SlowMo` or :class:`~lightning_elche.DiLoCo` (which also resets
            each rank's optimizer state after every sync).
        chunk_batches: longest run of batches a rank claims at once from the shared data pool
            (cadence/async modes, >= 1); chunks shrink to single batches near the end of an epoch.
        max_failure: how many lost ranks end the fit: ``None`` (default) goes on as long as one rank
            is left, an int ends it at that many lost ranks, a float ``p`` in (0, 1] at
            ``ceil(p * world_size)`` of the fit's starting world size. At the limit every survivor
            saves a consensus checkpoint (``last-ranks-lost.ckpt``) and raises ``RanksLost``.
        epoch_callback_policy: which rank runs user epoch callbacks wrapped in
            :class:`~lightning_elche.EpochCallbacks`: ``"fastest"`` (default, as flodl), ``"rank0"``
            or ``"all"``. Callbacks that Lightning runs directly still run on every rank.
        log_every_n_syncs: log the ``elche/*`` metrics every this many syncs (rank 0, >= 1).
        summary: print a per-rank summary table at the end of ``fit``.
        micro_batch: samples a rank trains at once (:mod:`lightning_elche.micro_batch`): ``None``
            (default: the loader's whole batch), a positive int for every rank, a mapping ``{rank: size}``
            or a list with one size per rank (a size is an int, ``None`` or ``"auto"``), or ``"auto"``
            (each CUDA rank finds the largest that fits, :mod:`lightning_elche.micro_batch_auto`). A
            rank with a micro-batch below the loader's ``batch_size`` accumulates the micro-batches'
            gradients and takes one optimizer step per batch, as the other ranks.
    """

    mode: Union[ElCheMode, str] = ElCheMode.nccl_cadence
    anchor: Optional[int] = None
    max_anchor: Optional[int] = None
    min_anchor: Optional[int] = None
    overhead_target: Optional[float] = None
    max_batch_diff: Optional[int] = None
    relax_up: bool = False
    partition_ratios: Optional[list[float]] = None
    meta_controller: bool = True
    convergence_guard: Optional[Any] = None
    easgd_alpha: Optional[float] = None
    divergence_threshold: Optional[float] = None
    no_divergence_guard: bool = False
    max_overshoot: Optional[int] = None
    gamma: float = 1.0
    bf16_wire: bool = False
    outer_optimizer: Optional[OuterOptimizer] = None
    chunk_batches: int = 4
    max_failure: MaxFailure = None
    epoch_callback_policy: str = "fastest"
    log_every_n_syncs: int = 1
    summary: bool = True
    micro_batch: MicroBatch = None

    def __post_init__(self) -> None:
        self.mode = _check_mode(self.mode)
        self.anchor = self.resolved_anchor
        if self.easgd_alpha is None and self.mode.is_async:
            self.easgd_alpha = DEFAULT_ASYNC_EASGD_ALPHA
        self.validate()

    # -- presets ---------------------------------------------------------------------------

    @classmethod
    def nccl_sync(cls) -> ElCheConfig:
        """Average after every slow-rank step on the default process group (anchor 1)."""
        return cls(mode=ElCheMode.nccl_sync)

    @classmethod
    def nccl_cadence(cls) -> ElCheConfig:
        """Self-tuning windows on the default process group: the default for mixed GPUs."""
        return cls(mode=ElCheMode.nccl_cadence)

    @classmethod
    def cpu_sync(cls) -> ElCheConfig:
        """Average after every slow-rank step through host memory and a gloo side group."""
        return cls(mode=ElCheMode.cpu_sync)

    @classmethod
    def cpu_cadence(cls) -> ElCheConfig:
        """Self-tuning windows, averaged through host memory; ranks wait for the consensus."""
        return cls(mode=ElCheMode.cpu_cadence)

    @classmethod
    def cpu_async(cls) -> ElCheConfig:
        """Self-tuning windows; ranks keep training while the round is in flight (EASGD 0.5)."""
        return cls(
            mode=ElCheMode.cpu_async,
            overhead_target=DEFAULT_OVERHEAD_TARGET,
            easgd_alpha=DEFAULT_ASYNC_EASGD_ALPHA,
        )

    @classmethod
    def preset(cls, mode: Union[ElCheMode, str]) -> ElCheConfig:
        """The preset of ``mode`` (``ElCheConfig.preset("cpu_async") == ElCheConfig.cpu_async()``)."""
        try:
            mode = ElCheMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in ElCheMode)
            raise ValueError(f"mode={mode!r} is invalid: expected one of {allowed}.") from None
        return getattr(cls, mode.value)()

    def with_mode(self, mode: Union[ElCheMode, str]) -> ElCheConfig:
        """A copy switched to ``mode`` with that mode's mode-dependent defaults re-derived."""
        return replace(self, mode=mode, anchor=None, easgd_alpha=None)

    # -- resolved values -------------------------------------------------------------------

    @property
    def resolved_anchor(self) -> int:
        """``anchor``, or the mode's default (1 for the sync modes) when it is unset."""
        if self.anchor is not None:
            return self.anchor
        return 1 if ElCheMode(self.mode).is_sync else DEFAULT_ANCHOR

    @property
    def resolved_max_anchor(self) -> int:
        return DEFAULT_MAX_ANCHOR if self.max_anchor is None else self.max_anchor

    @property
    def resolved_min_anchor(self) -> int:
        return self.resolved_anchor if self.min_anchor is None else self.min_anchor

    @property
    def resolved_overhead_target(self) -> float:
        return clamp_overhead_target(self.overhead_target)

    @property
    def run_mode(self) -> RunMode:
        """The validated meaning of this config for a fit (see :class:`RunMode`)."""
        mode = ElCheMode(self.mode)
        if self.partition_ratios:
            dispatch = Dispatch.FIXED
        else:
            dispatch = Dispatch.POOL if mode.progressive_dispatch else Dispatch.EQUAL
        return RunMode(
            mode=mode,
            transport=mode.transport,
            blocking=not mode.is_async,
            window_growth=not mode.is_sync,
            dispatch=dispatch,
            blend_alpha=float(self.easgd_alpha) if mode.is_async and self.easgd_alpha else 1.0,
            relax_up=bool(self.relax_up and mode.is_async),
            bf16_wire=bool(self.bf16_wire and mode.transport is Transport.HOST),
        )

    # -- validation ------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid knob, its value and what is allowed."""
        mode = self.mode = _check_mode(self.mode)
        # Integer knobs are stored as Python ints (numpy integers are accepted and converted).
        self.anchor = _check_int("anchor", self.anchor, 1)
        for knob in ("max_anchor", "min_anchor"):
            value = getattr(self, knob)
            if value is not None:
                setattr(self, knob, _check_int(knob, value, 1))
        if self.min_anchor is not None and self.min_anchor > self.resolved_max_anchor:
            raise _fail(
                "min_anchor", self.min_anchor, f"must be <= max_anchor ({self.resolved_max_anchor})"
            )
        if self.anchor > self.resolved_max_anchor:
            raise _fail("anchor", self.anchor, f"must be <= max_anchor ({self.resolved_max_anchor})")
        if self.overhead_target is not None:
            value = _check_real("overhead_target", self.overhead_target)
            if not 0.0 < value < 1.0:
                raise _fail("overhead_target", value, "expected a fraction in the open interval (0, 1)")
            low, high = OVERHEAD_TARGET_RANGE
            if not low <= value <= high:
                warnings.warn(
                    f"ElCheConfig.overhead_target={value!r} is outside the controller's working range "
                    f"[{low}, {high}] and will be clamped to {clamp_overhead_target(value)}.",
                    stacklevel=3,
                )
        if self.max_batch_diff is not None:
            self.max_batch_diff = _check_int("max_batch_diff", self.max_batch_diff, 0)
        for knob in ("relax_up", "meta_controller", "no_divergence_guard", "bf16_wire"):
            require_bool(f"ElCheConfig.{knob}={getattr(self, knob)!r}", getattr(self, knob))
        if self.bf16_wire and mode.transport is not Transport.HOST:
            raise _fail(
                "bf16_wire", True,
                f"it applies to the cpu_* modes only (mode is {mode.value}, whose reduce never "
                "leaves the devices); leave it unset",
            )
        if self.partition_ratios is not None:
            self._validate_partition_ratios()
        if self.convergence_guard is not None and not callable(
            getattr(self.convergence_guard, "report", None)
        ):
            raise _fail(
                "convergence_guard",
                self.convergence_guard,
                "expected an object with a report(report, k_used, k_max) method",
            )
        if self.easgd_alpha is not None:
            value = _check_real("easgd_alpha", self.easgd_alpha)
            if not 0.0 < value <= 1.0:
                raise _fail("easgd_alpha", value, "expected a blend weight in (0, 1]")
            if not mode.is_async:
                raise _fail(
                    "easgd_alpha",
                    value,
                    f"elastic blending applies to mode cpu_async only (mode is {mode.value}); "
                    "leave it unset",
                )
        if self.divergence_threshold is not None:
            value = _check_real("divergence_threshold", self.divergence_threshold)
            if value <= 0.0:
                raise _fail("divergence_threshold", value, "expected a number > 0")
        if self.max_overshoot is not None:
            self.max_overshoot = _check_int("max_overshoot", self.max_overshoot, 0)
            if not mode.is_async:
                raise _fail(
                    "max_overshoot",
                    self.max_overshoot,
                    f"lookahead applies to mode cpu_async only (mode is {mode.value}); "
                    "leave it unset",
                )
        if self.relax_up and not mode.is_async:
            raise _fail(
                "relax_up", True, f"applies to mode cpu_async only (mode is {mode.value})"
            )
        _check_real("gamma", self.gamma)
        for knob in FIT_KNOBS:
            value = getattr(self, knob)
            setattr(self, knob, check_fit_knob(knob, value, f"ElCheConfig.{knob}={value!r}"))

    def _validate_partition_ratios(self) -> None:
        ratios = self.partition_ratios
        if not isinstance(ratios, (list, tuple)) or len(ratios) < 1:
            raise _fail("partition_ratios", ratios, "expected a list with one positive share per rank")
        for share in ratios:
            if isinstance(share, bool) or not isinstance(share, numbers.Real):
                raise _fail("partition_ratios", ratios, "every share must be a number")
            if as_real(share) is None or share <= 0:
                raise _fail("partition_ratios", ratios, "every share must be finite and > 0")
        total = math.fsum(ratios)
        if abs(total - 1.0) > PARTITION_SUM_TOLERANCE:
            raise _fail(
                "partition_ratios",
                ratios,
                f"shares must sum to 1 within {PARTITION_SUM_TOLERANCE:g} (they sum to {total!r})",
            )
        self.partition_ratios = [float(s) for s in ratios]

    def validate_world_size(self, world_size: int) -> None:
        """Checks that need the number of ranks, run by the strategy at setup."""
        if self.partition_ratios is not None and len(self.partition_ratios) != world_size:
            raise _fail(
                "partition_ratios",
                self.partition_ratios,
                f"expected one share per rank: {world_size} values for a world size of {world_size}",
            )
        check_micro_batch_ranks(self.micro_batch, world_size, f"ElCheStrategy(micro_batch={self.micro_batch!r})")

    def describe(self) -> dict[str, Any]:
        """Plain values of every knob, for logs, checkpoints and the record log."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ElCheMode):
                value = value.value
            elif f.name in ("convergence_guard", "outer_optimizer") and value is not None:
                value = type(value).__qualname__
            out[f.name] = value
        return out


def check_policy(owner: str, policy: Any) -> str:
    """An epoch callback policy, or ``ValueError`` naming ``owner``'s knob."""
    return str(check_fit_knob("epoch_callback_policy", policy, f"{owner}(epoch_callback_policy={policy!r})"))


def check_fit_knob(knob: str, value: Any, subject: str) -> Any:
    """One of :data:`FIT_KNOBS`, checked; ``subject`` shows the knob and its value where the user
    gave it (``ElCheConfig.chunk_batches=0``, ``ElCheStrategy(chunk_batches=0)``)."""
    if knob in ("chunk_batches", "log_every_n_syncs"):
        return require_int(subject, value, 1)
    if knob == "max_failure":
        return check_max_failure(value, subject)
    if knob == "epoch_callback_policy":
        if value not in EPOCH_CALLBACK_POLICIES:
            raise invalid(subject, "expected 'fastest', 'rank0' or 'all'")
        return str(value)
    if knob == "summary":
        return require_bool(subject, value)
    if knob == "micro_batch":
        return check_micro_batch(value, subject)
    if value is not None and not isinstance(value, OuterOptimizer):
        raise TypeError(f"{subject} is invalid: expected an OuterOptimizer (OuterAvg, SlowMo or DiLoCo).")
    return value


def resolve_config(
    mode: Optional[Union[ElCheMode, str]], elche: Optional[ElCheConfig], knobs: Optional[Mapping[str, Any]] = None
) -> ElCheConfig:
    """The effective config from the strategy's ``mode``, ``elche`` and ElChe knob arguments
    (``knobs``: the :data:`~lightning_elche.config.FIT_KNOBS` as given to the strategy, where a
    value equal to ElCheConfig's default means "not given")."""
    if elche is not None and not isinstance(elche, ElCheConfig):
        raise TypeError(f"ElCheStrategy(elche={elche!r}) is invalid: expected an ElCheConfig.")
    if elche is not None and mode is not None:
        try:
            requested = ElCheMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in ElCheMode)
            raise ValueError(f"ElCheStrategy(mode={mode!r}) is invalid: expected one of {allowed}.") from None
        configured = ElCheMode(elche.mode)  # checked when elche was built
        if requested is not configured:
            raise ValueError(
                f"ElCheStrategy(mode={requested.value!r}) conflicts with elche.mode={configured.value!r}: "
                "give the mode once (either argument), or the same value in both."
            )
    config = elche if elche is not None else ElCheConfig.preset(ElCheMode.nccl_cadence if mode is None else mode)
    defaults = ElCheConfig()
    checked = {k: check_fit_knob(k, v, f"ElCheStrategy({k}={v!r})") for k, v in (knobs or {}).items()}
    given = {k: v for k, v in checked.items() if v is not getattr(defaults, k) and v != getattr(defaults, k)}
    for knob, value in given.items():
        ours = getattr(config, knob)
        if elche is not None and ours != getattr(defaults, knob) and ours != value:
            raise ValueError(
                f"ElCheStrategy({knob}={value!r}) conflicts with elche.{knob}={ours!r}: give the knob once "
                "(either argument), or the same value in both."
            )
    return replace(config, **given) if given else config

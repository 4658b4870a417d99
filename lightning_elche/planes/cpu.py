"""The ``cpu_*`` modes: averaging through host memory on a dedicated gloo group.

At a window boundary the rank copies its parameters (and float buffers) into pinned host
snapshots (on a side stream on CUDA) and hands the round to one background thread, which alone
drives a gloo group of its own (never the default group, never two threads on one group): it
gathers the round's metadata, checks it, reduces the pre-scaled snapshots in f32, measures this
rank's drift, applies the outer optimizer, and leaves the consensus in pinned memory. The
training thread adopts it later, with a blend for ``cpu_async``.

With ``bf16_wire`` the parameters travel as the *change since the last consensus*, rounded to
bfloat16: every rank keeps the last consensus (the reference, identical on every rank) in f32,
sends ``bf16(θ_k − reference)``, and computes ``reference + Σ w_k·delta_k`` in f32 in rank order,
so every rank gets the same bits and the weights stay f32. Rounding a delta loses about 2⁻⁹ of
the delta, not of the weight: weights of order 1 moved by 1e-4 lose ~2e-7 per round, where
rounding the weights themselves lost ~2e-3 and froze small updates. With error feedback the
rounding residual joins the next round's delta, so the loss does not accumulate over rounds.
The wire carries the same bytes as a bf16 snapshot would.

Blocking modes (``cpu_sync``, ``cpu_cadence``) wait for the thread right away; ``cpu_async``
keeps training and adopts at a later step.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import AveragedLayout, FlatTensors, divergence_norms, round_weights, weighted_sum_into
from lightning_elche.config import Transport
from lightning_elche.membership.change import Change, PeerFailure
from lightning_elche.membership.groups import abandon_group, new_side_group, release_group
from lightning_elche.outer import OuterOptimizer
from lightning_elche.planes.base import (
    AveragingPlane,
    PlaneSetup,
    RoundResult,
    all_gather_flat,
    check_layout,
    stamp_layout,
)
from lightning_elche.rounds import Meta, validate_table

_STOP = object()


class SnapshotTimeout(TimeoutError):
    """A peer did not join an averaging round within ``snapshot_timeout``."""


class HostMirror:
    """Pinned f32 host copies of a :class:`FlatTensors`, filled from the device without blocking it.

    With ``staged`` a device-side snapshot sits between the live tensors and the host copy: the
    copy to the host runs on a side stream while training goes on writing the parameters (a
    non-blocking round), so it must read values that stay put; the same buffer stages a consensus
    on its way back in for a blend. A blocking round holds training until its copies are done and
    adopts with a plain copy, so it needs no such parameter-sized device buffer."""

    def __init__(self, source: FlatTensors, staged: bool = True) -> None:
        self.source = source
        pin = torch.cuda.is_available() and any(f.is_cuda for f in source.flats)
        self.buffers = [torch.empty(f.numel(), dtype=torch.float32, pin_memory=pin) for f in source.flats]
        self.staged = [torch.empty_like(f) for f in source.flats] if staged else []
        self.cuda = pin
        self._stream = torch.cuda.Stream() if pin else None
        self._ready: Optional[torch.cuda.Event] = None
        self._restored: Optional[torch.cuda.Event] = None

    def capture(self) -> None:
        """Snapshot the live tensors (device work is queued; :meth:`wait` before reading)."""
        if not self.cuda:
            torch._foreach_copy_(self.buffers, self.source.flats)
            return
        assert self._stream is not None
        if self.staged:
            torch._foreach_copy_(self.staged, self.source.flats)
        self._stream.wait_stream(torch.cuda.current_stream())  # also orders it after the last restore
        with torch.cuda.stream(self._stream):
            for host, device in zip(self.buffers, self.staged or self.source.flats, strict=True):
                host.copy_(device, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)

    def wait(self) -> None:
        """Block until the last snapshot is readable (called by the plane's thread)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None

    def wait_restored(self) -> None:
        """Block until the last restore's copies out of host memory are done (plane's thread),
        so that the next consensus may be written there; the training thread never waits."""
        restored, self._restored = self._restored, None
        if restored is not None:
            restored.synchronize()

    def restore(self, values: list[Tensor], alpha: float) -> None:
        """``live ← (1 − alpha)·live + alpha·values`` (a plain copy when alpha is 1), in place."""
        if alpha >= 1.0:
            torch._foreach_copy_(self.source.flats, values, non_blocking=True)
        else:
            # On the device and in the parameters' dtype first: a lerp takes operands of one kind.
            assert self.staged, "a blend needs the staging buffer (HostMirror(staged=True))"
            torch._foreach_copy_(self.staged, values, non_blocking=True)
            self.source.lerp_toward(self.staged, alpha)
        if self.cuda:
            self._restored = torch.cuda.Event()
            self._restored.record()

    def release(self) -> None:
        """Drop the host and staging buffers (the live tensors are untouched)."""
        self.buffers, self.staged = [], []
        self.source.release()


class CpuPlane(AveragingPlane):
    """Averaging of host snapshots on a dedicated gloo group driven by one background thread.

    Args:
        layout: the trainable parameters and float buffers, in flat persistent buffers.
        rank, world_size: this rank and the number of ranks.
        gamma: exponent of the realized-work weights.
        outer: outer optimizer applied to the parameter consensus (host, f32).
        bf16_wire: ship each rank's parameter change since the last consensus as bfloat16
            (reference, consensus and accumulation in f32).
        non_blocking: let training continue while a round is in flight (``cpu_async``).
        snapshot_timeout: how long a round may wait for a silent peer before failing.
        group: the gloo group (created on every rank, in the same order; :meth:`build` makes one
            and rebuilds it at every membership change).
        error_feedback: with ``bf16_wire``, add each round's rounding residual to the next
            round's delta.

    The bf16 reference starts as the parameters at construction: the strategy builds the plane
    right after it made every replica identical (and after a checkpoint was loaded, so a resumed
    run starts from the loaded consensus on every rank).
    """

    transport = Transport.HOST
    keeps_side_group = True

    @classmethod
    def build(cls, setup: PlaneSetup) -> CpuPlane:
        run_mode = setup.run_mode
        plane = cls(setup.layout, setup.rank, setup.world_size, gamma=setup.gamma, outer=setup.outer,
                    bf16_wire=run_mode.bf16_wire, non_blocking=not run_mode.blocking,
                    snapshot_timeout=setup.round_timeout, group=new_side_group(setup.round_timeout))
        plane.watch = setup.watch
        plane.owns_group = True
        return plane

    owns_group = False
    """The group was made by :meth:`build`: the plane rebuilds it at a change and releases it at close."""

    def __init__(
        self,
        layout: AveragedLayout,
        rank: int,
        world_size: int,
        gamma: float,
        outer: Optional[OuterOptimizer],
        bf16_wire: bool,
        non_blocking: bool,
        snapshot_timeout: timedelta,
        group: Any,
        error_feedback: bool = True,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.gamma = gamma
        self.outer = outer
        self.bf16_wire = bf16_wire
        self.non_blocking = non_blocking
        self.snapshot_timeout = snapshot_timeout
        self.group = group
        self.error_feedback = error_feedback
        self._exact_round = False
        self.buffers = HostMirror(layout.buffers, staged=non_blocking) if layout.buffers else None
        self._allocate_params(None)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._results: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self._busy = False
        self._job: Optional[tuple[Tensor, Optional[torch.cuda.Event]]] = None
        self._thread = threading.Thread(target=self._serve, name=f"elche-cpu-plane-rank{rank}", daemon=True)
        self._thread.start()

    def _allocate_params(self, reference: Optional[list[Tensor]]) -> None:
        """Host buffers for the current parameter layout. ``reference`` is the bf16 wire's last
        consensus; ``None`` takes the live parameters (identical on every rank at construction),
        ``[]`` leaves it to the next (exact) round."""
        self.params = HostMirror(self.layout.params, staged=self.non_blocking)
        sizes = [b.numel() for b in self.params.buffers]
        # The consensus lands here; f32 whatever the wire, so that blending and the outer step are exact.
        self._consensus = [torch.empty(n, dtype=torch.float32, pin_memory=self.params.cuda) for n in sizes]
        self._scratch = [torch.empty(n, dtype=torch.float32) for n in sizes]
        self._reference: list[Tensor] = []
        self._residual: list[Tensor] = []
        self._wire: list[Tensor] = []
        self._gathered: Optional[list[list[Tensor]]] = None
        if not self.bf16_wire:
            return
        if reference is None:
            reference = [flat.detach().to("cpu", torch.float32, copy=True) for flat in self.layout.params.flats]
        self._reference = reference or [torch.empty(n, dtype=torch.float32) for n in sizes]
        self._wire = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        if self.error_feedback:
            self._residual = [torch.zeros(n, dtype=torch.float32) for n in sizes]

    def _relayout(self) -> None:
        """Re-allocate for a new set of trainable parameters (training thread, no round in flight).

        The next realized round is then exact (f32 values, as without ``bf16_wire``): a newly
        averaged parameter has no reference every rank agrees on, since each rank has already
        trained it locally by the time its first round after the change starts."""
        self.params.wait_restored()  # the old buffers must not go while a copy out of them runs
        if self.buffers is not None:
            self.buffers.wait_restored()
        if self.buffers is None or self.buffers.source is not self.layout.buffers:
            self.buffers = HostMirror(self.layout.buffers, staged=self.non_blocking) if self.layout.buffers else None
        self._allocate_params([])
        self._exact_round = self.bf16_wire
        if self.outer is not None:
            # Its momentum and previous global have the old layout's shape: restart it (every rank
            # relayouts at the same round, so every rank restarts alike).
            self.outer.reset()

    @property
    def round_bytes(self) -> int:
        param_bytes = self.layout.params.numel * (2 if self.bf16_wire else 4)
        return param_bytes + (self.layout.buffers.numel * 4 if self.buffers is not None else 0)

    # -- training thread -------------------------------------------------------------------

    def start(self, local: Tensor) -> None:
        if self._busy:
            raise RuntimeError("CpuPlane.start() while a round is in flight: collect() it first.")
        self._snapshot(local)
        self._job = self._metadata_to_host(local)
        self._submit()

    def _submit(self) -> None:
        self._busy = True
        self._done.clear()
        self._jobs.put(self._job)

    def _snapshot(self, local: Tensor) -> None:
        """Bring the layout up to date (stamping its signature into ``local``) and capture the replica."""
        if stamp_layout(local, self.layout):
            self._relayout()
        self.params.capture()
        if self.buffers is not None:
            self.buffers.capture()

    def _metadata_to_host(self, local: Tensor) -> tuple[Tensor, Optional[torch.cuda.Event]]:
        # The metadata holds device values (loss sum, finite flag): copy them without blocking
        # the training thread; the plane's thread waits for the copy before it gathers.
        if not local.is_cuda:
            return local.to(torch.float64).clone(), None
        host = torch.empty(local.numel(), dtype=torch.float64, pin_memory=True)
        stream = self.params._stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(local, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        local.record_stream(stream)
        return host, copied

    def ready(self) -> bool:
        return self._done.is_set()

    def apply_change(self, change: Change) -> None:
        rank = change.new_rank(self.rank)
        assert rank is not None, "a lost rank does not take the change"
        self.rank, self.world_size = rank, change.world_size_after
        self._gathered = None  # one slot per rank
        if self.owns_group:
            # The old group is gone with the old default group; every member builds the new one here.
            self.group = new_side_group(self.snapshot_timeout)

    def retry(self) -> None:
        # The parameter snapshot is intact (the round reduces copies of it); the buffers are
        # reduced in their mirror, so take them again.
        if self.buffers is not None:
            self.buffers.capture()
        self._submit()

    def collect(self) -> RoundResult:
        if not self._busy:
            raise RuntimeError("CpuPlane.collect() without start().")
        timeout = self.snapshot_timeout.total_seconds() + 30.0
        try:
            outcome = self._results.get(timeout=timeout)
        except queue.Empty:
            raise SnapshotTimeout(
                f"ElChe CPU plane: no averaging result after {timeout:.0f} s; the background round is stuck "
                "(a peer went silent). Raise ElCheStrategy(snapshot_timeout=...) if windows are that long."
            ) from None
        self._busy = False
        if isinstance(outcome, PeerFailure) and self.owns_group:
            abandon_group(self.group, self.watch)  # it may still wait on the lost peer
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def adopt(self, result: RoundResult, alpha: float) -> None:
        if not result.weights.realized:
            return
        self.params.restore(self._consensus, alpha)
        if self.buffers is not None:
            self.buffers.restore(self.buffers.buffers, 1.0)  # running statistics are overwritten

    def start_epoch(self) -> None:
        self.layout.walk_at_next_refresh()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            # A thread stuck in a collective with a dead peer ends at the group's timeout; it is a
            # daemon, so it never keeps the process alive.
            self._thread.join(timeout=self.snapshot_timeout.total_seconds() + 5.0)
        if not self._thread.is_alive():
            # Release the pinned host memory (the engine outlives fit for inspection).
            self._consensus, self._scratch, self._gathered = [], [], None
            self._reference, self._residual, self._wire = [], [], []
            self.params.release()
            if self.buffers is not None:
                self.buffers.release()
        if self.owns_group and self.group is not None:
            release_group(self.group)
            self.group = None

    @property
    def closed(self) -> bool:
        return not self._thread.is_alive() and not self._consensus

    # -- background thread -----------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                self._results.put(self._round(job))
            except BaseException as error:  # handed to the training thread, raised there
                self._results.put(self._explain(error))
            finally:
                self._done.set()

    def _explain(self, error: BaseException) -> BaseException:
        if isinstance(error, PeerFailure):
            return error
        text = str(error)
        if isinstance(error, RuntimeError) and ("timed out" in text.lower() or "timeout" in text.lower()):
            return SnapshotTimeout(
                f"ElChe CPU plane: a peer did not join the averaging round within snapshot_timeout="
                f"{self.snapshot_timeout} ({text.splitlines()[0]})."
            )
        return error

    def _round(self, job: tuple[Tensor, Optional[torch.cuda.Event]]) -> RoundResult:
        local, copied = job
        if copied is not None:
            copied.synchronize()
        table_flat = torch.empty(self.world_size * local.numel(), dtype=torch.float64)
        self._await(all_gather_flat(table_flat, local, group=self.group, async_op=True))
        table = table_flat.view(self.world_size, -1).tolist()
        check_layout(table, self.layout, self.rank)
        validate_table(table)
        weights = round_weights([int(row[Meta.STEPS]) for row in table], self.gamma)
        if not weights.realized:
            return RoundResult(table, weights, None)
        self.params.wait()
        self.params.wait_restored()
        if self.bf16_wire and not self._exact_round:
            self._reduce_deltas(weights.param_factors)
        else:
            torch._foreach_copy_(self._consensus, self.params.buffers)
            torch._foreach_mul_(self._consensus, weights.param_factors[self.rank])
            self._sum(self._consensus)
        if self.buffers is not None:
            self.buffers.wait()
            torch._foreach_mul_(self.buffers.buffers, weights.buffer_factors[self.rank])
            self._sum(self.buffers.buffers)
        # Every collective is done: a round that failed on a lost peer changed no state and can run again.
        torch._foreach_copy_(self._scratch, self.params.buffers)
        divergence = divergence_norms(self._scratch, self._consensus)
        if self.outer is not None:
            self.outer.step(self._consensus)
        if self.bf16_wire:
            # What every rank adopts (after the outer step) is the next round's reference.
            torch._foreach_copy_(self._reference, self._consensus)
            self._exact_round = False
        return RoundResult(table, weights, divergence)

    def _sum(self, flats: list[Tensor]) -> None:
        works = [dist.all_reduce(flat, group=self.group, async_op=True) for flat in flats]
        for work in works:
            self._await(work)

    def _reduce_deltas(self, factors: tuple[float, ...]) -> None:
        """``consensus = reference + Σ factors[k]·bf16(delta_k)``, in f32 on every rank.

        Gathering the bf16 deltas and summing them here keeps every accumulator in f32 (a bf16
        all-reduce would add in bf16); every rank sums in the same order, so all get the same bits."""
        # The residual is carried only once every gather is done: a round that fails on a lost
        # peer runs again from the same residual.
        encode_delta(self.params.buffers, self._reference, self._residual, self._scratch, self._wire,
                     carry_residual=False)
        if self._gathered is None:
            self._gathered = [[torch.empty_like(w) for _ in range(self.world_size)] for w in self._wire]
        for mine, gathered, out in zip(self._wire, self._gathered, self._consensus, strict=True):
            self._await(dist.all_gather(gathered, mine, group=self.group, async_op=True))
            weighted_sum_into(out, gathered, factors)
        torch._foreach_add_(self._consensus, self._reference)
        if self._residual and factors[self.rank] > 0.0:
            for lost, exact, sent in zip(self._residual, self._scratch, self._wire, strict=True):
                torch.sub(exact, sent, out=lost)


def encode_delta(
    snapshot: list[Tensor],
    reference: list[Tensor],
    residual: list[Tensor],
    scratch: list[Tensor],
    wire: list[Tensor],
    carry_residual: bool,
) -> None:
    """``wire = bf16(snapshot − reference + residual)``; with a residual (error feedback), keep
    what the rounding lost for the next round.

    ``carry_residual`` is False for a rank whose contribution has weight 0 this round: nothing it
    sent is used, so its residual stays as it was. ``scratch`` (f32) holds the unrounded delta.
    """
    torch._foreach_copy_(scratch, snapshot)
    torch._foreach_sub_(scratch, reference)
    if residual:
        torch._foreach_add_(scratch, residual)
    torch._foreach_copy_(wire, scratch)  # round to nearest even
    if residual and carry_residual:
        for lost, exact, sent in zip(residual, scratch, wire, strict=True):
            torch.sub(exact, sent, out=lost)

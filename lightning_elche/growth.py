"""A rank joins a running fit: the strategy's side of admission, for the members and for the joiner.

The protocol (who may join, when, and the store keys) is
:mod:`lightning_elche.membership.admission`; the changes to Lightning's objects are
:mod:`lightning_elche.loop_glue.joining`. Here is the order in which both sides act.

**Members.** At launch rank 0 creates the job's join secret and every rank learns it (with the
fit's key prefix, one broadcast). Rank 0 publishes the fit's facts once its training loader is
known and reads the count of accepted joiners into its round metadata once per round
(:attr:`ElCheEngine.admission <lightning_elche.engine.ElCheEngine.admission>`). A new
request ends every member's current window within a heartbeat (:class:`JoinKnock`, read by the
heartbeat thread), so that round comes when the joiner is ready, not at the window's end. After
a round that saw joiners waiting, every member asks for a consensus round two rounds on; at the
first consensus round at which every rank still has data in the epoch and nobody stops, every
member admits them (:meth:`Growth.after_round`): the admitted list, the entry (every member and
joiner says it is there, and one that is gone is left out: :mod:`lightning_elche.membership.entry`),
the next generation's group (with the ``cpu_*`` plane's side group: taking the change is then no
rendezvous), then rank 0 sends each joiner, over that group, the consensus
parameters and buffers, its own optimizer and scheduler states (for local SGD a peer's inner
optimizer state is a state that trained the same consensus, and the one the joiner would otherwise
rebuild from nothing), the loop position and its callbacks' states (as a resume restores them),
watching each joiner while it sends; every participant then settles the delivery (a joiner says it
is there once it has that state; one lost meanwhile is dropped, a member lost meanwhile is lost, and
the members build one more group without them); every holder takes the change (``apply_change``);
rank 0 then sends the ElChe state (the engine's
round record: controller, convergence guard, outer optimizer) and the dispatch state
(``state_for_joiner``), which follow from the change, and every participant settles which joiners
have their whole state (``joined``): one that has not (it died, or rank 0 was lost while it sent)
leaves and never was a member; whoever is gone is taken out at the next round, as after any change,
a dropped joiner uncounted.

**The joiner.** ``setup_distributed`` connects to the job's store and registers the next free
member id, without a process group; Lightning's start-of-fit collectives answer locally until it
trains. ``setup`` sends the request and waits for admission (its facts: the model's averaging
signature, the training loader's dataset length, batch size, order and seed, the mode), takes part
in the entry, builds the new generation's group (and the side group its plane will take), receives
its state watching rank 0 (lost: the joiner leaves, dropped) and settles the delivery, then the
rest of the state, settled too (``joined``; rank 0 lost before it all came: the joiner leaves,
dropped). It takes the parameters before the averaging plane is built and the rest after Lightning
set up the optimizers; ``process_dataloader`` builds its sampler from the dispatch state. Its first
batch is in the cohort's current epoch, its first round the cohort's next.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from lightning_elche import job_store
from lightning_elche.averaging import averaged_buffers, layout_signature, trainable_parameters
from lightning_elche.checks import require_int
from lightning_elche.config import Dispatch
from lightning_elche.loop_glue import configure_launcher
from lightning_elche.loop_glue.joining import (
    callback_states,
    injected_sampler_seed,
    load_callback_states,
    loader_of,
    loop_position,
    position_loops,
    prepare_joiner,
    preview_train_loader,
    quiet_collectives,
    step_schedulers_for_admission_batch,
)
from lightning_elche.loop_glue.loaders import dispatch_shape
from lightning_elche.loop_glue.ranks import renumber_lightning_ranks
from lightning_elche.membership.admission import (
    Admitter,
    FitFacts,
    FitOver,
    JoinerLink,
    JoinKnock,
    JoinRefused,
    create_join_secret,
    job_address,
    joining_requested,
    publish_job,
    read_join_secret,
)
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change, PeerFailure, RanksLost
from lightning_elche.membership.entry import (
    followed,
    narrow,
    regroup,
    settle_entry,
    settle_joined,
    settle_stage,
    settled_key,
    stayed,
)
from lightning_elche.membership.groups import (
    abandon_group,
    abandon_side_group_ahead,
    init_generation_group_watched,
)
from lightning_elche.membership.survival import Survival, fence_members
from lightning_elche.planes import keeps_side_group
from lightning_elche.state_transfer import PackedState, pack_state, recv_state

log = logging.getLogger(__name__)

DISPATCH_STORE_PREFIX = "lightning_elche/dispatch/"
JOIN_TIMING_ENV = "ELCHE_JOIN_TIMING"
"""A directory: every process appends the moments of its admissions to ``join-timing-<member>.jsonl``
there (tools/join_timing.py reads them). Unset, nothing is timed."""
RESTART_LOST_ALLOWED = ("expected an int >= 0: how many times in the fit rank 0 starts a lost child rank of its node "
                        "again, as a joiner (0 restarts none)")


class RankJoinedWarning(UserWarning):
    """A rank joined the fit: the members go on with it."""


def facts_of(mode: str, module: torch.nn.Module, dataloader: DataLoader) -> FitFacts:
    shape = dispatch_shape(dataloader)
    return FitFacts(mode=mode, signature=layout_signature(trainable_parameters(module), averaged_buffers(module)),
                    dataset_len=shape.samples * shape.augment, batch_size=shape.batch_size, seed=shape.seed,
                    shuffle=shape.shuffle, drop_last=shape.drop_last)


def dispatch_store(membership: Membership) -> Any:
    """Where every rank's dispatch claims, joiners included: on the job's store, not on one
    generation's group."""
    return dist.PrefixStore(DISPATCH_STORE_PREFIX, membership.store)


def _host_blocking() -> bool:
    """Whether a transfer's work blocks the host in ``wait(timeout)`` (gloo), or is polled (NCCL)."""
    return "nccl" not in str(dist.get_backend())


def _watching(membership: Membership, peer: int, ends_on: str = "") -> Callable[[Any], None]:
    """A transfer's wait for one message, watching the transfer's other end (``peer``)."""
    return lambda work: membership.wait(work, _host_blocking(), peers=[peer], ends_on=ends_on)


def all_can_admit(outcome: Any, dispatch: Dispatch) -> bool:
    """Whether every member can take part in an admission at this round (the reports: the same answer
    on all). With the equal split a rank out of data ends its share of the epoch, which the admission
    would cut again. With the pool a rank out of data only waits, joining the rounds, for the epoch's
    end: the joiner claims what is left (or, the pool dry, joins those rounds too), so a slow rank
    that leaves the pool's tail early in an epoch (a short epoch, a rank many times slower than the
    others) no longer keeps every joiner out until the fit ends. Rank 0 must have trained a batch
    of the epoch: its loop's position after the round's batch is what the joiner starts from."""
    draining = [r.out_of_data for r in outcome.reports]
    if not any(draining):
        return True
    return dispatch is Dispatch.POOL and not all(draining) and outcome.reports[0].epoch_batches > 0


def _mark(member: int, event: str, **fields: Any) -> None:
    """One moment of an admission, when ``ELCHE_JOIN_TIMING`` names a directory (admissions only:
    never on the per-step path)."""
    directory = os.environ.get(JOIN_TIMING_ENV)
    if not directory:
        return
    with open(os.path.join(directory, f"join-timing-{member}.jsonl"), "a") as sink:
        sink.write(json.dumps({"event": event, "time": time.time(), "member": member, **fields}) + "\n")


def _warn_joined(change: Change, membership: Membership) -> None:
    """``RankJoinedWarning`` for the joiners of ``change`` that stayed (none: no warning); a joiner
    dropped at the last settlement (:meth:`Membership.note_dropped`) is not one."""
    joiners = [m for m in change.joined_ids if m not in membership.dropped_joiners]
    if not joiners:
        return
    kept = (*stayed(change), *joiners)
    message = (f"ElCheStrategy {replace(change, after=kept).describe()} (member ids): {len(kept)} rank(s) go on; "
               "the joiner takes a share of this epoch's untrained data from its first window.")
    warnings.warn(message, RankJoinedWarning, stacklevel=3)


class Growth:
    """Both sides of a join for one strategy (a process is a member or a joiner, never both)."""

    def __init__(self, restart_lost: int = 0) -> None:
        self.restart_lost = require_int(f"ElCheStrategy(restart_lost={restart_lost!r})", restart_lost, 0,
                                        RESTART_LOST_ALLOWED)
        self.joining = joining_requested()
        self.admitter: Optional[Admitter] = None
        self.survival: Optional[Survival] = None
        self.admit_at: Optional[int] = None
        self.knock: Optional[JoinKnock] = None
        self._hurry = False
        self._over = False
        self._job: tuple[str, str] = ("", "")
        # The joiner's
        self._link: Optional[JoinerLink] = None
        self._address: tuple[str, int] = ("", 0)
        self._undo_quiet: Optional[Callable[[], None]] = None
        self.membership: Optional[Membership] = None
        self._first: Optional[dict[str, Any]] = None
        self._rest: Optional[dict[str, Any]] = None
        self._dispatch: Any = None
        self._facts: Optional[FitFacts] = None
        self._job_view: Any = None
        self._backend = ""
        self._timeout: Any = None
        self._side_timeout: Optional[timedelta] = None

    def __getstate__(self) -> dict[str, Any]:
        # Built per fit inside the rank processes (the launcher pickles the strategy before that).
        return {"joining": self.joining, "restart_lost": self.restart_lost}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Growth.__init__(self, state.get("restart_lost", 0))
        self.joining = state["joining"]

    def configure_launcher(self, strategy: Any, tolerates_loss: Callable[[int], bool]) -> None:
        """The strategy's launcher: Lightning's, sparing the survivors of a loss, restarting a lost child
        as a joiner ``restart_lost`` times while this fit admits joiners."""
        configure_launcher(strategy, tolerates_loss, self.restart_lost, lambda: self.admits_joiners, self.joining)

    # -- members -----------------------------------------------------------------------------------

    def fit_prefix(self, strategy: Any) -> str:
        """The fit's key prefix (and, on a member, the job's id and join secret), the same on every
        rank: one broadcast from rank 0 on a member, the admission on a joiner."""
        # The plane's side group is built with every admission's group (watched there, not when the
        # holders take the change).
        transport = strategy.elche.run_mode.transport
        self._side_timeout = strategy.snapshot_timeout if keeps_side_group(transport) else None
        if self.joining:
            return self._admit(strategy)
        job = ("", "")
        link = strategy.job_store_link
        if strategy.global_rank == 0 and link is not None and strategy.world_size > 1:
            environment = strategy.cluster_environment
            job = create_join_secret(environment.main_address, environment.main_port)
            publish_job(link.store, job[0], strategy.world_size)
        token, *self._job = strategy.broadcast((secrets.token_hex(8), *job))
        return f"lightning_elche/{token}"

    def attach(self, membership: Optional[Membership], rounds: Any, sampler: Callable[[], Any]) -> None:
        """Members, once the engine exists: rank 0 reads the waiting joiners into its round metadata,
        every member looks for an admission after every round, and a joiner's request, a peer
        dead on this host or an admission named for the next round ends its window (:class:`JoinKnock`,
        :class:`~lightning_elche.membership.liveness.GoneKnock`, :meth:`hurried`)."""
        engine = rounds.engine if rounds is not None else None
        if membership is None or engine is None or engine.failures is None or not self._job[0]:
            return
        self.admitter = Admitter(membership, *self._job)
        if self._facts is not None:  # a joiner: it judges later joiners once it is rank 0
            self.admitter.facts = self._facts
        self.survival = engine.failures
        admitter = self.admitter
        engine.admission = lambda: (admitter.waiting(), admitter.requests_read()) if engine.rank == 0 else (0, 0)
        self.knock = knock = JoinKnock(membership.store)
        membership.heartbeat.add_watcher(knock.observe)
        engine.knocks = (knock.take, membership.gone.take, self.hurried)  # GoneKnock: the job's registry
        rounds.after_each_round = lambda trainer, outcome: self.after_round(trainer, outcome, engine, rounds.session,
                                                                            sampler())

    def hurried(self) -> bool:
        """Once after a round that named the admission's round: the window before it ends now."""
        hurry, self._hurry = self._hurry, False
        return hurry

    def dispatch_ready(self, strategy: Any, sampler: Any, dataloader: DataLoader) -> None:
        """The training sampler exists: a joiner takes the cohort's epoch over; rank 0 publishes the
        fit's facts for joiners."""
        if self._dispatch is not None:
            sampler.adopt(self._dispatch)
            self._dispatch = None
        if self.admitter is not None:
            self.admitter.publish(facts_of(strategy.elche.mode.value, strategy.lightning_module, dataloader))

    def after_round(self, trainer: Trainer, outcome: Any, engine: Any, session: Any, sampler: Any) -> None:
        """Every member, after every round: schedule or carry out an admission (same decision everywhere)."""
        if self.admitter is None or not outcome.reports:
            return
        if self.knock is not None:
            self.knock.settle(outcome.reports[0].requests_read)
        self._hurry = False
        waiting = outcome.reports[0].joiners
        engine.controller.keep_a_round_before_the_epoch_end(bool(waiting))
        if not waiting:
            self.admit_at = None
            return
        saving = session is None or bool(session.pending_save)
        unhindered = not saving and not session.leaving
        admissible = (outcome.consensus and not outcome.ends_window_sequence and sampler is not None and unhindered
                      and all_can_admit(outcome, engine.run_mode.dispatch))
        if admissible:
            self.admit_at = None
            engine.controller.keep_a_round_before_the_epoch_end(False)
            self._admit_joiners(trainer, waiting, engine, session, sampler)
        elif self.admit_at is None or outcome.index >= self.admit_at:
            # Two rounds on: in cpu_async the next round may already be in flight; none is after the
            # epoch's last round, and the next epoch's first round comes before its end (above).
            self.admit_at = outcome.index + (1 if outcome.ends_window_sequence else 2)
            engine.request_consensus(at_round=self.admit_at)
            # The joiners are ready and wait for that round: the window before it ends after its first step,
            # not at its plan (a new epoch's first window, a cpu_async window: seconds), unless a rank's
            # drain of an equal split, a save or a stop would keep that round from admitting anyway. The
            # session leaves the epoch after an epoch's last round (this round's doing, set before this
            # listener runs): that does not hinder the next epoch's first round. A stop deferred until
            # ``min_epochs`` ends every round's sequence until then: none of them admits, so no hurry.
            self._hurry = not saving and (outcome.epoch_over if outcome.ends_window_sequence
                                          else all_can_admit(outcome, engine.run_mode.dispatch))

    def _admit_joiners(self, trainer: Trainer, count: int, engine: Any, session: Any, sampler: Any) -> None:
        assert self.admitter is not None and self.survival is not None
        membership = self.admitter.membership
        me, started = membership.original_rank, time.time()
        try:
            joined = self.admitter.admit(count)
        except PeerFailure as failure:  # rank 0 lost before it published the admitted list
            self.survival.after_failed_round(failure)  # an ordinary loss; the joiners see it and leave
            return
        if not joined:
            return
        _mark(me, "admit_start", time=started, epoch=int(trainer.current_epoch))
        opened = membership.admit(joined)
        entry = settle_entry(membership, opened.generation, opened.before, joined)
        fence_members(entry.dropped, membership)
        groups, side = self.survival.groups, self._side_timeout

        def batches() -> Any:  # by rank, at the admission round: a member lost in the admission kept those
            return engine.progress_at_failure(session.epoch).epoch_batches

        change = narrow(opened, entry, membership, opened.generation, batches)
        _mark(me, "entered")
        if change is None:
            return
        change = regroup(change, membership, groups, side, batches)
        if change is None:
            return
        _mark(me, "regrouped")
        if membership.rank == 0:
            first = {"module": trainer.lightning_module.state_dict(), "loop": loop_position(trainer),
                     "callbacks": callback_states(trainer),
                     "optimizers": [o.state_dict() for o in trainer.optimizers],
                     "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                     "job": self._job}
            sent = self._deliver(pack_state(first), change, membership)  # the bulk of an admission's time
            _mark(me, "state_sent", tensor_bytes=sent)
        # Whether every joiner has its state, the same answer on all: one that died or stalled while
        # it was sent is dropped, and the members build one more group, without it.
        delivered = settle_stage(membership, change, "delivered")
        fence_members(delivered.dropped, membership)
        if delivered.after != change.after:
            change = regroup(narrow(change, delivered, membership, change.generation + 1, batches), membership,
                             groups, side, batches, first=False)
            if change is None:
                return
        for holder in self.survival.holders():
            holder.apply_change(change)
        _mark(me, "applied")
        if change.is_join:
            if membership.rank == 0:
                self._send({"engine": engine.round_record(), "callback_role": session.callback_role.state_dict(),
                            "dispatch": sampler.state_for_joiner()}, change, membership)
                _mark(me, "rest_sent")
            # One more settlement on every rank, always: which joiners have their whole state.
            settle_joined(membership, change)
        self.survival.follow_up(change)
        _mark(me, "admit_end")
        _warn_joined(change, membership)

    @staticmethod
    def _deliver(packed: PackedState, change: Change, membership: Membership) -> int:
        """Rank 0: the state to each joiner, watching that joiner (one that is lost gets no more: the
        settlement after the delivery leaves it out)."""
        for rank in change.joined:
            joiner = change.after[rank]
            try:
                packed.send(rank, _watching(membership, joiner))
            except PeerFailure as failure:
                log.warning(f"ElCheStrategy: joiner {joiner} did not take its state ({failure}).")
        return packed.tensor_bytes

    @staticmethod
    def _send(payload: dict[str, Any], change: Change, membership: Membership) -> None:
        """Rank 0: the rest of the state, once every holder took the change, watching each joiner (one
        that is lost gets no more: the settlement after it leaves it out)."""
        packed = pack_state(payload)
        for rank in change.joined:
            joiner = change.after[rank]
            try:
                packed.send(rank, _watching(membership, joiner))
            except PeerFailure as failure:
                log.warning(f"ElCheStrategy: joiner {joiner} did not take the rest of its state ({failure}).")

    def fit_over(self, strategy: Any) -> None:
        self._over = True
        if self.admitter is not None and strategy.global_rank == 0:
            self.admitter.fit_over()

    @property
    def admits_joiners(self) -> bool:
        """Whether this member's fit admits joiners now (rank 0's launcher asks before it restarts a child)."""
        return self.admitter is not None and self.admitter.facts is not None and not self._over

    # -- the joiner ----------------------------------------------------------------------------------

    def connect(self, strategy: Any) -> None:
        """``setup_distributed`` of a joiner: the job's store, a member id in its registry, no group."""
        backend, timeout = prepare_joiner(strategy)
        self._address = job_address(strategy.cluster_environment)
        self._backend, self._timeout = backend, timeout
        store = job_store.connect(*self._address, timeout)
        self._link = JoinerLink(store, timeout.total_seconds())
        self._undo_quiet = quiet_collectives(strategy)
        try:
            job = self._link.job()
        except FitOver:
            self._leave(strategy, "it found the fit already ended")
        job_store.join(store, self._link.take_member_id(job.world_size))
        self._job_view = job

    def _admit(self, strategy: Any) -> str:
        assert self._link is not None
        trainer = strategy.lightning_module.trainer
        job = self._job_view
        preview = loader_of(preview_train_loader(trainer))
        self._facts = facts_of(strategy.elche.mode.value, strategy.lightning_module, preview)
        seed = injected_sampler_seed(trainer, preview)  # the members' facts are of the sampler Lightning put in
        if seed is not None:
            self._facts = replace(self._facts, seed=seed)
        difference = job.facts.mismatch(self._facts)
        secret = read_join_secret(*self._address)
        _mark(self._link.member, "ready")
        self._link.request(job, secret, self._facts)
        if difference is not None:  # the cohort refuses it too; say why here at once
            raise JoinRefused(f"ElCheStrategy(ELCHE_JOIN=1): this process cannot join the running fit: its "
                              f"{difference}.")
        try:
            generation, members, before = self._link.wait_admission(job.fit_prefix,
                                                                    strategy.liveness_timeout.total_seconds())
        except FitOver:
            self._leave(strategy, "the fit ended before it could admit this joiner")
        started = time.perf_counter()
        member = self._link.member
        _mark(member, "admitted")
        membership = Membership(self._link.store, job.fit_prefix, member, members[:before], strategy.liveness_timeout,
                                self._timeout, max_failure=strategy.elche.max_failure)
        try:
            entry = settle_entry(membership, generation, members[:before], members[before:])
        except RanksLost as left_out:
            membership.close()
            raise JoinRefused(f"ElCheStrategy: joiner {member} was dropped from its admission: {left_out}") from None
        change = Change(generation=generation, before=tuple(members[:before]), after=entry.after,
                        reasons=dict(entry.lost), detected_at=time.time(), regrouped_with="new group")
        membership.enter(change)
        self.membership = membership
        _mark(member, "entered")
        device = strategy.root_device if strategy.root_device.type == "cuda" else None
        change = self._join_group(membership, change, device)
        _mark(member, "regrouped")
        # Into its own parameters and buffers: memory already touched, and take_module copies nothing.
        self._first = self._take_first(membership, strategy.lightning_module.state_dict())
        _mark(member, "state_received")
        try:
            delivered = settle_stage(membership, change, "delivered")
        except RanksLost as left_out:
            self._dropped(membership, f"{left_out}")
        if delivered.after != change.after:  # a member or another joiner was left out: one more group
            change = self._join_group(membership, followed(membership, change, delivered), device)
        # The rest of the state is taken here at once: the members wait for it, and this joiner's
        # setup takes a second or more.
        self._rest = self._take_rest(membership, change)
        _mark(member, "rest_received")
        self._job = (str(self._first["job"][0]), str(self._first["job"][1]))
        strategy.set_world_ranks()  # Lightning's rank view follows the admitted rank
        rank_zero_info(f"ElCheStrategy: joined the running fit as rank {membership.rank} of {membership.world_size} "
                       f"(member {member}) in {time.perf_counter() - started:.2f} s.")
        _warn_joined(change, membership)
        return job.fit_prefix

    def _join_group(self, membership: Membership, change: Change, device: Optional[torch.device]) -> Change:
        """The joiner's side of :func:`regroup`: the group of ``change``'s generation, built watched
        and settled, again one generation on while a participant is left out; the change it
        ends with."""
        while True:
            built = init_generation_group_watched(membership, self._backend, self._timeout, device,
                                                  self._side_timeout)
            try:
                grouped = settle_stage(membership, change, "grouped")
            except RanksLost as left_out:
                self._dropped(membership, f"{left_out}")
            if grouped.after == change.after:
                if not built:
                    self._dropped(membership, "it could not build the admission's group while everyone else did")
                return change
            change = followed(membership, change, grouped)

    def _take_first(self, membership: Membership, into: Any) -> Any:
        """The joiner's state from rank 0, watching rank 0 and the settlement of the delivery (the
        others decided without this joiner): either ends the admission here, as a dropped joiner."""
        leader = membership.members[0]
        ends_on = settled_key(membership, membership.generation, "delivered")
        try:
            return recv_state(0, into={"module": into}, wait=_watching(membership, leader, ends_on))
        except PeerFailure as failure:
            self._dropped(membership, f"its state did not arrive: {failure}")

    def _take_rest(self, membership: Membership, change: Change) -> Any:
        """The rest of the state from rank 0 once the holders took the change, watching rank 0 and the
        settlement after it; then that settlement (:func:`settle_joined`). Lost rank 0, or left out
        there, this joiner never was a member: it leaves as a dropped joiner."""
        ends_on = settled_key(membership, membership.generation, "joined")
        try:
            rest = recv_state(0, wait=_watching(membership, membership.members[0], ends_on))
        except PeerFailure as failure:
            self._dropped(membership, f"the rest of its state did not arrive: {failure}")
        try:
            settle_joined(membership, change)
        except RanksLost as left_out:
            self._dropped(membership, f"{left_out}")
        return rest

    def _dropped(self, membership: Membership, why: str) -> NoReturn:
        """A joiner left out of its admission after its group was up: it says so (the members stop
        waiting for it at once), lets the group go and leaves."""
        if self._link is not None:
            self._link.mark_dropped()
        membership.leave(f"joiner {membership.original_rank} was dropped from its admission: {why}")
        abandon_side_group_ahead(membership)
        abandon_group(dist.group.WORLD, membership)
        membership.close()
        raise JoinRefused(f"ElCheStrategy: joiner {membership.original_rank} was dropped from its admission: {why}")

    def take_module(self, module: torch.nn.Module) -> None:
        """A joiner's ``configure_ddp``: the consensus parameters and buffers, before the plane is built."""
        assert self._first is not None
        module.load_state_dict(self._first["module"])

    def take_state(self, trainer: Trainer, engine: Any, session: Any) -> None:
        """A joiner, after Lightning set up its optimizers: the rest of the cohort's state."""
        assert self._first is not None
        first, self._first = self._first, None
        for optimizer, state in zip(trainer.optimizers, first["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        for config, state in zip(trainer.lr_scheduler_configs, first["schedulers"], strict=True):
            config.scheduler.load_state_dict(state)
        step_schedulers_for_admission_batch(trainer, first["loop"])  # rank 0's states are from before it
        position_loops(trainer, first["loop"])
        load_callback_states(trainer, first["callbacks"])
        second, self._rest = self._rest, None
        assert second is not None
        engine.join_from(second["engine"])
        session.callback_role.load_state_dict(second["callback_role"])
        self._dispatch = second["dispatch"]

    def training_starts(self, trainer: Trainer, rank: int) -> None:
        """The joiner trains from here on: its collectives are the cohort's again, and its
        evaluation loaders are cut again at the next validation, as the members' are after the change."""
        if self._undo_quiet is not None:
            self._undo_quiet()
            self._undo_quiet = None
            renumber_lightning_ranks(trainer, rank)
            if self.membership is not None:
                _mark(self.membership.original_rank, "training_starts")

    def _leave(self, strategy: Any, why: str) -> Any:
        # This process's own notice, whatever its rank: a child rank 0 restarted keeps its LOCAL_RANK,
        # so rank_zero_info stayed silent there.
        logging.getLogger("lightning.pytorch").info(f"ElCheStrategy(ELCHE_JOIN=1): nothing to join: {why}; exiting.")
        sys.stdout.flush()
        if strategy.job_store_link is not None:
            strategy.job_store_link.mark_exited("joiner: the fit was over")
        raise SystemExit(0)


__all__ = ["Growth", "RankJoinedWarning", "dispatch_store", "facts_of"]

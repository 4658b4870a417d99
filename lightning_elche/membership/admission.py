"""Admission: how a process started with ``ELCHE_JOIN=1`` becomes a member of a running fit.

Everything goes through the job's store, on keys under :data:`JOIN_PREFIX`:

1. At launch, global rank 0 publishes the job (``job``: a fresh job id and the launch world size)
   and creates the job's *join secret* (:func:`create_join_secret`): a file only the job's user
   can read, keyed by the store's address and port (or the user's ``ELCHE_JOIN_TOKEN``). Once the
   training data is known, the current rank 0 publishes the fit's facts (``fit``:
   :class:`FitFacts`).
2. A joiner connects, takes the next free member id (``next_member``), registers itself in the
   job's registry, builds its model and loaders, and leaves a :class:`JoinRequest` (its facts and
   a proof that it holds the secret, never the secret itself).
3. The cohort's rank 0 reads the request count once per round (:meth:`Admitter.waiting`, one store
   read) and judges new requests: a wrong proof, a request for an earlier job, or facts that
   differ from the fit's are refused, with the field named, in ``verdict/<member>``. The count of
   accepted joiners travels in rank 0's round metadata, so that every member decides the same
   admission at the same round.
4. At that round rank 0 offers admission (``admitter/<member>``: its own member id, then
   ``admit/<member>``) and waits briefly for each joiner's acknowledgement; a joiner that died or
   stalled meanwhile is dropped (it never was a member, so nothing counts against
   ``max_failure``). The admitted list lands in the generation's key (:meth:`Admitter.admit`),
   which every member and joiner reads: the new generation's members are the old ones in their
   order, then the joiners. Rank 0 lost before it left the list: the members agree on its loss
   and skip the admission; its joiners, watching ``admitter/<member>``, leave (dropped).

The store is torch's unauthenticated TCP store: anyone who reaches it can read every key, so the
secret never travels through it; a joiner proves it holds it with an HMAC over the job id and its
member id. Keep the store on the cluster's private network.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_elche.membership.agreement import Membership, exit_notice_prefix
from lightning_elche.membership.change import PeerFailure, RanksLost
from lightning_elche.membership.liveness import PeerSignals

log = logging.getLogger(__name__)

JOIN_PREFIX = "lightning_elche/join"
JOIN_ENV = "ELCHE_JOIN"
TOKEN_ENV = "ELCHE_JOIN_TOKEN"
ACK_TIMEOUT_S = 10.0
"""How long rank 0 waits for an accepted joiner to acknowledge its admission before dropping it."""


class JoinRefused(RuntimeError):
    """The running fit refused this joiner (the message names why)."""


class FitOver(Exception):
    """The fit this process meant to join has ended: the joiner has nothing to do."""


def joining_requested() -> bool:
    """Whether this process was started to join a running fit (``ELCHE_JOIN=1``)."""
    return os.environ.get(JOIN_ENV, "").strip() not in ("", "0")


def job_address(environment: Any) -> tuple[str, int]:
    """Where a joiner finds the job's store: its cluster environment's ``main_address`` and
    ``main_port``. A task of a new SLURM ``srun`` step sees its own step's node list, and Lightning
    would take the store to be on the step's first node; without ``MASTER_ADDR`` the job's store is
    on the allocation's first node (``SLURM_JOB_NODELIST``), where the training step's rank 0 runs."""
    allocation = os.environ.get("SLURM_JOB_NODELIST")
    if isinstance(environment, SLURMEnvironment) and "MASTER_ADDR" not in os.environ and allocation:
        os.environ["MASTER_ADDR"] = SLURMEnvironment.resolve_root_node_address(allocation)
    return str(environment.main_address), int(environment.main_port)


def key(name: str) -> str:
    return f"{JOIN_PREFIX}/{name}"


class JoinKnock:
    """Whether a joiner asked to join and no round has read its request yet.

    The heartbeat thread reads the job's request count once per beat (:meth:`observe`); the
    training loop asks once per step (:meth:`take`), which is a comparison of two integers, and
    ends its window when it says so. Every round answers the requests rank 0 read into it
    (:meth:`settle`): it admits them, schedules their admission or refuses them. A request that
    reached a member after rank 0 had built its row (rank 0 waiting in the round while the others
    finished their windows) is not in that round, so it ends the member's next window again: the
    members' ends stay together, and none waits a whole window in a round that others reach late.
    Requests made before this rank started are not a knock (the next round reads them anyway);
    a window ends at most once per round, and a request ends at most two windows of a member
    (bounded even where no rank 0 reads requests).
    """

    def __init__(self, store: Any) -> None:
        self._answered = self._seen = int(store.add(key("requests"), 0))
        self._armed = True
        self._knocked_for = self._answered

    def observe(self, store: Any) -> None:
        self._seen = int(store.add(key("requests"), 0))

    def take(self) -> bool:
        seen = self._seen
        if not self._armed or seen <= self._answered:
            return False
        self._armed = False
        if seen == self._knocked_for:  # its second window for the same requests: the last one
            self._answered = seen
        self._knocked_for = seen
        return True

    def settle(self, read: int) -> None:
        """After every round: the requests rank 0 had read (``read``, from its row) are answered."""
        self._answered = max(self._answered, read)
        self._armed = True


# -- the job's secret -------------------------------------------------------------------------------


def token_path(address: str, port: int) -> Path:
    """Where the job on ``address:port`` keeps its join secret (readable by its user only)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in address)
    return base / "lightning_elche" / f"join-{safe}-{port}.json"


def create_join_secret(address: str, port: int) -> tuple[str, str]:
    """A fresh job id and the job's join secret (``ELCHE_JOIN_TOKEN`` when given); the pair is written
    to :func:`token_path` with mode 0600, so that a joiner started by the same user finds it."""
    job_id = secrets.token_hex(8)
    secret = os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
    path = token_path(address, port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump({"job": job_id, "secret": secret}, handle)
    os.replace(partial, path)
    return job_id, secret


def read_join_secret(address: str, port: int) -> Optional[str]:
    """This joiner's secret: ``ELCHE_JOIN_TOKEN``, else the job's file (None: neither)."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given
    try:
        return str(json.loads(token_path(address, port).read_text())["secret"])
    except (OSError, ValueError, KeyError):
        return None


def proof(secret: str, job_id: str, member: int) -> str:
    return hmac.new(secret.encode(), f"{job_id}:{member}".encode(), hashlib.sha256).hexdigest()


def publish_job(store: Any, job_id: str, world_size: int) -> None:
    """At launch (global rank 0): the job's id and its launch world size (joiners' ids follow it)."""
    store.set(key("job"), json.dumps({"job": job_id, "world_size": world_size}))


# -- what must match ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FitFacts:
    """What a joiner must share with the fit to average with it and take a share of its data."""

    mode: str
    signature: float
    """The averaging layout's signature (names, shapes and dtypes of what rounds average)."""
    dataset_len: int
    batch_size: int
    seed: int
    shuffle: bool
    drop_last: bool

    def mismatch(self, theirs: FitFacts) -> Optional[str]:
        """The first field in which ``theirs`` differs, described; None when they agree."""
        labels = {"signature": "model (averaging layout signature)"}
        for name, mine in asdict(self).items():
            other = getattr(theirs, name)
            if mine != other:
                return f"{labels.get(name, name)}: the fit has {mine!r}, the joiner {other!r}"
        return None

    @classmethod
    def from_json(cls, value: Any) -> FitFacts:
        return cls(**json.loads(value))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class JoinRequest:
    member: int
    job: str
    proof: str
    facts: FitFacts

    def to_json(self) -> str:
        return json.dumps({"member": self.member, "job": self.job, "proof": self.proof, "facts": asdict(self.facts)})

    @classmethod
    def from_json(cls, value: Any) -> JoinRequest:
        fields = json.loads(value)
        return cls(int(fields["member"]), str(fields["job"]), str(fields["proof"]), FitFacts(**fields["facts"]))


def judge(request: JoinRequest, job_id: str, secret: str, facts: FitFacts) -> Optional[str]:
    """Why ``request`` is refused (None: accepted). Names the field; never shows the secret."""
    if request.job != job_id:
        return (f"it was started for an earlier job ({request.job}) on this address and port, not the running "
                f"job ({job_id})")
    if not hmac.compare_digest(request.proof, proof(secret, job_id, request.member)):
        return (f"missing or wrong join token: set {TOKEN_ENV} to the job's token, or start the joiner as the "
                "job's user on a host that sees its token file")
    difference = facts.mismatch(request.facts)
    return None if difference is None else f"its {difference}"


# -- the cohort's side ----------------------------------------------------------------------------


class Admitter:
    """The cohort's side of admission, on every member; rank 0 of the current numbering judges.

    Args:
        membership: this member's view of the fit (its store, numbering, liveness).
        job_id, secret: the job's (every member holds them; rank 0 uses them).
    """

    def __init__(self, membership: Membership, job_id: str, secret: str) -> None:
        self.membership = membership
        self.job_id = job_id
        self.secret = secret
        self.facts: Optional[FitFacts] = None
        self._judged = 0
        self._queue: list[int] = []  # accepted joiners not yet offered admission, in request order

    @property
    def store(self) -> Any:
        return self.membership.store

    def publish(self, facts: FitFacts) -> None:
        """The fit's facts (rank 0, once the training data is known); a new fit reopens admission."""
        self.facts = facts
        if self.membership.rank == 0:
            self.store.set(key("fit"), json.dumps({"fit_prefix": self.membership.fit_prefix, "job": self.job_id,
                                                   "facts": asdict(facts)}))
            if self.store.check([key("fit_over")]):
                self.store.delete_key(key("fit_over"))

    def fit_over(self) -> None:
        """The fit ended (rank 0): joiners still waiting exit."""
        if self.membership.rank == 0:
            self.store.set(key("fit_over"), "1")

    def waiting(self) -> int:
        """Rank 0, once per round: judge new requests; the count of accepted joiners waiting."""
        if self.facts is None:
            return 0
        count = int(self.store.add(key("requests"), 0))
        while self._judged < count:
            index, self._judged = self._judged, self._judged + 1
            self._judge(JoinRequest.from_json(self.store.get(key(f"request/{index}"))))
        return len(self._queue)

    def requests_read(self) -> int:
        """Rank 0: the requests :meth:`waiting` has read and judged so far."""
        return self._judged

    def _judge(self, request: JoinRequest) -> None:
        assert self.facts is not None
        if request.member in self.membership.members or request.member in self._queue:
            return
        why = judge(request, self.job_id, self.secret, self.facts)
        if why is None and self.store.check([key(f"dropped/{request.member}")]):
            return
        verdict = "accepted" if why is None else f"refused: {why}"
        verdict = self.store.compare_set(key(f"verdict/{request.member}"), "", verdict).decode()
        if verdict == "accepted":
            self._queue.append(request.member)
        else:
            log.warning(f"ElCheStrategy refused joiner {request.member}: {verdict.removeprefix('refused: ')}")

    def admit(self, count: int) -> list[int]:
        """Every member, at the admission round: the joiners admitted now (``count`` from rank 0's
        metadata). Rank 0 offers admission to the first ``count`` accepted joiners, drops those that
        do not acknowledge in time, and leaves the list in the next generation's key."""
        membership = self.membership
        generation = membership.generation + 1
        record = admitted_key(membership.fit_prefix, generation)
        if membership.rank == 0:
            offered, self._queue = self._queue[:count], self._queue[count:]
            admitted = [m for m in offered if self._acknowledged(m, generation)]
            self.store.set(record, json.dumps({"after": [*membership.members, *admitted],
                                               "before": len(membership.members)}))
        else:
            self._wait_for_list(record, membership.members[0])
        after = json.loads(self.store.get(record))["after"]
        return [int(m) for m in after[len(membership.members):]]

    def _wait_for_list(self, record: str, leader: int) -> None:
        """A member other than rank 0: wait for the admitted list while rank 0 lives.

        Raises:
            PeerFailure: rank 0 was lost before it left the list (the members agree on its loss
                as on any other, and skip this admission; its joiners see it and leave)."""
        try:
            self.membership.wait_for_key(record, leader)
        except RanksLost as lost:
            if not self.store.check([record]):  # it may have left the list just before it was lost
                raise PeerFailure(f"rank 0 (member {leader}) was lost while it offered an admission") from lost

    def _acknowledged(self, member: int, generation: int) -> bool:
        # Who offers: the joiner watches it until the list is out, and leaves if it is lost first.
        self.store.set(key(f"admitter/{member}"), str(self.membership.original_rank))
        self.store.set(key(f"admit/{member}"), str(generation))
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.store.check([key(f"ack/{member}")]):
                return True
            if self.membership.signals.lost([member]):
                break
            time.sleep(0.01)
        self.store.set(key(f"dropped/{member}"), "1")
        log.warning(f"ElCheStrategy dropped joiner {member}: it did not acknowledge its admission (it never was a "
                    "member; nothing counts against max_failure).")
        return False


def admitted_key(fit_prefix: str, generation: int) -> str:
    return f"{fit_prefix}/membership/gen{generation}/admitted"


# -- the joiner's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobView:
    """The running job as a joiner finds it in the store."""

    job: str
    world_size: int
    fit_prefix: str
    facts: FitFacts


class JoinerLink:
    """A joiner's steps through admission (one process, one joining rank).

    Args:
        store: the job's store.
        timeout_s: how long the joiner waits for the fit to publish itself and then to admit it.
    """

    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.member = -1

    def job(self) -> JobView:
        """The running fit (waits for it to publish its facts)."""
        self._wait_for([key("job"), key("fit")], "the job to publish its fit")
        job = json.loads(self.store.get(key("job")))
        if self.store.check([key("fit_over")]):
            raise FitOver("the fit has already ended")
        fit = json.loads(self.store.get(key("fit")))
        return JobView(str(job["job"]), int(job["world_size"]), str(fit["fit_prefix"]), FitFacts(**fit["facts"]))

    def take_member_id(self, launch_world_size: int) -> int:
        self.member = launch_world_size - 1 + int(self.store.add(key("next_member"), 1))
        return self.member

    def request(self, job: JobView, secret: Optional[str], facts: FitFacts) -> None:
        signed = proof(secret, job.job, self.member) if secret else ""
        index = int(self.store.add(key("requests"), 1)) - 1
        self.store.set(key(f"request/{index}"), JoinRequest(self.member, job.job, signed, facts).to_json())

    def wait_admission(self, fit_prefix: str, liveness_timeout_s: float) -> tuple[int, list[int], int]:
        """The generation this joiner was admitted in, its members in rank order, and how many of
        them were members before. Once it acknowledged, it waits for the admitted list while the
        member that offered the admission lives (``liveness_timeout_s``: how long a silent one
        is waited for).

        Raises:
            JoinRefused: refused (a wrong token, another job, a different model or data), dropped,
                the member that admitted it was lost, or not admitted within the timeout.
            FitOver: the fit ended before it could admit this joiner."""
        verdict_key, admit_key = key(f"verdict/{self.member}"), key(f"admit/{self.member}")
        while True:
            if self.store.check([verdict_key]):
                verdict = self.store.get(verdict_key).decode()
                if verdict != "accepted":
                    raise JoinRefused(f"ElCheStrategy: the running fit {verdict} (joiner {self.member}).")
            if self.store.check([admit_key]):
                break
            if self.store.check([key("fit_over")]):
                raise FitOver("the fit ended before it admitted this joiner")
            self._check_deadline("admission")
            time.sleep(0.05)
        generation = int(self.store.get(admit_key))
        self.store.set(key(f"ack/{self.member}"), "1")
        record = admitted_key(fit_prefix, generation)
        admitter = int(self.store.get(key(f"admitter/{self.member}")))
        signals = PeerSignals(self.store, exit_notice_prefix(fit_prefix), liveness_timeout_s)
        while not self.store.check([record]):
            lost = signals.lost([admitter])
            if lost and not self.store.check([record]):
                self.mark_dropped()
                raise JoinRefused(f"ElCheStrategy: joiner {self.member} was dropped from its admission: the member "
                                  f"that offered it ({admitter}) was lost ({lost[admitter]}) before it named the "
                                  "new generation.")
            self._check_deadline("the admitted list")
            time.sleep(0.05)
        admitted = json.loads(self.store.get(record))
        members = [int(m) for m in admitted["after"]]
        if self.member not in members:
            raise JoinRefused(f"ElCheStrategy: joiner {self.member} was dropped from its admission (it acknowledged "
                              f"too late, after {ACK_TIMEOUT_S:.0f} s).")
        return generation, members, int(admitted["before"])

    def mark_dropped(self) -> None:
        """This joiner leaves its admission: a later rank 0 (the one that offered it was lost) does
        not offer it again."""
        self.store.set(key(f"dropped/{self.member}"), "1")

    def _wait_for(self, keys: Sequence[str], what: str) -> None:
        while not self.store.check(list(keys)):
            self._check_deadline(what)
            time.sleep(0.05)

    def _check_deadline(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise JoinRefused(
                f"ElCheStrategy(ELCHE_JOIN=1): waited {self.timeout_s:.0f} s for {what} and gave up. Is a fit "
                "running on MASTER_ADDR:MASTER_PORT? Raise ElCheStrategy(timeout=...) to wait longer."
            )

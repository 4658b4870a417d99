"""The membership change: one value for losses, joins and both, and the one order survival follows."""

from __future__ import annotations

from typing import Optional

import pytest

from lightning_elche.membership.agreement import RoundProgress
from lightning_elche.membership.change import Change, PeerFailure, combined
from lightning_elche.membership.stall import ProgressStamp
from lightning_elche.membership.survival import ChangeListeners, Survival


def test_a_loss_renumbers_the_survivors_densely_in_their_old_order() -> None:
    change = Change(generation=1, before=(0, 1, 2, 3), after=(0, 2, 3), reasons={1: "gone"}, trained_batches={1: 5})
    assert change.lost == [1] and change.survivors == [0, 2, 3] and change.joined == []
    assert [change.new_rank(k) for k in range(4)] == [0, None, 1, 2]
    assert change.trained_by_old_rank() == {1: 5}
    assert change.is_loss and not change.is_join
    assert change.describe() == "lost rank 1 (gone)"


def test_joiners_take_the_last_ranks_and_have_no_old_rank() -> None:
    change = Change(generation=2, before=(0, 2, 3), after=(0, 3, 7, 8), reasons={2: "gone"})
    assert change.survivors == [0, 2] and change.joined == [2, 3] and change.joined_ids == (7, 8)
    assert [change.old_rank(k) for k in range(4)] == [0, 2, None, None]
    assert change.carry(["a", "b", "c"], lambda: "new") == ["a", "c", "new", "new"]
    assert change.is_loss and change.is_join
    assert change.describe() == "lost rank 2 (gone); joined rank 7, rank 8"
    # Joiners admitted together take ranks in the order they asked; the message names them by id.
    assert Change(generation=3, before=(0,), after=(0, 8, 7)).describe() == "joined rank 7, rank 8"


@pytest.mark.parametrize(
    ("before", "after", "message"),
    [((0, 1), (1, 0), "stay first"), ((0, 1), (0, 0), "distinct"), ((0, 1), (), "at least one")],
)
def test_a_malformed_change_is_refused(before: tuple[int, ...], after: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Change(generation=1, before=before, after=after)


def test_a_dropped_joiner_leaves_like_a_lost_rank_but_is_not_counted() -> None:
    change = Change(generation=3, before=(0, 1, 2), after=(1,), reasons={0: "gone", 2: "no rest"}, dropped=(2,))
    assert change.lost_ids == (0, 2) and change.counted_lost == 1 and change.is_loss
    assert change.describe() == "lost rank 0 (gone); dropped joiner 2 (no rest)"
    with pytest.raises(ValueError, match=r"Change\(dropped=\[1\]\) is invalid: expected members that leave"):
        Change(generation=3, before=(0, 1, 2), after=(1,), dropped=(1,))


def test_changes_agreed_one_after_the_other_are_one_change_in_the_first_numbering() -> None:
    first = Change(generation=1, before=(0, 1, 2, 3), after=(0, 2, 3), reasons={1: "a"}, detected_at=5.0)
    second = Change(generation=2, before=(0, 2, 3), after=(0, 2), reasons={3: "b"}, ends_fit=True)
    both = combined([first, second])
    assert both.generation == 2 and both.before == (0, 1, 2, 3) and both.after == (0, 2)
    assert both.lost == [1, 3] and both.reasons == {1: "a", 3: "b"} and both.ends_fit and both.detected_at == 5.0


class Holder:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def apply_change(self, change: Change) -> None:
        self.log.append(self.name)


class FakeMembership:
    def __init__(self, change: Change) -> None:
        self.change, self.recorded, self.world_size, self.lost_count, self.limit = change, [], 2, 1, None
        self.progress = ProgressStamp()
        self.epoch_batches: Optional[list[int]] = None

    def agree(self, cause: BaseException, progress: RoundProgress) -> Change:
        self.epoch_batches = list(progress.epoch_batches)
        return self.change

    def record(self, change: Change) -> None:
        self.recorded.append(change)

    def process_of(self, member: int) -> None:
        return None

    def left_a_notice(self, member: int) -> bool:
        return False


class Recovery:
    def progress(self, epoch: Optional[int]) -> RoundProgress:
        return RoundProgress(3, (6, 0, 2)) if epoch == 4 else RoundProgress()

    def round_record(self) -> bytes:
        raise AssertionError("nobody is behind")

    def catch_up(self, record: bytes) -> None:
        raise AssertionError("nobody is behind")


class FakeGroups:
    def rebuild(self, change: Change) -> str:
        return "new group"


def test_survival_hands_one_change_to_every_holder_in_order_then_warns() -> None:
    log: list[str] = []
    change = Change(generation=1, before=(0, 1, 2), after=(0, 2), reasons={1: "gone"})
    membership = FakeMembership(change)
    dispatch = Holder("dispatch", log)
    dispatch.returned_batches = 3  # type: ignore[attr-defined]
    dispatch.epoch = 4  # type: ignore[attr-defined]  # opened before the session's next batch (soak trial 0.153)
    survival = Survival(
        membership, FakeGroups(),  # type: ignore[arg-type]
        holders=lambda: [Holder("lightning", log), Holder("session", log), dispatch, Holder("engine", log)],
        handover=lambda: dispatch,  # type: ignore[arg-type, return-value]
        recovery=Recovery(), epoch=lambda: 3, keep_epoch_open=lambda: log.append("epoch stays open"),
    )
    with pytest.warns(UserWarning, match="lost rank 1 \\(gone\\)"):
        applied = survival.after_failed_round(PeerFailure("closed"))
    assert log == ["lightning", "session", "dispatch", "engine", "epoch stays open"]
    assert membership.epoch_batches == [6, 0, 2]
    assert applied.regrouped_with == "new group" and membership.recorded == [applied]


def test_change_listeners_hear_every_change_and_loss_listeners_only_losses() -> None:
    heard: list[str] = []
    listeners = ChangeListeners()
    listeners.on_change.append(lambda change: heard.append(f"change {change.generation}"))
    listeners.on_loss.append(lambda change: heard.append(f"loss {change.generation}"))
    listeners.apply_change(Change(generation=1, before=(0, 1), after=(0,)))
    listeners.apply_change(Change(generation=2, before=(0,), after=(0, 5)))
    assert heard == ["change 1", "loss 1", "change 2"]

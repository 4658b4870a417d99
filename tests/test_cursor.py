"""The sampler's lifecycle within an epoch, as one state (no sampler, no store)."""

import pytest

from lightning_elche.dispatch import Cursor, Phase
from lightning_elche.dispatch.cursor import Opening


def test_an_epoch_without_changes_sets_up_at_each_iteration():
    cursor = Cursor(epoch=3)
    assert cursor.phase is Phase.FRESH and cursor.needs_set_up and not cursor.started
    assert cursor.open(rank=0) is Opening.SET_UP and cursor.phase is Phase.OPEN
    cursor.close()
    assert cursor.phase is Phase.ENDED and not cursor.wants_reopen  # nothing moved: nothing to reopen for
    assert cursor.open(rank=0) is Opening.SET_UP  # iterated again: the epoch anew, as before any change


def test_a_change_before_the_rank_started_sets_the_epoch_up_once():
    cursor = Cursor(epoch=1)
    assert cursor.needs_set_up
    cursor.apply_change()
    assert cursor.phase is Phase.READY and cursor.changes == 1 and not cursor.needs_set_up
    cursor.apply_change()
    assert cursor.phase is Phase.READY and cursor.changes == 2
    assert cursor.open(rank=2) is Opening.START


def test_after_a_change_an_ended_iterator_reopens_and_continues():
    cursor = Cursor(epoch=0)
    cursor.open(rank=1)
    cursor.opening_picks = 12
    cursor.apply_change()
    assert cursor.phase is Phase.OPEN and not cursor.wants_reopen  # still iterating: no reopen
    with pytest.raises(RuntimeError, match="has not ended"):
        cursor.reopen(rank=1)
    cursor.close()
    assert cursor.wants_reopen
    cursor.reopen(rank=1)
    assert cursor.phase is Phase.REOPENING
    assert cursor.open(rank=1) is Opening.CONTINUE and cursor.opening_picks == 0
    with pytest.raises(RuntimeError, match="iterated again in epoch 0 after a membership change without reopen"):
        cursor.open(rank=1)


def test_a_new_epoch_starts_fresh_and_the_same_epoch_keeps_its_state():
    cursor = Cursor(epoch=4)
    cursor.open(rank=0)
    cursor.apply_change()
    cursor.set_epoch(4)
    assert cursor.changes == 1 and cursor.phase is Phase.OPEN
    cursor.set_epoch(5)
    assert (cursor.epoch, cursor.phase, cursor.changes, cursor.opening_picks) == (5, Phase.FRESH, 0, 0)


def test_reopen_before_the_epoch_started_is_refused():
    with pytest.raises(RuntimeError, match="the epoch never started"):
        Cursor(epoch=2).reopen(rank=0)

"""Where a rank's sampler is in its epoch: one explicit state instead of flags.

An epoch may be iterated in several *openings*: after a membership change a rank whose iterator
had ended continues the epoch with the work the change handed it (``reopen``). An opening ends
when the work it reached does not start on a batch boundary, so that every rank's batches are the
same whatever the timing, as its peers compute them after it is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Phase(Enum):
    """The rank's iterator of the current epoch."""

    FRESH = "fresh"
    """The epoch is not set up on this rank: its next iterator sets it up and starts it."""
    READY = "ready"
    """A membership change set the epoch up before this rank started it (or this rank joined the
    epoch): its next iterator starts the epoch as the changes left it."""
    OPEN = "open"
    """An iterator of the epoch is live (or was abandoned before its end)."""
    ENDED = "ended"
    """This rank's latest iterator of the epoch ran to its end."""
    REOPENING = "reopening"
    """``reopen()`` was called: the next iterator continues the epoch."""


class Opening(Enum):
    """What the next iterator of the epoch does."""

    SET_UP = "set up"  # set the epoch's dispatch up afresh, then start it
    START = "start"  # start the epoch as membership changes set it up
    CONTINUE = "continue"  # continue the epoch where this rank's last opening ended


@dataclass
class Cursor:
    """The sampler's lifecycle within one epoch.

    ``changes`` counts the membership changes applied within the epoch: 0 while the epoch's
    dispatch is the one it started with. ``opening_picks`` counts the picks the current opening
    yielded (an opening stops claiming after a short batch).
    """

    epoch: int = 0
    phase: Phase = Phase.FRESH
    changes: int = 0
    opening_picks: int = 0

    @property
    def changed(self) -> bool:
        """A membership change happened within the epoch."""
        return self.changes > 0

    @property
    def started(self) -> bool:
        """This rank iterated the epoch (an opening started)."""
        return self.phase in (Phase.OPEN, Phase.ENDED, Phase.REOPENING)

    @property
    def ended(self) -> bool:
        """This rank's latest iterator of the epoch ran to its end."""
        return self.phase in (Phase.ENDED, Phase.REOPENING)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.phase, self.changes, self.opening_picks = epoch, Phase.FRESH, 0, 0

    def open(self, rank: int) -> Opening:
        """An iterator of the epoch starts; what it does."""
        if self.phase is Phase.REOPENING:
            opening = Opening.CONTINUE
        elif self.changed and self.started:
            raise RuntimeError(
                f"Rank {rank}'s training DataLoader was iterated again in epoch {self.epoch} after a "
                "membership change without reopen(): the epoch's work would be dispatched twice."
            )
        elif self.phase is Phase.READY:
            opening = Opening.START
        else:
            opening = Opening.SET_UP  # a fresh epoch, or the same one iterated again before any change
        self.phase = Phase.OPEN
        self.opening_picks = 0
        return opening

    def close(self) -> None:
        """The iterator ran to its end."""
        self.phase = Phase.ENDED

    @property
    def needs_set_up(self) -> bool:
        """A membership change arriving now must set the epoch up first: this rank has neither
        started it nor seen a change in it."""
        return self.phase is Phase.FRESH

    def apply_change(self) -> None:
        """A membership change was applied to the epoch (after it was set up, if it needed it)."""
        self.changes += 1
        if self.phase is Phase.FRESH:
            self.phase = Phase.READY

    @property
    def wants_reopen(self) -> bool:
        """Only an ended iterator of an epoch with a change may find more work."""
        return self.ended and self.changed

    def reopen(self, rank: int) -> None:
        if not self.ended:
            raise RuntimeError(
                f"reopen() continues epoch {self.epoch} after rank {rank}'s iterator of it ended; "
                "that iterator has not ended (or the epoch never started)."
            )
        self.phase = Phase.REOPENING

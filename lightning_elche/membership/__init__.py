"""Who is in the fit: the membership change every holder follows, how it is decided, how the
survivors carry on.

* :mod:`~lightning_elche.membership.change`: :class:`Change`, the one value of a change of
  members (pure, no torch);
* :mod:`~lightning_elche.membership.agreement`: :class:`Membership`, liveness and the agreement
  that decides every change, in one place;

Only the pure value and the errors are re-exported here, so that importing the package pulls in
nothing else.
"""

from lightning_elche.membership.change import Change, ChangeHolder, MaxFailure, PeerFailure, RanksLost

__all__ = ["Change", "ChangeHolder", "MaxFailure", "PeerFailure", "RanksLost"]

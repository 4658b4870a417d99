"""Outer optimizers: a step on the averaged parameters before the ranks adopt them.

After each realized round the cohort holds a work-weighted consensus of its replicas. An outer
optimizer turns that consensus into the new *global* parameters, treating
``g = prev_global - consensus`` (the drift of the window, averaged over ranks) as a
pseudo-gradient:

* :class:`OuterAvg` (default): ``new = consensus``, plain local SGD.
* :class:`SlowMo`: heavy-ball momentum, ``v = mu*v + g``, ``new = prev - lr*v``.
* :class:`DiLoCo`: Nesterov momentum, ``v = mu*v + g``, ``new = prev - lr*(mu*v + g)``; the ranks
  reset their inner optimizer after adopting (:attr:`OuterOptimizer.resets_inner`).

Only parameters go through an outer optimizer (buffers pass through), and only on rounds that
carried mass: a zero-mass round must not call :meth:`OuterOptimizer.step`. Every step is
deterministic, so running it on every rank after a collective keeps the ranks identical.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_elche.checks import as_real, is_number

__all__ = ["DiLoCo", "OuterAvg", "OuterOptimizer", "SlowMo"]


def _invalid(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{owner}.{name}={value!r} is invalid: {allowed}.")


def _work_dtype(tensor: torch.Tensor) -> torch.dtype:
    # f32 at least: bf16/f16 parameters would lose the small drift g in their own precision.
    return torch.promote_types(tensor.dtype, torch.float32)


def _check_consensus(owner: str, consensus: Any) -> list[torch.Tensor]:
    if not isinstance(consensus, Sequence) or not all(
        isinstance(t, torch.Tensor) and t.is_floating_point() for t in consensus
    ):
        raise _invalid(owner, "step(consensus)", consensus, "expected a list of float tensors")
    return list(consensus)


def _check_tensor_list(owner: str, key: str, value: Any) -> Optional[list[torch.Tensor]]:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) and t.is_floating_point() for t in value
    ):
        raise _invalid(owner, f"state[{key!r}]", value, "expected a list of float tensors or None")
    return [t.detach().clone() for t in value]


class OuterOptimizer(abc.ABC):
    """A transform of the parameter consensus into the new global parameters, in place.

    The caller passes the consensus tensors of one realized round, in a fixed parameter order,
    to :meth:`step`; afterwards they hold the parameters every rank adopts. The first call (and
    the first after :meth:`reset`, or after a resume whose state has no ``prev_global``) only
    records the consensus as the global: there is no previous global to take a drift against.
    """

    @abc.abstractmethod
    def step(self, consensus: list[torch.Tensor]) -> None:
        """Overwrite ``consensus`` in place with the new global parameters."""

    @property
    def resets_inner(self) -> bool:
        """Whether ranks must reset their inner optimizer's state after adopting the result."""
        return False

    @property
    def last_step_norm(self) -> float:
        """``||new - consensus||`` of the latest :meth:`step` over all tensors (0.0 for none)."""
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume faithfully (tensors allowed)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore from :meth:`state_dict`."""

    def reset(self) -> None:  # noqa: B027
        """Forget all state, as if freshly built."""


class OuterAvg(OuterOptimizer):
    """Identity: the consensus is the new global (plain local SGD). Stateless."""

    def step(self, consensus: list[torch.Tensor]) -> None:
        """Leave ``consensus`` unchanged."""
        _check_consensus("OuterAvg", consensus)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accept the empty state; refuse another variant's (a resume must not drop momentum)."""
        kind = state.get("kind", "OuterAvg")
        if kind != "OuterAvg":
            raise _invalid("OuterAvg", "state['kind']", kind, "expected state saved by OuterAvg")

    def __repr__(self) -> str:
        return "OuterAvg()"


class _MomentumOuter(OuterOptimizer):
    """Shared state of the momentum variants.

    Holds, once the first step has run, ``prev_global`` and the velocity ``v`` (one tensor per
    parameter, at least f32, on the consensus' device) and an f32 scratch tensor for each
    lower-precision parameter. After that first step no parameter-sized tensor is allocated.
    """

    def __init__(self, lr: float, momentum: float) -> None:
        owner = type(self).__name__
        if as_real(lr) is None or not lr > 0.0:
            raise _invalid(owner, "lr", lr, "expected a finite number > 0")
        if not is_number(momentum) or not (0.0 <= momentum < 1.0):
            raise _invalid(owner, "momentum", momentum, "expected a number in [0, 1)")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self._prev: Optional[list[torch.Tensor]] = None
        self._velocity: Optional[list[torch.Tensor]] = None
        self._scratch: list[Optional[torch.Tensor]] = []
        # Buffers restored from a checkpoint are checked and moved to the consensus' device once.
        self._placed = False
        self._step_norms: Optional[list[torch.Tensor]] = None
        self._step_norm_value: Optional[float] = 0.0

    @abc.abstractmethod
    def _update(self, prev: list[torch.Tensor], velocity: list[torch.Tensor], work: list[torch.Tensor]) -> None:
        """Advance ``velocity`` and turn ``prev`` into the new global, all in place.

        On entry ``work`` holds ``d = consensus - prev`` (the negated pseudo-gradient); on exit
        it must hold ``new - consensus``, the step taken, for :attr:`last_step_norm`.
        """

    def step(self, consensus: list[torch.Tensor]) -> None:
        """Apply one outer step to ``consensus`` in place (see the class docstring for the rule).

        The math runs in f32 (f64 parameters stay f64); lower-precision tensors are cast in,
        stepped and cast back.
        """
        owner = type(self).__name__
        consensus = _check_consensus(owner, consensus)
        if not consensus:
            # A model without parameters: nothing to step (and foreach ops reject empty lists).
            self._step_norms, self._step_norm_value = None, 0.0
            return
        with torch.no_grad():
            if not self._placed:
                self._place(consensus)
            if self._prev is None:
                self._prev = [c.detach().to(_work_dtype(c), copy=True) for c in consensus]
                if self._velocity is None:
                    self._velocity = [torch.zeros_like(p) for p in self._prev]
                self._alloc_scratch(consensus)
                self._step_norms, self._step_norm_value = None, 0.0
                return
            if len(consensus) != len(self._prev):
                raise ValueError(
                    f"{owner}.step(consensus) got {len(consensus)} tensors: expected "
                    f"{len(self._prev)}, one per parameter as in earlier steps."
                )
            work: list[torch.Tensor] = []
            for i, (c, p) in enumerate(zip(consensus, self._prev, strict=True)):
                if c.dtype == p.dtype:
                    # Same precision: the consensus tensor itself serves as scratch.
                    work.append(c)
                    continue
                scratch = self._scratch[i]
                if scratch is None:
                    scratch = self._scratch[i] = torch.empty_like(p)
                scratch.copy_(c)
                work.append(scratch)
            assert self._velocity is not None
            torch._foreach_sub_(work, self._prev)
            self._update(self._prev, self._velocity, work)
            self._step_norms = list(torch._foreach_norm(work))
            self._step_norm_value = None
            torch._foreach_copy_(consensus, self._prev)

    def _place(self, consensus: list[torch.Tensor]) -> None:
        owner = type(self).__name__
        self._scratch = []
        shapes = [tuple(t.shape) for t in consensus]
        for key, name in (("_prev", "prev_global"), ("_velocity", "velocity")):
            buffers: Optional[list[torch.Tensor]] = getattr(self, key)
            if buffers is None:
                continue
            if [tuple(b.shape) for b in buffers] != shapes:
                raise _invalid(
                    owner,
                    f"state[{name!r}]",
                    [tuple(b.shape) for b in buffers],
                    f"its shapes must match the parameters' {shapes}",
                )
            placed = [b.to(c.device, _work_dtype(c)) for b, c in zip(buffers, consensus, strict=True)]
            setattr(self, key, placed)
        if self._prev is not None:
            self._alloc_scratch(consensus)
        self._placed = True

    def _alloc_scratch(self, consensus: list[torch.Tensor]) -> None:
        assert self._prev is not None
        self._scratch = [
            None if c.dtype == p.dtype else torch.empty_like(p) for c, p in zip(consensus, self._prev, strict=True)
        ]

    @property
    def last_step_norm(self) -> float:
        """``||new - consensus||`` of the latest step over all tensors; 0.0 after a recording step.

        Computed on first read, so logging it costs no device sync inside the step.
        """
        if self._step_norm_value is None:
            norms = self._step_norms or []
            self._step_norm_value = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        return self._step_norm_value

    def state_dict(self) -> dict[str, Any]:
        """``{"kind", "velocity", "prev_global"}``: copies of the tensors (``None`` before a step).

        Saving ``prev_global`` lets a resumed run take its first step against the same global,
        exactly as if it had not stopped.
        """

        def copy(buffers: Optional[list[torch.Tensor]]) -> Optional[list[torch.Tensor]]:
            return None if buffers is None else [b.detach().clone() for b in buffers]

        return {
            "kind": type(self).__name__,
            "velocity": copy(self._velocity),
            "prev_global": copy(self._prev),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; without ``prev_global`` the next step only records.

        The tensors are checked against the parameters and moved to their device at the next
        :meth:`step`.
        """
        owner = type(self).__name__
        kind = state.get("kind", owner)
        if kind != owner:
            raise _invalid(owner, "state['kind']", kind, f"expected state saved by {owner}")
        velocity = _check_tensor_list(owner, "velocity", state.get("velocity"))
        prev = _check_tensor_list(owner, "prev_global", state.get("prev_global"))
        if velocity is not None and prev is not None and len(velocity) != len(prev):
            raise ValueError(
                f"{owner}.state['velocity'] has {len(velocity)} tensors: expected one per "
                f"parameter, like state['prev_global'] ({len(prev)})."
            )
        self._velocity, self._prev = velocity, prev
        self._scratch = []
        self._placed = False
        self._step_norms, self._step_norm_value = None, 0.0

    def reset(self) -> None:
        """Drop the velocity and the previous global: the next step only records."""
        self._prev = None
        self._velocity = None
        self._scratch = []
        self._placed = False
        self._step_norms, self._step_norm_value = None, 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr!r}, momentum={self.momentum!r})"


class SlowMo(_MomentumOuter):
    """SlowMo: heavy-ball momentum on the pseudo-gradient; the inner optimizer runs on.

    Each step: ``g = prev - consensus``, ``v = momentum*v + g`` (``v = g`` when fresh),
    ``new = prev - lr*v``, and ``new`` becomes ``prev`` for the next step.

    Choosing ``momentum``: at steady state the global moves about ``lr / (1 - momentum)`` times
    one window's drift. With ElChe's windows of tens of steps, whose drift already carries the
    inner optimizer's momentum, ``momentum=0.5`` (and ``lr=1.0``) trains as well as plain
    averaging on the project's digits test, while 0.9 overshoots and costs accuracy (1.4 points
    with ``DiLoCo(0.7, 0.9)``; docs/benchmarks.md). 0.9 is the published value for windows of
    hundreds of steps.

    Args:
        lr: outer learning rate, finite and > 0 (1.0 with momentum 0 is plain averaging).
        momentum: outer momentum in [0, 1).
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)

    def _update(self, prev: list[torch.Tensor], velocity: list[torch.Tensor], work: list[torch.Tensor]) -> None:
        torch._foreach_mul_(velocity, self.momentum)
        torch._foreach_sub_(velocity, work)
        torch._foreach_add_(prev, velocity, alpha=-self.lr)
        # new - consensus = (prev - lr*v) - (prev + d) = -(d + lr*v)
        torch._foreach_add_(work, velocity, alpha=self.lr)
        torch._foreach_neg_(work)


class DiLoCo(_MomentumOuter):
    """DiLoCo: Nesterov momentum on the pseudo-gradient; ranks reset their inner optimizer.

    Each step: ``g = prev - consensus``, ``v = momentum*v + g``,
    ``new = prev - lr*(momentum*v + g)``, and ``new`` becomes ``prev`` for the next step.

    Choosing ``momentum``: as for :class:`SlowMo`. ``DiLoCo(lr=1.0, momentum=0.5)`` matches plain
    averaging on the digits test; the published ``(0.7, 0.9)`` lost 1.4 points there, and not
    because of the inner reset (without it the loss was larger).

    Args:
        lr: outer learning rate, finite and > 0.
        momentum: outer momentum in [0, 1).
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        super().__init__(lr, momentum)

    @property
    def resets_inner(self) -> bool:
        """True: the outer momentum is the canonical optimizer state, the inner one restarts."""
        return True

    def _update(self, prev: list[torch.Tensor], velocity: list[torch.Tensor], work: list[torch.Tensor]) -> None:
        torch._foreach_mul_(velocity, self.momentum)
        torch._foreach_sub_(velocity, work)
        # new = prev - lr*mu*v - lr*g, and g = -d
        torch._foreach_add_(prev, velocity, alpha=-self.lr * self.momentum)
        torch._foreach_add_(prev, work, alpha=self.lr)
        # new - consensus = (lr - 1)*d - lr*mu*v
        torch._foreach_mul_(work, self.lr - 1.0)
        torch._foreach_add_(work, velocity, alpha=-self.lr * self.momentum)

"""Where a blocking round keeps this replica's values from before the round, without a model-sized
buffer of its own.

A round reduces the parameters' own storage in place, so their values before it are needed
twice: the drift measurement compares them with the consensus, and a round that failed on a lost
peer must run again, on the survivors, from the same contribution. They go into memory that is
idle at a round: each trainable parameter's ``.grad``. A round runs right after an optimizer step
(ElChe refuses manual optimization, and Lightning calls the strategy's ``optimizer_step`` only at
the step that ends a gradient accumulation), so the gradients there are the ones that step already
used; the next ``zero_grad`` discards them before the next backward. After the round the borrowed
gradients are set to ``None``, exactly as ``optimizer.zero_grad()`` (``set_to_none=True``, the
default) leaves them: code that reads gradients must do so before the step (``on_after_backward``,
``on_before_optimizer_step``), as it must anyway under gradient clipping or accumulation.

A parameter without a usable gradient (``None``, e.g. a branch the last step did not use; another
shape, dtype, device or striding; sparse) gets a tensor of its own for the round, freed after it.
The floating-point buffers (BatchNorm statistics: small) keep one persistent twin.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_elche.averaging import AveragedLayout


def _usable(grad: object, view: Tensor) -> bool:
    return (
        isinstance(grad, Tensor)
        and grad.layout == torch.strided
        and grad.shape == view.shape
        and grad.dtype == view.dtype
        and grad.device == view.device
        and grad.stride() == view.stride()
        and grad.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    )


class PreRoundValues:
    """This replica's parameters and buffers as they were when the current round started.

    :meth:`save` before the round's collectives write into the live tensors, :meth:`restore` to
    run a failed round again, :meth:`release` once the round is done (the gradients it borrowed
    become ``None``). :attr:`params` and :attr:`current` pair each parameter's saved values with
    its live view, for the drift measurement.
    """

    def __init__(self, layout: AveragedLayout) -> None:
        self.layout = layout
        self._slots = layout.params.slots()
        self._params = [param for param, _ in self._slots]
        self._buffer_twins = [torch.empty_like(flat) for flat in layout.buffers.flats]
        self.params: list[Tensor] = []
        self.current: list[Tensor] = [view for _, view in self._slots]
        self.addresses: list[int] = []
        """Where each of :attr:`params` lives (its ``data_ptr``), for the fused drift measurement."""
        # What a gradient that can hold a slot's values looks like (checked in one comparison: a
        # round runs this for every parameter, and on models of hundreds of tensors Python time
        # per tensor adds up to more than the round's kernels).
        self._grad_layouts = [(torch.strided, view.dtype, view.stride()) for view in self.current]
        self._slot_addresses = [view.data_ptr() for view in self.current]
        self._borrowed: list[Tensor] = []
        self.own_bytes = 0
        """Bytes of the tensors allocated for parameters without a usable gradient (this round)."""
        self._saved = False

    @property
    def saved(self) -> bool:
        """Whether this round's values are kept (from :meth:`save` until :meth:`release`)."""
        return self._saved

    @torch.no_grad()
    def save(self, borrow_only: bool = False, copy_params: bool = True, params: bool = True) -> bool:
        """Copy the live values aside (into the parameters' gradients where they can hold them);
        whether they were saved.

        ``borrow_only``: save only if every parameter has a usable gradient, and else leave it for a
        later :meth:`save` (a save ahead of the round must not allocate tensors of its own for a
        round that may average nothing). ``copy_params`` False: only choose where the parameters
        go (:attr:`addresses`); the caller queues their copy before anything writes the live values.
        ``params`` False: the buffers only (an out-of-place round leaves the parameters in place)."""
        grads = [param.grad for param in self._params]
        if not params:
            self.params, self._borrowed, self.own_bytes, self.addresses = [], [], 0, []
        elif not self._all_usable(grads):
            if borrow_only:
                return False
            self._save_one_by_one()
        else:
            addresses = [grad.data_ptr() for grad in grads]  # type: ignore[union-attr]
            if any(a == b for a, b in zip(addresses, self._slot_addresses, strict=True)):
                if borrow_only:  # a gradient that is the parameter's own storage
                    return False
                self._save_one_by_one()
            else:
                self.params, self._borrowed, self.own_bytes = grads, self._params, 0  # type: ignore[assignment]
                self.addresses = addresses
        if self.params and copy_params:
            torch._foreach_copy_(self.params, self.current)
        if self._buffer_twins:
            torch._foreach_copy_(self._buffer_twins, self.layout.buffers.flats)
        self._saved = True
        return True

    def _all_usable(self, grads: list[Optional[Tensor]]) -> bool:
        # Not ``None in grads``: that compares every tensor with None through ``Tensor.__eq__``, about
        # 15 µs each, more than the round's kernels on models of many tensors.
        if any(grad is None for grad in grads):
            return False
        try:
            return [(g.layout, g.dtype, g.stride()) for g in grads] == self._grad_layouts  # type: ignore[union-attr]
        except RuntimeError:  # a sparse gradient has no strides
            return False

    def _save_one_by_one(self) -> None:
        self.params, self._borrowed, self.own_bytes = [], [], 0
        for param, view in self._slots:
            grad = param.grad
            if _usable(grad, view):
                assert isinstance(grad, Tensor)
                self.params.append(grad)
                self._borrowed.append(param)
            else:
                self.params.append(torch.empty_like(view))
                self.own_bytes += view.numel() * view.element_size()
        self.addresses = [t.data_ptr() for t in self.params]

    @torch.no_grad()
    def restore(self) -> None:
        """Put the saved values back into the live tensors (a failed round runs again from them)."""
        assert self.saved, "restore() without save()"
        if self.params:
            torch._foreach_copy_(self.current, self.params)
        if self._buffer_twins:
            torch._foreach_copy_(self.layout.buffers.flats, self._buffer_twins)

    def release(self) -> None:
        """The round is done: the borrowed gradients hold scratch values now, drop them."""
        for param in self._borrowed:
            param.grad = None
        self.params, self._borrowed, self.own_bytes, self.addresses = [], [], 0, []
        self._saved = False

"""The reduce math shared by every averaging plane.

What is averaged: the model's trainable parameters (``requires_grad=True``), weighted by the work
each rank did since the last round (realized-work mass ``n_k ** gamma``), and its floating-point
buffers, equally over the ranks that moved. Frozen parameters, integer buffers and optimizer
state stay local: frozen parameters start identical on every rank and nothing moves them, so
averaging them would only cost wire bytes and round-off. Contributions are pre-scaled
at the source by ``mass_k / total_mass`` so that a plain SUM reduce yields the consensus: one
division, decided from metadata every rank has, no extra kernel.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn


def realized_work_mass(steps: int, gamma: float) -> float:
    """Weight of a rank's parameters: ``steps ** gamma``, and 0 for a rank that did not step.

    The idle guard matters because ``0 ** 0 == 1`` and ``0 ** -1`` is infinite: a rank that
    only joined the round (out of data, draining) must never pull the consensus toward its stale
    replica, whatever gamma is.
    """
    if steps <= 0:
        return 0.0
    if gamma == 1.0:
        return float(steps)
    return float(steps) ** gamma


@dataclass(frozen=True)
class RoundWeights:
    """Per-rank pre-scale factors of one averaging round.

    ``param_factors[k] = mass_k / sum(mass)``, ``buffer_factors[k] = mover_k / sum(mover)``.
    ``realized`` is False when no rank moved: the round must then leave every replica untouched.
    """

    param_factors: tuple[float, ...]
    buffer_factors: tuple[float, ...]
    total_mass: float

    @property
    def realized(self) -> bool:
        return self.total_mass > 0.0


def round_weights(steps: Sequence[int], gamma: float) -> RoundWeights:
    """Pre-scale factors from every rank's optimizer steps since the last round."""
    masses = [realized_work_mass(n, gamma) for n in steps]
    total = math.fsum(masses)
    if not math.isfinite(total):
        raise FloatingPointError(f"realized-work mass overflowed: steps={list(steps)}, gamma={gamma}")
    movers = [1.0 if n > 0 else 0.0 for n in steps]
    n_movers = sum(movers)
    if total <= 0.0:
        zeros = tuple(0.0 for _ in steps)
        return RoundWeights(zeros, zeros, 0.0)
    return RoundWeights(
        param_factors=tuple(m / total for m in masses),
        buffer_factors=tuple(v / n_movers for v in movers),
        total_mass=total,
    )


Kind = tuple[torch.dtype, torch.device]


def _by_kind(tensors: Iterable[Tensor]) -> dict[Kind, list[Tensor]]:
    groups: dict[Kind, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _slot(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """The slice of ``flat`` at ``offset`` shaped and strided like ``like``.

    Dense non-contiguous layouts (``channels_last``) keep their strides, so binding a parameter
    never changes the memory format its kernels were chosen for."""
    if like.is_contiguous():
        return flat[offset : offset + like.numel()].view_as(like)
    for memory_format in (torch.channels_last, torch.channels_last_3d):
        if like.dim() == (4 if memory_format is torch.channels_last else 5) and like.is_contiguous(
            memory_format=memory_format
        ):
            return flat.as_strided(like.shape, like.stride(), flat.storage_offset() + offset)
    return flat[offset : offset + like.numel()].view_as(like)  # any other striding: contiguous


SPARE_TAIL = 16 * 1024
"""Zeroed elements allocated behind each joint buffer, outside it: an out-of-place round reduces
the buffer padded to a multiple of ``16 * world_size`` elements over them (worlds of up to 1024)."""


def _with_spare_tail(numel: int, kind: Kind) -> Tensor:
    storage = torch.empty(numel + SPARE_TAIL, dtype=kind[0], device=kind[1])
    storage[numel:].zero_()
    return storage[:numel]


def spare_room(flat: Tensor) -> int:
    """Elements of ``flat``'s storage behind its end (:data:`SPARE_TAIL` for a joint buffer)."""
    return int(flat.untyped_storage().nbytes()) // flat.element_size() - int(flat.storage_offset()) - flat.numel()


class FlatTensors:
    """A fixed, ordered list of tensors living in flat persistent buffers (one per dtype/device).

    At construction every tensor's values move into its slice of the flat buffer of its dtype and
    device, and the tensor is rebound there (``t.data = slice``): the tensor objects stay the same
    (optimizers, hooks and ``state_dict`` keep working on them) but their storage *is* the flat
    buffer, so a round reduces the parameters' own memory with no copy in or out and no second
    parameter-sized buffer. The list is fixed, so every rank reduces the same bytes in the same
    order whatever gradients exist.

    Code that rebinds a tensor later (``p.data = ...``, ``load_state_dict(assign=True)``) breaks
    the link; :meth:`relink` finds that (a pointer comparison per tensor, at round frequency) and
    moves the new values back into the buffer.
    """

    def __init__(self, tensors: Iterable[Tensor], storage: Optional[Mapping[Kind, Tensor]] = None) -> None:
        self.tensors: list[Tensor] = list(tensors)
        self._groups: list[tuple[list[Tensor], Tensor, list[Tensor]]] = []
        for (dtype, device), members in _by_kind(self.tensors).items():
            numel = sum(t.numel() for t in members)
            flat = _with_spare_tail(numel, (dtype, device)) if storage is None else storage[(dtype, device)]
            assert flat.numel() == numel, "storage sized for other tensors"
            views, offset = [], 0
            for t in members:
                views.append(_slot(flat, offset, t))
                offset += t.numel()
            self._groups.append((members, flat, views))
        self._bound = [(t, view, view.data_ptr()) for members, _, views in self._groups
                       for t, view in zip(members, views, strict=True)]
        self._bind_all()

    @property
    def flats(self) -> list[Tensor]:
        """The flat buffers, in a fixed order identical on every rank with the same model."""
        return [flat for _, flat, _ in self._groups]

    @property
    def numel(self) -> int:
        return sum(flat.numel() for flat in self.flats)

    @property
    def nbytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in self.flats)

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def rebound(self) -> list[tuple[Tensor, Tensor]]:
        """``(tensor, its slot)`` for each tensor rebound away from its slot since it was bound (one
        pointer comparison per tensor, with the slots' own pointers kept from the binding)."""
        return [(t, view) for t, view, address in self._bound if t.data_ptr() != address]

    def fits(self, rebound: Optional[list[tuple[Tensor, Tensor]]] = None) -> bool:
        """Whether every tensor still has the shape, dtype and device of its slot (a tensor that
        changed any of them needs a new layout, not a relink). Only rebound ones are compared
        (``rebound``: :meth:`rebound`'s answer, if the caller has it)."""
        return all(t.shape == view.shape and t.dtype == view.dtype and t.device == view.device
                   for t, view in (self.rebound() if rebound is None else rebound))

    def slots(self) -> list[tuple[Tensor, Tensor]]:
        """``(tensor, its view in the flat buffer)`` for every tensor, grouped by flat buffer."""
        return [(t, view) for t, view, _ in self._bound]

    @torch.no_grad()
    def relink(self, rebound: Optional[list[tuple[Tensor, Tensor]]] = None) -> int:
        """Move tensors that were rebound elsewhere back into their slots, keeping their current
        values; how many were. Call before reading or writing the flat buffers."""
        moved = self.rebound() if rebound is None else rebound
        for t, view in moved:
            view.copy_(t)
            t.data = view
        return len(moved)

    @torch.no_grad()
    def _bind_all(self) -> None:
        for t, view, _ in self._bound:
            view.copy_(t)
            t.data = view

    @torch.no_grad()
    def release(self, unbind: Sequence[Tensor] = ()) -> None:
        """Forget the grouping; empty afterwards. The tensors keep their values; those in
        ``unbind`` get storage of their own (the others keep sharing the flat buffers' memory)."""
        for t in unbind:
            t.data = t.detach().clone(memory_format=torch.preserve_format)
        self._groups, self._bound = [], []

    def lerp_toward(self, values: Sequence[Tensor], alpha: float) -> None:
        """``flat ← (1 − alpha)·flat + alpha·values`` per flat buffer, in place (elastic averaging)."""
        torch._foreach_lerp_(self.flats, list(values), alpha)

    def signature(self) -> list[tuple[str, int]]:
        """(dtype, numel) per flat buffer: ranks whose signatures differ cannot average."""
        return [(str(flat.dtype), flat.numel()) for flat in self.flats]


def shared_flat_tensors(*segments: Sequence[Tensor]) -> tuple[list[Tensor], list[FlatTensors]]:
    """Bind every segment's tensors into one flat buffer per dtype/device, segments back to back.

    Returns the joint buffers (what a round reduces in one collective each) and one
    :class:`FlatTensors` per segment, whose flat buffers are slices of the joint ones."""
    sizes: dict[Kind, list[int]] = {}
    for i, segment in enumerate(segments):
        for kind, members in _by_kind(segment).items():
            sizes.setdefault(kind, [0] * len(segments))[i] = sum(t.numel() for t in members)
    joint = {kind: _with_spare_tail(sum(per), kind) for kind, per in sizes.items()}
    bound = []
    for i, segment in enumerate(segments):
        starts = {kind: sum(per[:i]) for kind, per in sizes.items()}
        bound.append(FlatTensors(segment, {k: joint[k][starts[k] : starts[k] + per[i]] for k, per in sizes.items()}))
    return list(joint.values()), bound


def trainable_parameters(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of the parameters averaging rounds reduce: those with ``requires_grad``,
    in ``named_parameters`` order."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def averaged_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of the floating-point buffers averaging rounds reduce, in
    ``named_buffers`` order. Integer ones (BatchNorm's ``num_batches_tracked``) count local events
    and stay local. Buffers of frozen modules are kept: BatchNorm statistics still move in train mode."""
    return [(name, b) for name, b in module.named_buffers() if b.is_floating_point()]


def layout_signature(params: Sequence[tuple[str, Tensor]], buffers: Sequence[tuple[str, Tensor]]) -> float:
    """A number naming what a rank averages (names, shapes, dtypes of both lists), identical on
    ranks that average the same layout. A 52-bit integer, so that it survives a float64 metadata slot."""
    digest = hashlib.blake2b(digest_size=8)
    for kind, entries in (("param", params), ("buffer", buffers)):
        for name, t in entries:
            digest.update(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return float(int.from_bytes(digest.digest(), "little") % 2**52)


def averaged_state(module: nn.Module) -> tuple[FlatTensors, FlatTensors]:
    """The trainable parameters and the floating-point buffers that averaging rounds reduce."""
    params = [t for _, t in trainable_parameters(module)]
    buffers = [t for _, t in averaged_buffers(module)]
    return FlatTensors(params), FlatTensors(buffers)


class AveragedLayout:
    """What a plane averages, kept in step with the module: its trainable parameters and float
    buffers, bound into one flat buffer per dtype/device (:func:`shared_flat_tensors`), parameters
    first, so that one collective per dtype reduces both.

    Planes call :meth:`refresh` when a round starts (never per step): if the set of trainable
    parameters changed since the last round (a backbone unfrozen between epochs), everything moves
    into new flat buffers. Ranks that change the flags at different points average different
    layouts; :attr:`signature` travels in every round's metadata so that this fails on every rank
    at once. The module's whole tree is walked at the first refresh after :meth:`walk_at_next_refresh`
    (the engine calls it at every epoch's start, where modules may be added or replaced); the rounds
    in between check the known parameters only (their ``requires_grad`` flags, their modules still
    holding them, their storage), which costs a tenth of the walk on a model of a hundred modules.

    Args:
        module: the model; ``None`` for a fixed layout (:meth:`fixed`).
    """

    def __init__(self, module: Optional[nn.Module]) -> None:
        self.module = module
        self.names: tuple[str, ...] = ()
        self.params = FlatTensors([])
        self.buffers = FlatTensors([])
        self.joint: list[Tensor] = []
        self.signature = 0.0
        self._buffer_names: list[tuple[str, Tensor]] = []
        self._frozen: list[Tensor] = []  # the parameters left out at the last walk
        self._owners: list[tuple[dict[str, Any], str]] = []  # where each trainable parameter is held
        self._walk_due = False
        if module is not None:
            self._build(trainable_parameters(module), averaged_buffers(module))

    @classmethod
    def fixed(cls, params: FlatTensors, buffers: FlatTensors) -> AveragedLayout:
        """A layout of given tensors that never changes (benchmarks, tests)."""
        layout = cls(None)
        layout.params, layout.buffers = params, buffers
        layout.joint = params.flats + buffers.flats
        layout.names = tuple(f"param{i}" for i in range(len(params.tensors)))
        layout._buffer_names = [(f"buffer{i}", t) for i, t in enumerate(buffers.tensors)]
        layout.signature = layout_signature(list(zip(layout.names, params.tensors, strict=True)), layout._buffer_names)
        return layout

    def _build(self, params: list[tuple[str, Tensor]], buffers: list[tuple[str, Tensor]]) -> None:
        leaving = [t for t in self.params.tensors if all(t is not kept for _, kept in params)]
        self.params.release(unbind=leaving)  # a frozen tensor must not keep the old buffer alive
        self.buffers.release()
        self.names = tuple(name for name, _ in params)
        self._buffer_names = buffers
        self.joint, (self.params, self.buffers) = shared_flat_tensors(
            [t for _, t in params], [t for _, t in buffers]
        )
        self.signature = layout_signature(params, buffers)
        assert self.module is not None
        kept = {id(t) for _, t in params}
        self._frozen = [p for p in self.module.parameters() if id(p) not in kept]
        self._owners = []
        for name, _ in params:
            path, _, attribute = name.rpartition(".")
            self._owners.append((self.module.get_submodule(path)._parameters, attribute))

    def walk_at_next_refresh(self) -> None:
        """Walk the whole module at the next :meth:`refresh` (every rank calls it at the same point:
        the start of an epoch)."""
        self._walk_due = True

    def _known_parameters_changed(self) -> bool:
        return (
            any(not t.requires_grad for t in self.params.tensors)
            or any(p.requires_grad for p in self._frozen)
            or any(held.get(name) is not t for (held, name), t in zip(self._owners, self.params.tensors, strict=True))
        )

    def refresh(self) -> bool:
        """Bring the layout up to date with the module; whether it was rebuilt.

        Rebuilt when the trainable set changed (a flag flipped, a parameter object replaced, or,
        at a walk, a module added or replaced) or a tensor changed shape, dtype or device; tensors
        merely rebound elsewhere (``p.data = x``) are moved back into their slots. No device
        synchronization."""
        rebound = self.params.rebound(), self.buffers.rebound()
        if self.module is not None:
            walk, self._walk_due = self._walk_due or self._known_parameters_changed(), False
            fits = self.params.fits(rebound[0]) and self.buffers.fits(rebound[1])
            if walk or not fits:
                named = trainable_parameters(self.module)
                current = self.params.tensors
                same = len(named) == len(current) and all(p is t for (_, p), t in zip(named, current, strict=True))
                if not (same and fits):
                    self._build(named, averaged_buffers(self.module))
                    return True
        self.params.relink(rebound[0])
        self.buffers.relink(rebound[1])
        return False


def divergence_norms(pre: Sequence[Tensor], consensus: Sequence[Tensor],
                     pre_norms: Optional[Sequence[Tensor]] = None) -> Tensor:
    """``[||pre - consensus||, ||pre||, ||consensus||]`` over all tensors, as a float64 tensor.

    ``pre`` is overwritten with the difference (it is the caller's scratch copy). ``pre_norms``,
    the per-tensor norms of ``pre`` if the caller took them already (while the reduce ran). Norms
    are taken per flat buffer in its own precision with fused multi-tensor kernels and only
    combined in float64: an f64 upcast of the whole model would cost more than the all-reduce
    itself. Stays on the device: the values travel in the next round's metadata, so reading them
    costs no extra sync.
    """
    pre, consensus = list(pre), list(consensus)
    # Few launches and passes: this runs once per sync and its cost shows on fast interconnects.
    if pre_norms is None:
        pre_norms = torch._foreach_norm(pre)
    torch._foreach_sub_(pre, consensus)
    after = torch._foreach_norm(pre + consensus)
    count = len(pre)
    norms = torch.stack([*after[:count], *pre_norms, *after[count:]]).to(torch.float64)
    if count == 1:  # one flat buffer (one dtype): the three norms already
        return norms
    return norms.square_().view(3, count).sum(dim=1).sqrt_()


def relative_divergence(delta_norm: float, post_norm: float) -> float:
    """``||pre - consensus|| / ||consensus||``, 0 for a vanishing consensus."""
    return delta_norm / post_norm if post_norm > 1e-10 else 0.0


def weighted_sum_into(out: Tensor, contributions: Sequence[Tensor], factors: Sequence[float]) -> Tensor:
    """``out = Σ factors[k] · contributions[k]`` accumulated in ``out``'s dtype (f32 for bf16 wires).

    Contributions are added in rank order, so every rank computing it gets the same bits.
    """
    out.zero_()
    for factor, contribution in zip(factors, contributions, strict=True):
        if factor:
            out.add_(contribution.to(out.dtype), alpha=factor)
    return out

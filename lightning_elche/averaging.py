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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

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


class FlatTensors:
    """A fixed, ordered list of tensors mirrored in flat persistent buffers (one per dtype/device).

    The list is fixed at construction so that every rank reduces the same bytes in the same
    order, whatever gradients exist. Values move between the live tensors and the flat buffers
    with in-place multi-tensor copies; the live tensors' storage is never rebound.
    """

    def __init__(self, tensors: Iterable[Tensor]) -> None:
        self.tensors: list[Tensor] = list(tensors)
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for t in self.tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        self._groups: list[tuple[list[Tensor], Tensor, list[Tensor]]] = []
        for (dtype, device), members in groups.items():
            flat = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
            views, offset = [], 0
            for t in members:
                views.append(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            self._groups.append((members, flat, views))

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

    def pack(self) -> None:
        """Copy the live tensors into the flat buffers."""
        for members, _, views in self._groups:
            torch._foreach_copy_(views, members)

    def unpack(self) -> None:
        """Copy the flat buffers back into the live tensors, in place."""
        for members, _, views in self._groups:
            torch._foreach_copy_(members, views)

    def release(self) -> None:
        """Drop the flat buffers (the live tensors are untouched); the mirror is empty afterwards."""
        self._groups = []

    def blend(self, alpha: float) -> None:
        """``live ← (1 − alpha)·live + alpha·flat``, in place (elastic averaging toward the buffers)."""
        for members, _, views in self._groups:
            torch._foreach_lerp_(members, views, alpha)

    def signature(self) -> list[tuple[str, int]]:
        """(dtype, numel) per flat buffer: ranks whose signatures differ cannot average."""
        return [(str(flat.dtype), flat.numel()) for flat in self.flats]


def trainable_parameters(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of the parameters averaging rounds reduce: those with ``requires_grad``,
    in ``named_parameters`` order."""
    return [(name, p.data) for name, p in module.named_parameters() if p.requires_grad]


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
    """What a plane averages, kept in step with the module's ``requires_grad`` flags.

    Planes call :meth:`refresh` when a round starts (never per step): if the set of trainable
    parameters changed since the last round (a backbone unfrozen between epochs), the parameter
    mirror is rebuilt. Ranks that change the flags at different points average different layouts;
    :attr:`signature` travels in every round's metadata so that this fails on every rank at once.

    Args:
        module: the model; ``None`` for a fixed layout (:meth:`fixed`).
    """

    def __init__(self, module: Optional[nn.Module]) -> None:
        self.module = module
        self.names: tuple[str, ...] = ()
        self.params = FlatTensors([])
        self.buffers = FlatTensors([])
        self.signature = 0.0
        self._buffer_names: list[tuple[str, Tensor]] = []
        if module is not None:
            named_buffers = averaged_buffers(module)
            self.buffers = FlatTensors(t for _, t in named_buffers)
            self._buffer_names = named_buffers
            self._build(trainable_parameters(module))

    @classmethod
    def fixed(cls, params: FlatTensors, buffers: FlatTensors) -> AveragedLayout:
        """A layout of given tensors that never changes (benchmarks, tests)."""
        layout = cls(None)
        layout.params, layout.buffers = params, buffers
        layout.names = tuple(f"param{i}" for i in range(len(params.tensors)))
        layout._buffer_names = [(f"buffer{i}", t) for i, t in enumerate(buffers.tensors)]
        layout.signature = layout_signature(list(zip(layout.names, params.tensors, strict=True)), layout._buffer_names)
        return layout

    def _build(self, named: list[tuple[str, Tensor]]) -> None:
        self.names = tuple(name for name, _ in named)
        self.params = FlatTensors(t for _, t in named)
        self.signature = layout_signature(named, self._buffer_names)

    def refresh(self) -> bool:
        """Rebuild the parameter mirror if the trainable set changed; whether it did.

        A Python walk over the parameters' flags, no device work: cheap at round frequency."""
        if self.module is None:
            return False
        named = trainable_parameters(self.module)
        if tuple(name for name, _ in named) == self.names:
            return False
        self._build(named)
        return True


def divergence_norms(pre: Sequence[Tensor], consensus: Sequence[Tensor]) -> Tensor:
    """``[||pre - consensus||, ||pre||, ||consensus||]`` over all tensors, as a float64 tensor.

    ``pre`` is overwritten with the difference (it is the caller's scratch copy). Norms are taken
    per flat buffer in its own precision with fused multi-tensor kernels and only combined in
    float64: an f64 upcast of the whole model would cost more than the all-reduce itself. Stays on
    the device: the values travel in the next round's metadata, so reading them costs no extra sync.
    """
    pre, consensus = list(pre), list(consensus)
    # Few launches: this runs once per sync and its fixed cost shows on fast interconnects.
    before = torch._foreach_norm(pre + consensus)
    torch._foreach_sub_(pre, consensus)
    norms = torch.stack([*torch._foreach_norm(pre), *before]).to(torch.float64)
    return norms.square_().view(3, len(pre)).sum(dim=1).sqrt_()


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

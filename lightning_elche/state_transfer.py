"""A joiner's state over the new generation's group: the tensors as one flat buffer, the rest pickled.

``dist.send_object_list`` pickles the whole payload, and a tensor pickles as its storage saved into
bytes: several copies of every byte on each side before and after the transport (a 400 MB state
reached a fifth of gloo's raw rate: docs/failures.md, "Admission cost"). Here the payload's
tensors are copied once into one ``uint8`` buffer, sent with one ``dist.send``, and the joiner
rebuilds them from the buffer it received (one copy each); only the skeleton (everything but the tensors,
and each tensor's dtype, shape and offset) goes through pickling. A tensor that is not a plain
dense one (sparse, quantized, a subclass) keeps the pickled way inside the skeleton.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 64
"""Each tensor starts at a multiple of this in the buffer, so that its view has its dtype's alignment."""


STATE_DICT_METADATA = "_metadata"
"""torch's ``Module.state_dict()`` attribute with each module's version (not a Lightning name, though
Lightning has one of that name too: tests/test_architecture.py looks for those)."""


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the payload lies in the flat buffer."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) is torch.Tensor and tensor.layout is torch.strided and not tensor.is_quantized


def _mapped(value: Any, each: Any) -> Any:
    """``value`` with ``each`` applied to every member of its dicts, lists and tuples (a state
    dict's ``OrderedDict`` keeps its ``_metadata``: module versions that ``load_state_dict`` reads)."""
    if type(value) in (dict, OrderedDict):
        mapped = type(value)((k, each(v)) for k, v in value.items())
        if hasattr(value, STATE_DICT_METADATA):
            setattr(mapped, STATE_DICT_METADATA, getattr(value, STATE_DICT_METADATA))
        return mapped
    if type(value) in (list, tuple):
        return type(value)(each(v) for v in value)
    return value


def _strip(value: Any, tensors: list[torch.Tensor], offset: list[int]) -> Any:
    if isinstance(value, torch.Tensor) and _plain(value):
        nbytes = value.numel() * value.element_size()
        slot = _Slot(offset[0], nbytes, value.dtype, tuple(value.shape))
        offset[0] += -(-nbytes // ALIGN) * ALIGN
        tensors.append(value)
        return slot
    if isinstance(value, torch.Tensor):  # pickled with the skeleton: on the CPU, as a plain tensor's arrives
        return value.detach().cpu()
    return _mapped(value, lambda v: _strip(v, tensors, offset))


def _rebuild(value: Any, buffer: torch.Tensor) -> Any:
    if isinstance(value, _Slot):
        # A copy of its own: a view would keep the whole buffer alive as long as any state it holds.
        return buffer[value.offset : value.offset + value.nbytes].view(value.dtype).view(value.shape).clone()
    return _mapped(value, lambda v: _rebuild(v, buffer))


def _transport_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def send_state(payload: Any, ranks: tuple[int, ...] | list[int]) -> int:
    """Send ``payload`` (dicts, lists and tuples of tensors and picklable values) to each of
    ``ranks``; returns the tensor bytes sent to each."""
    tensors: list[torch.Tensor] = []
    offset = [0]
    skeleton = _strip(payload, tensors, offset)
    device = _transport_device()
    buffer = torch.empty(offset[0], dtype=torch.uint8, device=device)
    slots = _slots(skeleton)
    for slot, tensor in zip(slots, tensors, strict=True):
        if slot.nbytes:
            target = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            target.copy_(tensor.detach())
    for rank in ranks:
        dist.send_object_list([(skeleton, offset[0])], dst=rank)
        if offset[0]:
            dist.send(buffer, dst=rank)
    return sum(s.nbytes for s in slots)


def _slots(value: Any) -> list[_Slot]:
    """The skeleton's slots in the order :func:`_strip` made them."""
    if isinstance(value, _Slot):
        return [value]
    if type(value) in (dict, OrderedDict):
        return [s for v in value.values() for s in _slots(v)]
    if type(value) in (list, tuple):
        return [s for v in value for s in _slots(v)]
    return []


def recv_state(src: int = 0) -> Any:
    """The payload :func:`send_state` sent from ``src``, its tensors on the CPU."""
    received: list[Any] = [None]
    dist.recv_object_list(received, src=src)
    skeleton, size = received[0]
    buffer = torch.empty(size, dtype=torch.uint8, device=_transport_device())
    if size:
        dist.recv(buffer, src=src)
    return _rebuild(skeleton, buffer.cpu())


__all__ = ["recv_state", "send_state"]

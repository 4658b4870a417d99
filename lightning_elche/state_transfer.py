"""A joiner's state over the new generation's group: the tensors as raw bytes, the rest pickled.

``dist.send_object_list`` pickles the whole payload, and a tensor pickles as its storage saved into
bytes: several copies of every byte on each side before and after the transport (a 400 MB state
reached a fifth of gloo's raw rate: docs/failures.md, "Admission cost"). Here only the skeleton
(everything but the tensors, and each tensor's dtype, shape and place) is pickled. A large tensor
(:data:`DIRECT_BYTES` or more) goes as it lies, with its own ``dist.send``, and the joiner receives
it into a tensor of its own: no copy on either side beyond the transport's. The small ones are
copied into one ``uint8`` buffer, sent at once, and copied out of it on arrival, so that a state of
many small tensors pays one message instead of one per tensor. A tensor that is not a plain dense
one (sparse, quantized, a subclass) keeps the pickled way inside the skeleton.

Every message is an ``isend``/``irecv`` handed to a ``wait`` (by default ``Work.wait()``): an admission
passes its watched wait, so that a joiner that dies or stalls while its state is sent, or a sender
lost meanwhile, is noticed at the liveness timeout instead of the transport's. A message refused
when it is posted (its peer already closed its end) reaches the wait too, as one that failed.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import torch
import torch.distributed as dist

ALIGN = 64
"""Each tensor starts at a multiple of this in the buffer, so that its view has its dtype's alignment."""

DIRECT_BYTES = 1 << 20
"""From this size on a tensor is sent on its own: copying it into the buffer would cost more than a message."""


STATE_DICT_METADATA = "_metadata"
"""torch's ``Module.state_dict()`` attribute with each module's version (not a Lightning name, though
Lightning has one of that name too: tests/test_architecture.py looks for those)."""


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of the payload lies: at ``offset`` in the flat buffer, or (``direct``) in
    a message of its own, in the order of the skeleton."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    direct: bool = False


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


def _strip(value: Any, tensors: list[tuple[_Slot, torch.Tensor]], offset: list[int]) -> Any:
    if isinstance(value, torch.Tensor) and _plain(value):
        nbytes = value.numel() * value.element_size()
        if nbytes >= DIRECT_BYTES:
            slot = _Slot(-1, nbytes, value.dtype, tuple(value.shape), direct=True)
        else:
            slot = _Slot(offset[0], nbytes, value.dtype, tuple(value.shape))
            offset[0] += -(-nbytes // ALIGN) * ALIGN
        tensors.append((slot, value))
        return slot
    if isinstance(value, torch.Tensor):  # pickled with the skeleton: on the CPU, as a plain tensor's arrives
        return value.detach().cpu()
    return _mapped(value, lambda v: _strip(v, tensors, offset))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``tensor``'s memory as a flat ``uint8`` view (gloo and NCCL send any dtype so)."""
    return tensor.reshape(-1).view(torch.uint8)


def _typed(raw: torch.Tensor, slot: _Slot) -> torch.Tensor:
    return raw.view(slot.dtype).view(slot.shape)


def _at(into: Any, key: Any) -> Any:
    """What ``into`` holds where the skeleton has ``key`` (None where it has nothing there)."""
    if isinstance(into, dict):
        return into.get(key)
    if isinstance(into, (list, tuple)) and isinstance(key, int) and key < len(into):
        return into[key]
    return None


def _slots(value: Any, into: Any, device: torch.device) -> list[tuple[_Slot, Optional[torch.Tensor]]]:
    """The skeleton's slots in the order :func:`_strip` made them, each with the tensor of ``into``
    at its place that can take its bytes as they arrive (same dtype and shape, contiguous, on
    ``device``), if there is one."""
    if isinstance(value, _Slot):
        usable = (isinstance(into, torch.Tensor) and _plain(into) and into.dtype == value.dtype
                  and tuple(into.shape) == value.shape and into.is_contiguous() and into.device == device)
        return [(value, into if usable else None)]
    if type(value) in (dict, OrderedDict):
        return [t for k, v in value.items() for t in _slots(v, _at(into, k), device)]
    if type(value) in (list, tuple):
        return [t for i, v in enumerate(value) for t in _slots(v, _at(into, i), device)]
    return []


def _rebuild(value: Any, buffer: torch.Tensor, arrived: Iterator[Optional[torch.Tensor]]) -> Any:
    if isinstance(value, _Slot):
        tensor = next(arrived)  # a direct slot's tensor, or the target a packed slot is copied into
        if value.direct:
            assert tensor is not None
            return tensor
        packed = _typed(buffer[value.offset : value.offset + value.nbytes], value)
        # A copy of its own: a view would keep the whole buffer alive as long as any state it holds.
        return packed.clone() if tensor is None else tensor.copy_(packed)
    return _mapped(value, lambda v: _rebuild(v, buffer, arrived))


def _transport_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


Wait = Callable[[Any], None]
"""How a transfer waits for one of its messages (an ``isend``'s or ``irecv``'s work)."""


def _plain_wait(work: Any) -> None:
    work.wait()


class _RefusedMessage:
    """The work of a message whose ``isend``/``irecv`` raised when it was posted (gloo refuses one
    at once when the other end has closed its connection): waiting for it raises that error, so the
    transfer's ``wait`` judges it as it judges a message that failed later (a watched wait: the peer
    is lost), rather than the error escaping the wait."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self, timeout: Any = None) -> NoReturn:
        raise self.error

    def is_completed(self) -> bool:
        return True


def _post(operation: Callable[..., Any], tensor: torch.Tensor, peer: int) -> Any:
    try:
        return operation(tensor, peer)
    except RuntimeError as error:
        return _RefusedMessage(error)


@dataclass(frozen=True)
class PackedState:
    """A payload made ready to send (:func:`pack_state`), to any number of ranks one after the other."""

    header: torch.Tensor
    """Two int64: the pickled skeleton's length and the flat buffer's."""
    skeleton: torch.Tensor
    buffer: torch.Tensor
    direct: tuple[torch.Tensor, ...]
    tensor_bytes: int
    """The payload's tensor bytes (what one rank receives, beyond the skeleton)."""

    def send(self, rank: int, wait: Wait = _plain_wait) -> None:
        """To ``rank``; raises what ``wait`` raises (the rank may then have part of it)."""
        for raw in (self.header, self.skeleton, *([self.buffer] if self.buffer.numel() else []), *self.direct):
            wait(_post(dist.isend, raw, rank))


def pack_state(payload: Any) -> PackedState:
    """``payload`` (dicts, lists and tuples of tensors and picklable values) as the messages of
    :meth:`PackedState.send`: the small tensors copied into one buffer, the large ones as they lie."""
    tensors: list[tuple[_Slot, torch.Tensor]] = []
    offset = [0]
    skeleton = _strip(payload, tensors, offset)
    device = _transport_device()
    buffer = torch.empty(offset[0], dtype=torch.uint8, device=device)
    direct: list[torch.Tensor] = []
    for slot, tensor in tensors:
        if slot.direct:  # as it lies when it is contiguous and on the transport's device (the usual case)
            direct.append(_as_bytes(tensor.detach().to(device).contiguous()))
        elif slot.nbytes:
            _typed(buffer[slot.offset : slot.offset + slot.nbytes], slot).copy_(tensor.detach())
    pickled = torch.frombuffer(bytearray(pickle.dumps(skeleton)), dtype=torch.uint8).to(device)
    header = torch.tensor([pickled.numel(), offset[0]], dtype=torch.int64, device=device)
    return PackedState(header, pickled, buffer, tuple(direct), sum(slot.nbytes for slot, _ in tensors))


def send_state(payload: Any, ranks: tuple[int, ...] | list[int], wait: Wait = _plain_wait) -> int:
    """Send ``payload`` to each of ``ranks``; returns the tensor bytes sent to each."""
    packed = pack_state(payload)
    for rank in ranks:
        packed.send(rank, wait)
    return packed.tensor_bytes


def recv_state(src: int = 0, into: Any = None, wait: Wait = _plain_wait) -> Any:
    """The payload :func:`send_state` sent from ``src``, its tensors on the CPU.

    ``into`` (optional) mirrors part of the payload with tensors that may take the values in place
    (a joiner's own ``module.state_dict()``: its memory is already there, and loading it later
    copies nothing): where one matches (:func:`_slots`) the payload holds that tensor, filled.
    """
    device = _transport_device()

    def receive(raw: torch.Tensor) -> torch.Tensor:
        wait(_post(dist.irecv, raw, src))
        return raw

    length, size = (int(n) for n in receive(torch.empty(2, dtype=torch.int64, device=device)).tolist())
    pickled = receive(torch.empty(length, dtype=torch.uint8, device=device))
    skeleton = pickle.loads(pickled.cpu().numpy().tobytes())
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        receive(buffer)
    arrived: list[Optional[torch.Tensor]] = []
    for slot, target in _slots(skeleton, into, device):
        if slot.direct:
            raw = torch.empty(slot.nbytes, dtype=torch.uint8, device=device) if target is None else _as_bytes(target)
            receive(raw)
            target = _typed(raw.cpu(), slot) if target is None else target
        arrived.append(target)
    return _rebuild(skeleton, buffer.cpu(), iter(arrived))


__all__ = ["PackedState", "Wait", "pack_state", "recv_state", "send_state"]

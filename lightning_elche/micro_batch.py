"""Micro-batches: a rank whose card cannot hold the loader's batch trains it in pieces.

``ElCheStrategy(micro_batch=m)`` makes a rank train each batch of ``N`` samples as ``ceil(N/m)``
micro-batches of at most ``m`` samples (``torch.split`` along dim 0), accumulating their
gradients, and hands Lightning one loss for its one optimizer step: every rank's optimizer still
sees the gradient of the loader's whole batch, so the learning rate, the schedulers, the clipping
(on the accumulated gradient) and the averaging weights (batches, each of the same samples) are
those of the other ranks. The loss of micro-batch ``i`` is weighted by its share of the batch's
samples, ``n_i / N`` (a last, partial micro-batch counts for what it holds), which is exact for a
training step that returns a mean over its samples, the usual loss. BatchNorm layers see each
micro-batch on its own: their batch statistics, and their running statistics, are per micro-batch
(as under Lightning's ``accumulate_grad_batches``).

How it meets Lightning's closure (training_step, then zero_grad on the first batch of an
accumulation, then backward): the strategy's ``training_step`` runs every micro-batch but the last
forward and backward itself (through the strategy's ``backward``, so precision plugins scale and the
``on_before_backward``/``on_after_backward`` hooks run per micro-batch, as they run per batch under
``accumulate_grad_batches``), and returns the last micro-batch's weighted loss plus the others'
detached values: what Lightning sees and backpropagates is the full batch's loss, and its backward
adds the last micro-batch's gradient. On the first batch of an accumulation the gradients gathered
so far are kept aside (references, no copy) across Lightning's ``zero_grad`` and put back in the
strategy's ``pre_backward``. Nothing in it synchronizes the device: sizes come from shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, Union

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_elche.checks import as_int, invalid

AUTO = "auto"

RankMicroBatch = Union[None, int, str]
"""One rank's setting: ``None`` (the loader's batch), a size in samples, or ``"auto"``."""

MicroBatch = Union[None, int, str, dict[int, Union[int, str, None]], list[Union[int, str, None]]]
"""``ElCheStrategy(micro_batch=...)``: one setting for every rank, or one per rank (a mapping from
rank to setting, ranks left out take the loader's batch; or a list with one setting per rank)."""

ALLOWED = ("expected None, a positive integer number of samples, 'auto', a mapping {rank: size} or a list "
           "with one size per rank (a size is a positive integer, 'auto' or None)")


def _check_one(value: Any, subject: str) -> RankMicroBatch:
    if value is None or value == AUTO:
        return AUTO if value is not None else None
    number = as_int(value)
    if number is None or number < 1:
        raise invalid(subject, ALLOWED)
    return number


def check_micro_batch(value: Any, subject: str) -> MicroBatch:
    """``value`` as a :data:`MicroBatch` (ints as Python ints, a mapping as a dict, a sequence as a
    list), or ``ValueError`` naming ``subject`` (``ElCheStrategy(micro_batch=0)``)."""
    if isinstance(value, Mapping):
        checked: dict[int, RankMicroBatch] = {}
        for rank, size in value.items():
            number = as_int(rank)
            if number is None or number < 0:
                raise invalid(subject, f"{ALLOWED}; rank {rank!r} is not a rank number (an integer >= 0)")
            checked[number] = _check_one(size, subject)
        return checked
    if isinstance(value, (list, tuple)):
        if not value:
            raise invalid(subject, f"{ALLOWED}; the list is empty")
        return [_check_one(size, subject) for size in value]
    if isinstance(value, str) and value != AUTO:
        raise invalid(subject, ALLOWED)
    return _check_one(value, subject)


def check_micro_batch_ranks(value: MicroBatch, world_size: int, subject: str) -> None:
    """A per-rank setting names only ranks that exist (a list has one entry per rank)."""
    if isinstance(value, dict):
        missing = sorted(r for r in value if r >= world_size)
        if missing:
            raise invalid(subject, f"rank {missing[0]} does not exist: the world size is {world_size} "
                                   f"(ranks 0 to {world_size - 1})")
    elif isinstance(value, list) and len(value) != world_size:
        raise invalid(subject, f"expected one entry per rank: {world_size} values for a world size of "
                               f"{world_size} (or a mapping {{rank: size}} for some ranks)")


def rank_micro_batch(value: MicroBatch, rank: int) -> RankMicroBatch:
    """The setting of ``rank`` (``None`` for a rank a mapping leaves out)."""
    if isinstance(value, dict):
        return value.get(rank)
    if isinstance(value, list):
        return value[rank] if rank < len(value) else None
    return value


def check_against_batch_size(size: RankMicroBatch, batch_size: int, subject: str) -> None:
    """A micro-batch larger than the loader's batch is a mistake, not a no-op."""
    if isinstance(size, int) and size > batch_size:
        raise invalid(subject, f"a micro-batch of {size} samples is larger than the DataLoader's batch_size="
                               f"{batch_size}: expected at most {batch_size} (or None for the whole batch)")


# -- splitting a batch along dim 0 ---------------------------------------------------------------


class UnsplittableBatchError(TypeError):
    """A batch that cannot be cut into micro-batches along its first dimension."""


def batch_length(batch: Any) -> int:
    """The number of samples of ``batch``: the common first dimension of its tensors (0-d tensors and
    ``None`` are carried whole; a list of non-tensors of that length is cut too)."""
    lengths: set[int] = set()
    _collect_lengths(batch, lengths, sequences=[])
    if not lengths:
        raise UnsplittableBatchError(
            f"ElCheStrategy(micro_batch=...) cannot split a batch of type {type(batch).__name__} with no tensor "
            "of at least one dimension: return tensors (in tuples, lists or dicts) from the DataLoader, or set "
            "micro_batch=None for this rank."
        )
    if len(lengths) > 1:
        raise UnsplittableBatchError(
            f"ElCheStrategy(micro_batch=...) cannot split this batch: its tensors' first dimensions differ "
            f"({sorted(lengths)}), so there is no one sample axis to cut along. Give every tensor the batch "
            "as dim 0, or set micro_batch=None for this rank."
        )
    return lengths.pop()


def _is_plain_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and not any(
        isinstance(v, (Tensor, Mapping, list, tuple)) for v in value)


def _collect_lengths(batch: Any, lengths: set[int], sequences: list[int]) -> None:
    if isinstance(batch, Tensor):
        if batch.dim() > 0:
            lengths.add(int(batch.shape[0]))
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _collect_lengths(value, lengths, sequences)
    elif _is_plain_sequence(batch):
        lengths.add(len(batch))  # per-sample metadata (file names, ids) as the default collate gives it
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _collect_lengths(value, lengths, sequences)
    elif batch is not None:
        raise UnsplittableBatchError(
            f"ElCheStrategy(micro_batch=...) cannot split a batch holding a {type(batch).__name__} "
            f"({batch!r:.60}): expected tensors, lists of per-sample values, tuples, lists or dicts of them. "
            "Make it a tensor, or set micro_batch=None for this rank."
        )


def split_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` cut into micro-batches of ``size`` samples along dim 0 (the last may hold fewer);
    tensors become views, containers keep their types (named tuples included)."""
    total = batch_length(batch)
    count = math.ceil(total / size)
    return [_slice(batch, i * size, min((i + 1) * size, total), total) for i in range(count)]


def _slice(batch: Any, start: int, stop: int, total: int) -> Any:
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        items = {k: _slice(v, start, stop, total) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # dict, OrderedDict, a dict subclass
        except TypeError:
            return items
    if _is_plain_sequence(batch):
        return type(batch)(batch[start:stop])
    if isinstance(batch, tuple):
        parts = [_slice(v, start, stop, total) for v in batch]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if isinstance(batch, list):
        return [_slice(v, start, stop, total) for v in batch]
    return batch


# -- the training step of a splitting rank --------------------------------------------------------


def step_loss(output: Any, index: int, count: int) -> Tensor:
    """The loss of a micro-batch's ``training_step`` output (a tensor, or a mapping with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(loss, Tensor):
        return loss
    raise RuntimeError(
        f"ElCheStrategy(micro_batch=...): training_step returned {type(output).__name__} for micro-batch "
        f"{index + 1} of {count}; with micro-batches every training_step must return its loss (a Tensor or a "
        "dict with 'loss'): skipping a step is not supported in distributed training."
    )


def with_loss(output: Any, loss: Tensor) -> Any:
    """The last micro-batch's output carrying the whole batch's ``loss``."""
    if isinstance(output, Mapping):
        return {**output, "loss": loss}
    return loss


class MicroBatchSteps:
    """One rank's micro-batching: splits each batch, accumulates, keeps the gradients across the
    ``zero_grad`` Lightning makes between ``training_step`` and ``backward``.

    Args:
        size: the rank's micro-batch in samples (a batch of at most this many trains whole).
        params: the parameters whose gradients accumulate.
    """

    def __init__(self, size: int, params: Callable[[], Sequence[Parameter]]) -> None:
        self.size = size
        self._params = params
        self._kept: Optional[list[tuple[Parameter, Optional[Tensor]]]] = None
        self._expect_kept_gradients = False
        self._first_of_accumulation = True

    def batch_started(self, first_of_accumulation: bool) -> None:
        """Whether Lightning zeroes the gradients in this batch's closure (its first of an accumulation)."""
        if self._kept is not None:
            raise RuntimeError(
                "ElCheStrategy(micro_batch=...): the last batch's backward never ran, so its micro-batches' "
                "gradients were not put back; micro-batches need Lightning's automatic optimization with its "
                "backward."
            )
        self._first_of_accumulation = first_of_accumulation

    def splits(self, batch: Any) -> bool:
        return batch_length(batch) > self.size

    def run(self, batch: Any, step: Callable[[Any], Any], backward: Callable[[Tensor], Any],
            accumulate_grad_batches: int) -> Any:
        """Train ``batch`` as micro-batches: ``step(micro)`` runs the user's ``training_step``,
        ``backward(loss)`` the strategy's backward; returns the output Lightning gets for the batch."""
        micros = split_batch(batch, self.size)
        total = batch_length(batch)
        params = list(self._params())
        if self._first_of_accumulation:
            for p in params:  # stale gradients of the last step: Lightning zeroes them right after this step
                p.grad = None
        earlier: Optional[Tensor] = None
        for i, micro in enumerate(micros[:-1]):
            share = batch_length(micro) / total
            loss = step_loss(step(micro), i, len(micros))
            backward(loss * (share / accumulate_grad_batches))
            value = loss.detach() * share
            earlier = value if earlier is None else earlier + value
            del loss
        last = micros[-1]
        output = step(last)
        loss = step_loss(output, len(micros) - 1, len(micros)) * (batch_length(last) / total)
        combined = loss if earlier is None else loss + earlier
        if self._first_of_accumulation:
            self._kept = [(p, p.grad) for p in params]
            for p in params:
                p.grad = None  # Lightning's zero_grad finds nothing to clear; pre_backward puts them back
        self._expect_kept_gradients = not self._first_of_accumulation and any(p.grad is not None for p in params)
        return with_loss(output, combined)

    def restore(self) -> None:
        """In the strategy's ``pre_backward``: the gradients of the earlier micro-batches back in ``.grad``."""
        kept, self._kept = self._kept, None
        if kept is None:
            if self._expect_kept_gradients and all(p.grad is None for p in self._params()):
                raise RuntimeError(
                    "ElCheStrategy(micro_batch=...): the gradients of this batch's micro-batches were cleared "
                    "between training_step and backward outside the first batch of an accumulation; zero the "
                    "gradients only in optimizer_zero_grad."
                )
            self._expect_kept_gradients = False
            return
        self._expect_kept_gradients = False
        with torch.no_grad():
            for p, grad in kept:
                if grad is None:
                    continue
                if p.grad is None:
                    p.grad = grad
                else:  # zeroed in place (set_to_none=False) by a user's optimizer_zero_grad
                    p.grad.add_(grad)


class TrainingHost(Protocol):
    """What :class:`MicroBatching` needs of the strategy."""

    @property
    def global_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def lightning_module(self) -> Optional[LightningModule]: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor: ...


AutoChooser = Callable[[Any, int, TrainingHost, Callable[[Any], Any]], int]
"""``(batch, batch_size, host, step) -> size``: the ``"auto"`` search (``micro_batch_auto.choose_micro_batch``)."""


LoggingBatch = Callable[[Any, Any], AbstractContextManager[None]]


class MicroBatching:
    """The strategy's side of one rank's ``micro_batch`` setting: resolved against the loader's
    batch size (``"auto"`` at the first batch, by trying on CUDA; the whole batch on CPU), then
    each batch trained whole or as micro-batches.

    Args:
        setting: this rank's setting (:func:`rank_micro_batch`).
        batch_size: the training DataLoader's ``batch_size``.
        host: the strategy (its rank, device, module, optimizer and backward).
        choose: the ``"auto"`` search.
        logging_batch: ``loop_glue.logging_batch`` (``self.log`` sizes its means by the micro-batch).
    """

    def __init__(self, setting: RankMicroBatch, batch_size: Optional[int], host: TrainingHost,
                 choose: AutoChooser, logging_batch: LoggingBatch) -> None:
        if batch_size is None:
            raise TypeError("ElCheStrategy(micro_batch=...) needs a DataLoader with a batch_size.")
        check_against_batch_size(setting, batch_size, f"ElCheStrategy(micro_batch={setting!r}) on rank "
                                                      f"{host.global_rank}")
        self._logging_batch = logging_batch
        self.setting = setting
        self.batch_size = batch_size
        self._host = host
        self._choose = choose
        self.steps: Optional[MicroBatchSteps] = None
        self._first_of_accumulation = True
        self.size: Optional[int] = None
        """The micro-batch in samples once known (the batch size when batches train whole)."""
        if isinstance(setting, int):
            self._resolve(setting)
        elif setting is None or host.root_device.type != "cuda":
            self._resolve(batch_size)  # "auto" on a CPU rank: the whole batch

    def _params(self) -> list[Parameter]:
        module = self._host.lightning_module
        return list(module.parameters()) if module is not None else []

    def _resolve(self, size: int) -> None:
        self.size = size
        self.steps = MicroBatchSteps(size, self._params) if size < self.batch_size else None

    def batch_started(self, first_of_accumulation: bool) -> None:
        """At each batch start: whether Lightning zeroes the gradients in its closure."""
        self._first_of_accumulation = first_of_accumulation
        if self.steps is not None:
            self.steps.batch_started(first_of_accumulation)

    def training_step(self, batch: Any, step: Callable[[Any], Any]) -> Any:
        """The output Lightning gets for ``batch``; ``step(micro)`` runs the user's training_step."""
        if self.size is None:
            self._resolve(self._choose(batch, self.batch_size, self._host, step))
            if self.steps is not None:
                self.steps.batch_started(self._first_of_accumulation)
        steps = self.steps
        if steps is None or not steps.splits(batch):
            return step(batch)
        host = self._host
        optimizer = host.optimizers[0] if host.optimizers else None
        module = host.lightning_module
        assert module is not None, "ElCheStrategy: a training step ran without a LightningModule"
        trainer = module.trainer

        def logged_step(micro: Any) -> Any:
            with self._logging_batch(trainer, micro):
                return step(micro)

        return steps.run(batch, logged_step, lambda loss: host.backward(loss, optimizer),
                         trainer.accumulate_grad_batches)

    def pre_backward(self) -> None:
        if self.steps is not None:
            self.steps.restore()

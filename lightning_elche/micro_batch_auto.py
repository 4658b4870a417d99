"""``micro_batch="auto"``: the largest micro-batch a rank's GPU holds, found by trying.

At a rank's first training batch of the fit, the candidates are tried from the largest down: the
loader's batch size ``B`` itself, then the powers of two below it (``B=96``: 96, 64, 32, 16, 8, 4,
2, 1). A try runs the user's ``training_step`` and a backward on the first ``m`` samples of that
batch, with ``self.log`` muted, then puts everything back: each parameter's ``.grad`` (the very
tensor it held), the module's buffers (BatchNorm running statistics), the CPU and CUDA random
number generators; no optimizer step is taken, the optimizer's state is not touched. A try fits
when it raised no ``torch.cuda.OutOfMemoryError`` and its peak allocated memory plus a reserve stays
within the memory this process may use; the reserve is a margin (10 % of it) plus, while the
optimizer holds no state yet, room for an Adam-like state (two copies of the trainable parameters,
allocated at the first step). An out-of-memory try is freed (its exception, frames and cached
blocks released) before the next. A card on which even one sample does not fit fails with an error
naming the rank, the device and its memory. A CPU rank trains the whole batch (there is no memory
limit to find: the host swaps rather than fails).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

from lightning_elche.micro_batch import TrainingHost, split_batch, step_loss

log = logging.getLogger(__name__)

MARGIN = 0.10
"""Share of the usable memory a chosen micro-batch leaves free (fragmentation, later allocations)."""
ADAM_STATE_COPIES = 2


def candidate_sizes(batch_size: int) -> list[int]:
    """The sizes tried, largest first: ``batch_size``, then every power of two below it."""
    sizes = [batch_size]
    power = 1 << ((batch_size - 1).bit_length() - 1) if batch_size > 1 else 0
    while power >= 1:
        sizes.append(power)
        power //= 2
    return sizes


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error."""
    return isinstance(error, torch.OutOfMemoryError)


def largest_fitting(sizes: Sequence[int], peak_of: Callable[[int], Optional[int]], budget: int) -> Optional[int]:
    """The first of ``sizes`` whose try fits: ``peak_of(m)`` returns the try's peak bytes, or None
    (or raises) when it ran out of memory; a peak above ``budget`` does not fit either. None when none fits."""
    for size in sizes:
        try:
            peak = peak_of(size)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            peak = None
        if peak is not None and peak <= budget:
            return size
    return None


@contextmanager
def muted_logging(module: Module) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing inside (a try's values are not the fit's)."""
    own = {name: vars(module)[name] for name in ("log", "log_dict") if name in vars(module)}

    def mute(*args: Any, **kwargs: Any) -> None:
        return None

    for name in ("log", "log_dict"):
        setattr(module, name, mute)
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in own:
                setattr(module, name, own[name])
            else:
                delattr(module, name)


class CudaTry:
    """Tries of one micro-batch size on a CUDA device, each leaving the module as it found it.

    Args:
        module: the LightningModule (its parameters' ``.grad`` and buffers are restored).
        device: the rank's CUDA device.
        step: runs ``training_step`` on a micro-batch and returns its loss tensor.
    """

    def __init__(self, module: Module, device: torch.device, step: Callable[[Any], Tensor]) -> None:
        self.module = module
        self.device = device
        self.step = step

    def peak(self, micro: Any) -> Optional[int]:
        """Peak allocated bytes of a forward and backward on ``micro``; None on out-of-memory."""
        params = list(self.module.parameters())
        grads = [p.grad for p in params]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        cpu_rng, cuda_rng = torch.get_rng_state(), torch.cuda.get_rng_state(self.device)
        for p in params:
            p.grad = None
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out_of_memory = False
        try:
            with muted_logging(self.module):
                loss = self.step(micro)
                loss.backward()
                del loss
            torch.cuda.synchronize(self.device)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            out_of_memory = True  # the error (and its frames' tensors) is released at the end of this clause
        peak = torch.cuda.max_memory_allocated(self.device)
        with torch.no_grad():
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state(cuda_rng, self.device)
        del buffers
        torch.cuda.empty_cache()
        return None if out_of_memory else peak


def usable_memory(device: torch.device) -> int:
    """Bytes this process may allocate on ``device``: the per-process fraction of the card, and no
    more than what it holds now plus what the card has free."""
    total = torch.cuda.get_device_properties(device).total_memory
    read_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.7
    fraction = float(read_fraction(device)) if read_fraction is not None else 1.0
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(total * fraction, torch.cuda.memory_reserved(device) + free))


def reserve_bytes(usable: int, trainable: Sequence[Tensor], optimizer_has_state: bool) -> int:
    """What a chosen micro-batch leaves free (see the module's docstring)."""
    state = 0 if optimizer_has_state else ADAM_STATE_COPIES * sum(t.numel() * t.element_size() for t in trainable)
    return int(MARGIN * usable) + state


class NoMicroBatchFits(RuntimeError):
    """Not even one sample's forward and backward fits on the rank's GPU."""


def choose_on_cuda(batch: Any, batch_size: int, rank: int, device: torch.device, trial: CudaTry,
                   optimizer_has_state: bool, first_samples: Callable[[Any, int], Any]) -> int:
    """The micro-batch ``"auto"`` picks on ``device`` for ``batch`` (logged per rank)."""
    usable = usable_memory(device)
    trainable = [p for p in trial.module.parameters() if p.requires_grad]
    budget = usable - reserve_bytes(usable, trainable, optimizer_has_state)
    peaks: dict[int, Optional[int]] = {}

    def peak_of(size: int) -> Optional[int]:
        peaks[size] = trial.peak(first_samples(batch, size))
        return peaks[size]

    chosen = largest_fitting(candidate_sizes(batch_size), peak_of, budget)
    gib = 2**30
    if chosen is None:
        total = torch.cuda.get_device_properties(device).total_memory
        raise NoMicroBatchFits(
            f"ElCheStrategy(micro_batch='auto'): rank {rank} on {device} ({total / gib:.1f} GiB, "
            f"{usable / gib:.2f} GiB usable by this process) cannot train even a micro-batch of 1 sample within "
            f"{budget / gib:.2f} GiB (a {MARGIN:.0%} margin and room for the optimizer's state kept free). Use a "
            "smaller model, mixed precision or activation checkpointing, or leave this GPU out of the fit."
        )
    tried = ", ".join(f"{m}: {'out of memory' if p is None else f'{p / gib:.2f} GiB'}" for m, p in peaks.items())
    logging.getLogger("lightning.pytorch").info(
        f"[rank: {rank}] ElChe micro_batch='auto': {chosen} of {batch_size} samples per micro-batch on {device} "
        f"({usable / gib:.2f} GiB usable, budget {budget / gib:.2f} GiB; tried {tried})"
    )
    return chosen


def choose_micro_batch(batch: Any, batch_size: int, host: TrainingHost, step: Callable[[Any], Any]) -> int:
    """``"auto"``'s size for the host's rank: by trying on CUDA (:func:`choose_on_cuda`), else the whole batch."""
    device, module = host.root_device, host.lightning_module
    if device.type != "cuda" or module is None:
        return batch_size
    trial = CudaTry(module, device, lambda micro: step_loss(step(micro), 0, 1))
    has_state = any(len(o.state) > 0 for o in host.optimizers)
    return choose_on_cuda(batch, batch_size, host.global_rank, device, trial, has_state,
                          lambda whole, size: split_batch(whole, size)[0])

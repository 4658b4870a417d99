"""Rehearse a heterogeneous rig on identical hardware: make one rank slower on purpose.

Used by the tests, the demo and the benchmark; useful to users who want to see how ElChe behaves
on a mixed rig before they have one.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_elche.checks import invalid, require_int, require_real

SM_GRANULARITY = 8


def _has_green_contexts() -> bool:
    try:
        from torch.cuda import green_contexts  # noqa: F401
    except ImportError:
        return False
    return True


def green_context_sms(total_sms: int, slowdown: float) -> int:
    """SMs to leave a rank so that compute-bound work runs about ``slowdown`` times slower.

    Rounded down to the partition granularity of recent GPUs (8 SMs), never below it.
    """
    wanted = total_sms / slowdown
    return max(SM_GRANULARITY, int(wanted // SM_GRANULARITY) * SM_GRANULARITY)


class Throttle(Callback):
    """Make rank ``rank`` about ``slowdown`` times slower than it would be.

    * ``sleep`` (the CPU default): after each backward pass the rank sleeps ``slowdown - 1`` times
      the host time from the first forward of a direct child module of the LightningModule in
      that batch (for a later backward of the same batch, a micro-batch's: the first such forward
      after the last pause) to the moment the last parameter gradient was computed.
      The sleep frees the core, as a slower device would. Both ends keep communication out of the
      span: Lightning DDP's forward broadcasts the buffers (a collective that waits for the other
      ranks) before the module's children run, and DDP's gradient all-reduce finishes after the
      last gradient, so a rank that waits on others is not slowed for its wait (counted, it made a
      throttled rank sleep longer the more it waited: a feedback loop). A module whose step runs
      no child module is timed from the batch start (or the last pause).
    * ``sm_limit`` (the CUDA default): the rank computes on the stream of a CUDA green context
      that holds only ``total_sms / slowdown`` SMs, so the slowdown is real device time. Work that
      is not compute-bound (a small model fed from the CPU) may not slow down: check with a solo
      run, as the benchmark does.

    Args:
        rank: the global rank to slow down.
        slowdown: factor >= 1 (1 = no throttle).
        method: ``"auto"`` (``sm_limit`` on CUDA, else ``sleep``), ``"sleep"`` or ``"sm_limit"``.
    """

    def __init__(self, rank: int, slowdown: float, method: Literal["auto", "sleep", "sm_limit"] = "auto") -> None:
        rank = require_int(f"Throttle(rank={rank!r})", rank, 0)
        allowed = "expected a finite number >= 1"
        if require_real(f"Throttle(slowdown={slowdown!r})", slowdown, allowed) < 1:
            raise invalid(f"Throttle(slowdown={slowdown!r})", allowed)
        if method not in ("auto", "sleep", "sm_limit"):
            raise ValueError(f"Throttle(method={method!r}) is invalid: expected 'auto', 'sleep' or 'sm_limit'.")
        self.rank = rank
        self.slowdown = float(slowdown)
        self.method = method
        self.active_method: Optional[str] = None
        self.sleep_s = 0.0
        self.sms: Optional[int] = None
        self._t0 = 0.0
        self._t_forward: Optional[float] = None
        self._t_grads: Optional[float] = None
        self._grad_hook: Any = None
        self._forward_hooks: list[Any] = []
        self._green: Any = None
        self._previous_stream: Optional[torch.cuda.Stream] = None

    def _resolve(self, device: torch.device) -> Optional[str]:
        if self.slowdown == 1.0:
            return None
        if self.method == "auto" and device.type != "cuda":
            return "sleep"
        if self.method == "sm_limit" and device.type != "cuda":
            raise ValueError("Throttle(method='sm_limit') needs a CUDA device.")
        method = self.method if self.method != "auto" else "sm_limit"
        if method == "sm_limit" and not _has_green_contexts():
            raise RuntimeError(
                f"Throttle(method={self.method!r}) limits SMs with CUDA green contexts "
                f"(torch.cuda.green_contexts), which torch {torch.__version__} lacks: use torch >= 2.10 "
                "or Throttle(method='sleep')."
            )
        return method

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        self.active_method = self._resolve(trainer.strategy.root_device)
        if self.active_method == "sleep":
            params = [p for p in pl_module.parameters() if p.requires_grad]
            if params:
                self._grad_hook = torch.autograd.graph.register_multi_grad_hook(
                    params, self._on_gradients_ready, mode="all"
                )
            # Direct children only: the first of them to run starts the span, one hook call per child.
            self._forward_hooks = [
                child.register_forward_pre_hook(self._on_child_forward) for child in pl_module.children()
            ]

    def _on_child_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._t_forward is None:
            self._t_forward = time.perf_counter()

    def _on_gradients_ready(self, grads: Any) -> None:
        self._t_grads = time.perf_counter()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._grad_hook is not None:
            self._grad_hook.remove()
            self._grad_hook = None
        for hook in self._forward_hooks:
            hook.remove()
        self._forward_hooks = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active_method == "sm_limit":
            self._enter_green_context(trainer.strategy.root_device)

    def _enter_green_context(self, device: torch.device) -> None:
        from torch.cuda.green_contexts import GreenContext

        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).multi_processor_count
        self.sms = green_context_sms(total, self.slowdown)
        try:
            self._green = GreenContext.create(num_sms=self.sms, device_id=index)
        except TypeError:  # older signature: create(num_sms, device_id)
            self._green = GreenContext.create(self.sms, index)  # type: ignore[call-arg, arg-type]  # older torch
        stream = self._green.Stream()
        self._previous_stream = torch.cuda.current_stream(device)
        stream.wait_stream(self._previous_stream)
        torch.cuda.set_stream(stream)

    def _leave_green_context(self) -> None:
        if self._previous_stream is None:
            return
        current = torch.cuda.current_stream()
        self._previous_stream.wait_stream(current)
        torch.cuda.set_stream(self._previous_stream)
        self._previous_stream = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.active_method == "sleep":
            self._t_grads = None
            self._t_forward = None
            self._t0 = time.perf_counter()

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.active_method == "sleep":
            start = self._t_forward if self._t_forward is not None else self._t0
            end = self._t_grads if self._t_grads is not None else time.perf_counter()
            pause = (self.slowdown - 1.0) * max(0.0, end - start)
            self.sleep_s += pause
            time.sleep(pause)
            # A batch trained as micro-batches (ElCheStrategy(micro_batch=...)) or with a user's manual
            # backward runs several backwards: the next one is slowed for its own compute, not again
            # for this span and its pause (which would grow the pauses geometrically).
            self._t0 = time.perf_counter()
            self._t_forward = None
            self._t_grads = None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._leave_green_context()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._leave_green_context()

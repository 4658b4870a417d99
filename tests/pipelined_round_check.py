"""The nccl round in parts (``CollectivePlane.chunk_bytes``) on the CPU, run by
``tests/test_fused_drift_interpreter.py`` under Triton's interpreter: CUDA streams and NCCL's
one-rank PreMulSum are stood in for, the plane's own logic and the Triton kernels are real. The
consensus and the measurement equal the whole round's; a reduce that fails at launch, one that
fails after writing garbage and one whose measurement cannot be ordered behind it all leave a
round that the survivor reruns from exactly the pre-round values."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from test_zero_copy import Done, Failed, Premul  # this file's folder is the script's first import path
from torch import nn

from lightning_elche.averaging import AveragedLayout, round_weights
from lightning_elche.membership.change import PeerFailure
from lightning_elche.planes import collective as collective_plane
from lightning_elche.planes import fused
from lightning_elche.planes.collective import CollectivePlane


class Stream:  # CUDA's streams stood in for: the interpreter runs every kernel at once, in order
    device = torch.device("cpu")

    def __init__(self, device: Any = None) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


def premul_sum(tensor: torch.Tensor, op: Any = None, **kwargs: Any) -> Done:
    if isinstance(op, Premul):  # one rank: its scaled values are the sum
        # bfloat16 as PyTorch hands it to NCCL (pytorch/pytorch#190745): 0.5 read as zero
        tensor.mul_(0.0 if tensor.dtype == torch.bfloat16 else op.factor)
    else:  # bfloat16 is multiplied before a plain SUM
        assert op == dist.ReduceOp.SUM and tensor.dtype == torch.bfloat16, (op, tensor.dtype)
    return Done()


class Mixed(nn.Module):
    """A float32 trunk and a bfloat16 head: one joint buffer of each."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 300), nn.LayerNorm(300))
        self.head = nn.Linear(300, 33).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x).to(torch.bfloat16)).float()


def check(copy_in_parts: bool) -> None:
    torch.manual_seed(0)
    model = Mixed()
    patches = [
        mock.patch.object(torch.cuda, "Stream", Stream),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: Stream()),
        mock.patch.object(torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        mock.patch.object(dist, "_make_nccl_premul_sum", Premul, create=True),
        mock.patch.object(dist, "all_reduce", premul_sum),
        mock.patch.object(collective_plane, "drift_or_none", fused.FusedDrift),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        plane = CollectivePlane(AveragedLayout(model), 0, 1, torch.device("cpu"))
        plane._premul_backend = True
        plane.out_of_place = False  # the in-place round (the out-of-place one: tests/test_out_of_place_round.py)
        plane.copy_in_parts = copy_in_parts
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step() -> None:
            optimizer.zero_grad()
            model(torch.randn(8, 64)).pow(2).mean().backward()
            optimizer.step()

        step()
        before = [p.detach().clone() for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        norm = torch.cat([b.double().flatten() for b in before]).norm().item()
        measured = {}
        for parts in (16 * 1024, None):
            plane.chunk_bytes = parts
            with torch.no_grad():
                for p, b, g in zip(model.parameters(), before, grads, strict=True):
                    p.copy_(b)
                    p.grad = g.clone()
            calls: list[int] = []

            def counted(tensor: torch.Tensor, calls: list[int] = calls, **kwargs: Any) -> Done:
                calls.append(tensor.numel())
                return premul_sum(tensor, **kwargs)

            with mock.patch.object(dist, "all_reduce", counted):
                divergence = plane.average(round_weights([1, 1], 1.0))
            assert all(torch.equal(p, b * 0.5) for p, b in zip(model.parameters(), before, strict=True))
            assert all(p.grad is None for p in model.parameters())
            assert sum(calls) == sum(p.numel() for p in model.parameters())
            assert (len(calls) > 3) == (parts is not None), calls
            measured[parts] = divergence.tolist()
            assert plane._drift._tickets.item() == 0
        halved = torch.tensor([norm / 2, norm, norm / 2], dtype=torch.float64)
        assert torch.allclose(torch.tensor(measured[16 * 1024], dtype=torch.float64), halved, rtol=1e-6)
        assert measured[16 * 1024] == measured[None], measured

        plane.chunk_bytes = 16 * 1024
        for failure in ("at-launch", "garbage", "unordered"):
            step()
            before = [p.detach().clone() for p in model.parameters()]
            calls = []

            def failing(tensor: torch.Tensor, failure: str = failure, calls: list[int] = calls, **kwargs: Any) -> Any:
                calls.append(tensor.numel())
                if failure == "at-launch" and len(calls) == 2:
                    raise PeerFailure("lost as the second part is launched")
                if failure == "garbage":
                    tensor.fill_(float("nan"))
                    return Failed()
                if failure == "unordered" and len(calls) == 2:
                    premul_sum(tensor, **kwargs)
                    return Failed()  # its measurement cannot be queued; the watched wait reports it
                return premul_sum(tensor, **kwargs)

            with mock.patch.object(dist, "all_reduce", failing):
                try:
                    plane.average(round_weights([1, 1], 1.0))
                except PeerFailure:
                    pass
                else:
                    raise AssertionError(f"{failure}: the round should fail")
            assert plane._drift_stream is None, failure
            divergence = plane.average(round_weights([1], 1.0))  # the survivor alone
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), failure
            assert divergence[0].item() == 0.0, (failure, divergence)
            assert plane._drift._tickets.item() == 0


for copy_in_parts in (True, False):  # parts copied before their reduce, or the whole model first
    check(copy_in_parts)
print("checked")

"""The ``nccl_*`` round on ONE GPU (a one-rank NCCL group; `pytest -m gpu`): the out-of-place
round (the default on NCCL) against the in-place one, the fused kernels against the multi-tensor
path, a failed round run again from the same values, and the memory a round takes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_elche.averaging import AveragedLayout, round_weights
from lightning_elche.membership.change import PeerFailure
from lightning_elche.planes import collective as collective_plane
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.planes.fused import QueuedDrift, fused_drift_available
from lightning_elche.planes.settle import FusedSettle, Settled, settled_numel
from lightning_elche.rounds import META_SIZE, Meta

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture
def one_rank_nccl(tmp_path: Any) -> Iterator[None]:
    """A one-rank NCCL default group on the first GPU, for the test's duration."""
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


class Failed:
    def wait(self, timeout: Any = None) -> bool:
        raise PeerFailure("peer lost mid-reduce")


def stepped_model(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1000), nn.LayerNorm(1000), nn.ReLU(), nn.Linear(1000, 77)).cuda().to(dtype)
    x = torch.randn(32, 256, device="cuda", dtype=dtype)
    return model, x


def step(model: nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(x).float().pow(2).mean().backward()
    optimizer.step()


class SteppedRound:
    """A model one optimizer step in, its plane, and its values and gradients after that step."""

    def __init__(self, dtype: torch.dtype, out_of_place: Optional[bool] = False) -> None:
        self.model, self.x = stepped_model(dtype)
        self.plane = CollectivePlane(AveragedLayout(self.model), 0, 1, torch.device("cuda", 0))
        self.plane.out_of_place = out_of_place
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        step(self.model, self.x, self.optimizer)
        self.before = [p.detach().clone() for p in self.model.parameters()]
        self.grads = [p.grad.clone() for p in self.model.parameters()]
        self.norm = torch.cat([b.float().flatten() for b in self.before]).norm().item()

    @torch.no_grad()
    def reset(self) -> None:
        """Back to the values and gradients after the step (the same state for every path)."""
        for p, b, g in zip(self.model.parameters(), self.before, self.grads, strict=True):
            p.copy_(b)
            p.grad = g.clone()


def halve(flats: list[torch.Tensor], factor: float, wait: bool = True) -> list[Any]:
    torch._foreach_mul_(flats, 0.5)
    return []


def alone(flats: list[torch.Tensor], factor: float, wait: bool = True) -> list[Any]:
    return []


@pytest.mark.parametrize("queued", [False, True], ids=["after-the-reduce", "queued"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_drift_matches_the_multi_tensor_path_and_a_failed_round_restores(one_rank_nccl, dtype, queued):
    stepped = SteppedRound(dtype)
    model, x, plane, optimizer, norm = stepped.model, stepped.x, stepped.plane, stepped.optimizer, stepped.norm
    plane.queued = queued
    assert fused_drift_available(plane.layout.joint), "Triton should be there with PyTorch's CUDA wheel"
    measured = {}
    for fused in (True, False):  # the same state for both paths
        plane.fused = fused
        stepped.reset()
        # A consensus of half the values: the drift is then ||p / 2||, known exactly.
        with mock.patch.object(plane, "sum_scaled", halve):
            divergence = plane.average(round_weights([1], 1.0))
        assert divergence is not None and divergence.dtype == torch.float64
        assert all(p.grad is None for p in model.parameters())
        measured[fused] = divergence.tolist()
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert measured[fused] == pytest.approx([norm / 2, norm, norm / 2], rel=tolerance)
    assert plane._drift is not None
    assert (plane._drift_stream is not None) == queued, "the fused drift is queued behind the reduce if asked"
    # Both accumulate in f32; the multi-tensor norms of bf16 tensors come back rounded to bf16.
    assert measured[True] == pytest.approx(measured[False], rel=1e-6 if dtype == torch.float32 else 1e-2)
    assert measured[True] == pytest.approx([norm / 2, norm, norm / 2], rel=1e-5)  # the fused one is not rounded

    # A round that fails mid-reduce leaves garbage; the retry runs from the pre-round values.
    step(model, x, optimizer)
    before = [p.detach().clone() for p in model.parameters()]

    def scribble(tensor: torch.Tensor, **kwargs: Any) -> Failed:
        tensor.fill_(float("nan"))
        return Failed()

    plane.fused = True
    abandoned, stream = len(QueuedDrift._abandoned), plane._drift_stream
    with mock.patch.object(collective_plane.dist, "all_reduce", scribble), pytest.raises(PeerFailure):
        plane.average(round_weights([1, 1], 1.0))
    # The side stream that waited on the failed reduce is never joined, nor used again.
    assert len(QueuedDrift._abandoned) == abandoned + queued and plane._drift_stream is None
    with mock.patch.object(plane, "sum_scaled", alone):  # the survivor alone: its own values
        divergence = plane.average(round_weights([1], 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert divergence is not None and divergence[0].item() == 0.0
    if queued:
        assert plane._drift_stream is not None and plane._drift_stream is not stream
    plane.close()


def test_the_one_launch_drift_sums_every_block_of_every_dtype_round_after_round(one_rank_nccl):
    """Blocks of two dtypes (two launches sharing one ticket counter), more blocks than the last
    program sums in one pass, rounds back to back, pre-round copies at odd addresses: the counter
    must be back at 0 after every round and the measurement must equal float64 norms of the same
    values."""
    torch.manual_seed(1)
    model = nn.ModuleDict({"wide": nn.Linear(3000, 2000), "narrow": nn.Linear(1000, 997).to(torch.bfloat16)}).cuda()
    plane = CollectivePlane(AveragedLayout(model), 0, 1, torch.device("cuda", 0))
    plane.out_of_place = False
    assert len(plane.layout.joint) == 2
    for round_index in range(4):
        for p in model.parameters():
            if round_index % 2:  # gradients one element past an allocation's alignment
                p.grad = torch.randn(p.numel() + 1, device="cuda", dtype=p.dtype)[1:].view_as(p)
            else:
                p.grad = torch.randn_like(p)
        before = [p.detach().double().clone() for p in model.parameters()]
        factor = 0.5 + 0.1 * round_index

        def scale(flats: list[torch.Tensor], f: float, wait: bool = True, factor: float = factor) -> list[Any]:
            torch._foreach_mul_(flats, factor)
            return []

        with mock.patch.object(plane, "sum_scaled", scale):
            divergence = plane.average(round_weights([1], 1.0))
        assert divergence is not None
        after = [p.detach().double() for p in model.parameters()]
        expected = [
            sum(((b - a) ** 2).sum().item() for a, b in zip(after, before, strict=True)) ** 0.5,
            sum((b**2).sum().item() for b in before) ** 0.5,
            sum((a**2).sum().item() for a in after) ** 0.5,
        ]
        assert divergence.tolist() == pytest.approx(expected, rel=1e-5)
        assert plane._drift is not None and plane._drift._blocks > 1024
        assert plane._drift._tickets.item() == 0
    plane.close()


class LaunchFailure(PeerFailure):
    pass


@pytest.mark.parametrize("copy_in_parts", [True, False], ids=["copied-in-parts", "copied-whole"])
@pytest.mark.parametrize("chunk_bytes", [64 * 1024, 1 << 30], ids=["many-parts", "one-part"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_round_in_parts_averages_measures_and_restores_like_the_whole_round(one_rank_nccl, dtype, chunk_bytes,
                                                                                copy_in_parts):
    """``chunk_bytes``: each part copied aside, reduced (the real one-rank NCCL PreMulSum) and
    measured on the side stream behind its reduce. The consensus, the measurement and a failed
    round's restore must equal the whole round's, with a reduce that fails when it is launched
    (the later parts' copies must still be queued) and one that fails after writing garbage."""
    stepped = SteppedRound(dtype)
    model, x, plane, optimizer, norm = stepped.model, stepped.x, stepped.plane, stepped.optimizer, stepped.norm
    before = stepped.before
    plane.copy_in_parts = copy_in_parts
    measured, consensus = {}, {}
    for parts in (chunk_bytes, None):
        plane.chunk_bytes = parts
        stepped.reset()
        divergence = plane.average(round_weights([1, 1], 1.0))  # this rank's factor 1/2, alone
        assert divergence is not None
        # Halving is exact in both dtypes (bfloat16 is halved before a plain SUM: PreMulSum's
        # bfloat16 factor reaches NCCL at the wrong width, pytorch/pytorch#190745).
        exact = {"rtol": 0.0, "atol": 0.0}
        errors = [((p.float() - b.float() * 0.5).abs() / b.float().abs().clamp_min(1e-30)).max().item()
                  for p, b in zip(model.parameters(), before, strict=True)]
        assert all(torch.allclose(p, b * 0.5, **exact) for p, b in zip(model.parameters(), before, strict=True)), (
            f"chunk_bytes={parts}: largest relative error per parameter {errors}")
        assert all(p.grad is None for p in model.parameters())
        measured[parts] = divergence.tolist()
        consensus[parts] = [p.detach().clone() for p in model.parameters()]
    # The parts reduce the same values with the same NCCL operation as the whole round: the same bits.
    assert all(torch.equal(a, b) for a, b in zip(consensus[chunk_bytes], consensus[None], strict=True))
    pieces = plane._drift.chunks(chunk_bytes)  # type: ignore[union-attr]
    assert (len(pieces) > 8) == (chunk_bytes < 1 << 20), len(pieces)
    halved = [norm / 2, norm, norm / 2]
    assert measured[chunk_bytes] == pytest.approx(halved, rel=1e-5 if dtype == torch.float32 else 1e-2)
    assert measured[chunk_bytes] == pytest.approx(measured[None], rel=1e-6)
    assert plane._drift._tickets.item() == 0  # type: ignore[union-attr]

    plane.chunk_bytes = chunk_bytes
    real_all_reduce = dist.all_reduce
    for failure in ("at-launch", "garbage"):
        step(model, x, optimizer)
        before = [p.detach().clone() for p in model.parameters()]
        calls = []

        def failing(tensor: torch.Tensor, failure: str = failure, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls.append(tensor.numel())
            if failure == "at-launch" and len(calls) == min(2, len(pieces)):
                raise LaunchFailure("peer lost as the second part's reduce is launched")
            if failure == "garbage":
                tensor.fill_(float("nan"))
                return Failed()
            return real_all_reduce(tensor, **kwargs)

        abandoned = len(QueuedDrift._abandoned)
        with mock.patch.object(collective_plane.dist, "all_reduce", failing), pytest.raises(PeerFailure):
            plane.average(round_weights([1, 1], 1.0))
        assert len(QueuedDrift._abandoned) == abandoned + 1 and plane._drift_stream is None
        divergence = plane.average(round_weights([1], 1.0))  # the survivor alone: factor 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), failure
        assert divergence is not None and divergence[0].item() == 0.0
        norm = torch.cat([b.float().flatten() for b in before]).norm().item()
        assert divergence[1].item() == pytest.approx(norm, rel=1e-5)

    # A whole round as the engine runs it: nothing is copied beside the exchange, every part after.
    step(model, x, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    local = torch.zeros(META_SIZE, dtype=torch.float64, device="cuda")
    local[Meta.STEPS], local[Meta.FINITE] = 3.0, 1.0
    plane.start(local)
    result = plane.collect()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert result.divergence is not None and result.divergence[0].item() == 0.0
    plane.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_out_of_place_round_averages_measures_and_survives_a_failure_like_the_in_place_round(one_rank_nccl,
                                                                                               dtype):
    """The default round on NCCL: a reduce-scatter into a round buffer and an all-gather there (the
    real one-rank NCCL, PreMulSum for float32), settled by one Triton kernel. The same consensus
    bits and drift as the in-place round; a failure leaves the live values as they were, and the
    retry writes into the failed round's buffers."""
    stepped = SteppedRound(dtype, out_of_place=None)
    model, x, plane, optimizer, norm = stepped.model, stepped.x, stepped.plane, stepped.optimizer, stepped.norm
    assert plane._reduces_out_of_place(), "NCCL takes the out-of-place round by default"
    measured, consensus = {}, {}
    for out_of_place in (None, False):
        plane.out_of_place = out_of_place
        stepped.reset()
        calls: list[str] = []
        with mock.patch.object(collective_plane.dist, "all_reduce", wraps=dist.all_reduce) as all_reduce:
            divergence = plane.average(round_weights([1, 1], 1.0))  # this rank's factor 1/2, alone
            calls.append(f"all_reduce x{all_reduce.call_count}")
        assert divergence is not None
        assert all(torch.equal(p, b * 0.5) for p, b in zip(model.parameters(), stepped.before, strict=True))
        assert all(p.grad is None for p in model.parameters())
        measured[out_of_place] = divergence.tolist()
        consensus[out_of_place] = [p.detach().clone() for p in model.parameters()]
        assert calls == ["all_reduce x0" if out_of_place is None else "all_reduce x1"], calls
    assert all(torch.equal(a, b) for a, b in zip(consensus[None], consensus[False], strict=True))
    assert measured[None] == pytest.approx([norm / 2, norm, norm / 2], rel=1e-5)
    assert measured[None] == pytest.approx(measured[False], rel=1e-6 if dtype == torch.float32 else 1e-2)
    assert plane._settle is not None and plane._settle._tickets.item() == 0

    plane.out_of_place = None
    step(model, x, optimizer)
    before = [p.detach().clone() for p in model.parameters()]

    def scribble(output: torch.Tensor, local: torch.Tensor, **kwargs: Any) -> Failed:
        output.fill_(float("nan"))
        return Failed()

    with mock.patch.object(collective_plane, "all_gather_flat", scribble), pytest.raises(PeerFailure):
        plane.average(round_weights([1, 1], 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "never written"
    kept = [buf.data_ptr() for buf in plane._kept_round_buffers]
    assert kept and plane.round_buffers()[0].data_ptr() == kept[0], "the retry reuses the failed round's buffers"
    divergence = plane.average(round_weights([1], 1.0))  # the survivor alone: its own values
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert divergence is not None and divergence[0].item() == 0.0
    plane.close()


def test_the_settle_kernel_strides_over_large_buffers_of_two_dtypes_round_after_round(one_rank_nccl):
    """More values than the grid covers in one stride (a 20 M-value buffer), two dtypes sharing the
    ticket counter, lengths that are not multiples of 16: every live value takes the consensus and
    the norms equal float64 ones of the measured head."""
    torch.manual_seed(2)
    sizes = {torch.float32: 20_000_003, torch.bfloat16: 999_997}
    joint = [torch.randn(n + 64, device="cuda").to(dtype)[:n] for dtype, n in sizes.items()]
    settle = FusedSettle(joint)
    for round_index in range(3):
        consensus = [torch.randn(settled_numel(flat), device="cuda").to(flat.dtype) for flat in joint]
        heads = [flat.numel() - 1000 * (round_index + 1) for flat in joint]
        pre = torch.cat([flat[:head].double() for flat, head in zip(joint, heads, strict=True)])
        after = torch.cat([c[:head].double() for c, head in zip(consensus, heads, strict=True)])
        expected = torch.stack([(pre - after).norm(), pre.norm(), after.norm()])
        out = settle([Settled(flat, c, head) for flat, c, head in zip(joint, consensus, heads, strict=True)])
        assert torch.allclose(out, expected, rtol=1e-6), (out, expected)
        assert all(torch.equal(flat, c[:flat.numel()]) for flat, c in zip(joint, consensus, strict=True))
        assert settle._tickets.item() == 0


@pytest.mark.parametrize("out_of_place", [None, False], ids=["out-of-place", "in-place"])
def test_a_round_allocates_no_model_sized_memory_beyond_the_gradients_a_step_leaves(one_rank_nccl, out_of_place):
    """Item 1 of issue 25 at the round itself: the in-place round keeps its pre-round values in the
    step's spent gradients, the out-of-place round drops them before it takes its round buffer,
    so the peak during a round stays within a small fraction of the model above where it stood."""
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)]).cuda()  # 16.8 M values, 67 MB
    plane = CollectivePlane(AveragedLayout(model), 0, 1, torch.device("cuda", 0))
    plane.out_of_place = out_of_place
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        plane.average(round_weights([1, 1], 1.0))
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - held
        assert extra < 0.05 * model_bytes, f"the round took {extra / model_bytes:.2f} model copies more"
    assert plane._reduces_out_of_place() == (out_of_place is None)
    plane.close()

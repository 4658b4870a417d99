"""The out-of-place round of the ``nccl_*`` modes (``CollectivePlane.out_of_place``): the live
parameters are reduce-scattered into a round buffer, gathered there, and settled into the live
buffers only once every collective has finished. On NCCL it is the default; here its collectives
are stood in for in one process, and run for real over gloo between processes. Its kernel:
``tests/test_fused_drift_interpreter.py``; on a GPU: ``tests/test_gpu_round.py``."""

from __future__ import annotations

import contextlib
import os
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_helpers import free_port
from test_zero_copy import Done, Failed, Premul
from torch import nn

from lightning_elche.averaging import SPARE_TAIL, AveragedLayout, FlatTensors, round_weights
from lightning_elche.membership.change import PeerFailure
from lightning_elche.planes import collective as collective_plane
from lightning_elche.planes.collective import CollectivePlane, padded_numel


def mixed_model() -> nn.Module:
    """Parameters of two dtypes, float buffers (BatchNorm), sizes that pad unevenly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 3).to(torch.bfloat16))


def stepped(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)  # a step's spent gradients


class OnOneRank:
    """NCCL's two halves of an all-reduce stood in for on one rank of ``world_size`` (the others
    contributing nothing): PreMulSum scales, the gather copies the share out; every call recorded."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.calls: list[tuple[str, torch.dtype, Any]] = []
        self.grads_at_reduce: list[bool] = []

    def reduce_scatter_tensor(self, piece: torch.Tensor, source: torch.Tensor, op: Any = None, **kwargs: Any) -> Done:
        self.calls.append(("reduce_scatter", source.dtype, op))
        share = piece.numel()
        assert source.numel() == share * self.world_size
        values = source[self.rank * share:(self.rank + 1) * share]
        piece.copy_(values * op.factor if isinstance(op, Premul) else values)
        return Done()

    def all_gather_flat(self, out: torch.Tensor, piece: torch.Tensor, **kwargs: Any) -> Done:
        self.calls.append(("all_gather", out.dtype, None))
        share = piece.numel()
        assert out.numel() == share * self.world_size
        assert piece.data_ptr() == out[self.rank * share:].data_ptr(), "gathered in place"
        out[:self.rank * share] = 0.0  # the other ranks' shares: they sent nothing
        out[(self.rank + 1) * share:] = 0.0
        return Done()


def patched(fake: OnOneRank, gather: Any = None) -> Any:
    def scatter(piece: torch.Tensor, source: torch.Tensor, op: Any, **kwargs: Any) -> Done:
        return fake.reduce_scatter_tensor(piece, source, op=op)  # looked up per call: tests replace it

    stack = contextlib.ExitStack()
    stood_in = stack.enter_context(mock.patch.multiple(
        collective_plane.dist, all_reduce=mock.DEFAULT, _make_nccl_premul_sum=Premul, create=True))
    stack.enter_context(mock.patch.object(collective_plane, "reduce_scatter_flat", scatter))
    stack.enter_context(mock.patch.object(collective_plane, "all_gather_flat", gather or fake.all_gather_flat))
    return stack, stood_in


def nccl_like_plane(model: nn.Module, world_size: int = 1) -> CollectivePlane:
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=world_size, device=torch.device("cuda", 0))
    plane._premul_backend = True  # as on NCCL
    return plane


def test_the_round_goes_out_of_place_where_nccl_reduces_unless_the_in_place_round_is_asked_for():
    model = mixed_model()
    plane = nccl_like_plane(model)
    assert plane._reduces_out_of_place()
    plane.chunk_bytes = 1 << 20
    assert not plane._reduces_out_of_place(), "the round in parts is the in-place round's"
    plane.chunk_bytes, plane.queued = None, True
    assert not plane._reduces_out_of_place(), "the queued measurement is the in-place round's"
    plane.queued, plane.out_of_place = False, False
    assert not plane._reduces_out_of_place()
    gloo = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    gloo._premul_backend = False
    assert not gloo._reduces_out_of_place(), "gloo keeps the in-place round unless asked"
    gloo.out_of_place = True
    assert gloo._reduces_out_of_place()
    # Padding reaches into the spare tail: a world too large for it takes the in-place round.
    gloo.world_size = (max(flat.numel() for flat in gloo.layout.joint) + SPARE_TAIL) // 16 + 2
    assert not gloo._reduces_out_of_place()
    fixed = CollectivePlane(AveragedLayout.fixed(FlatTensors([nn.Parameter(torch.randn(5))]), FlatTensors([])),
                            rank=0, world_size=3, device=torch.device("cpu"))
    fixed.out_of_place = True
    assert fixed._reduces_out_of_place(), "flat buffers of their own have the spare tail too"


@pytest.mark.parametrize("world_size", [1, 3])
def test_nccl_scales_float32_inside_the_reduce_scatter_and_bfloat16_before_it_and_the_live_values_settle_last(
        world_size: int) -> None:
    model = mixed_model()
    plane = nccl_like_plane(model, world_size)
    stepped(model)
    buffers = [model[1].running_mean, model[1].running_var]
    before = [t.detach().clone() for t in list(model.parameters()) + buffers]
    fake = OnOneRank(world_size, rank=0)
    real_reduce_scatter = fake.reduce_scatter_tensor

    def reduce_scatter(piece: torch.Tensor, source: torch.Tensor, **kwargs: Any) -> Done:
        fake.grads_at_reduce.append(all(p.grad is None for p in model.parameters()))
        live = list(model.parameters())
        assert all(torch.equal(p, b) for p, b in zip(live, before, strict=False)), "untouched until settled"
        return real_reduce_scatter(piece, source, **kwargs)

    fake.reduce_scatter_tensor = reduce_scatter  # type: ignore[method-assign]
    stack, stood_in = patched(fake)
    with stack:
        divergence = plane.average(round_weights([1] * world_size, 1.0))  # this rank's factor 1/world_size
        stood_in["all_reduce"].assert_not_called()
    assert [name for name, _, _ in fake.calls] == ["reduce_scatter", "all_gather"] * 2, "two collectives per dtype"
    ops = {dtype: op for name, dtype, op in fake.calls if name == "reduce_scatter"}
    if world_size == 1:  # NCCL's one-rank reduce-scatter copies without scaling: multiplied first
        assert ops[torch.float32] == dist.ReduceOp.SUM
    else:
        assert isinstance(ops[torch.float32], Premul) and ops[torch.float32].factor == pytest.approx(1 / world_size)
    assert ops[torch.bfloat16] == dist.ReduceOp.SUM, "bfloat16 multiplied first (pytorch/pytorch#190745)"
    assert all(fake.grads_at_reduce), "the step's gradients are dropped before the round buffer is taken"
    # Alone, the consensus of this rank's scaled share is its own values times the factor: on
    # one rank the whole buffer, on three the first third (the other ranks sent nothing).
    flat = plane.layout.joint[0]
    share = padded_numel(flat.numel(), world_size) // world_size
    expected = torch.cat([b.flatten() for b in before[:4] + before[6:]]) / world_size  # float32 params, buffers
    expected[share:] = 0.0
    assert torch.allclose(flat, expected), "the live buffer holds the gathered consensus"
    assert divergence is not None and divergence.dtype == torch.float64
    assert plane._kept_round_buffers == [], "no buffer outlives a round that finished"
    tails = [flat.as_strided((flat.numel() + SPARE_TAIL,), (1,))[flat.numel():] for flat in plane.layout.joint]
    assert all(bool((tail == 0).all()) for tail in tails), "the padding reduces to zeros: nothing leaks there"
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_out_of_place_round_leaves_the_live_values_and_its_retry_reuses_the_round_buffers():
    model = mixed_model()
    plane = nccl_like_plane(model, world_size=2)
    stepped(model)
    before = [t.detach().clone() for t in list(model.parameters()) + [model[1].running_mean]]
    fake = OnOneRank(2, rank=0)

    def gathered_garbage(out: torch.Tensor, piece: torch.Tensor, **kwargs: Any) -> Done:
        out.fill_(float("nan"))
        return Failed()

    stack, _ = patched(fake, gathered_garbage)
    # The buffers carry a ratio of weights into the reduce (scaled in place): 3 steps against 1.
    with stack, pytest.raises(PeerFailure):
        plane.average(round_weights([3, 1], 1.0))
    after = list(model.parameters()) + [model[1].running_mean]
    assert all(torch.equal(a, b) for a, b in zip(after[:6], before[:6], strict=True)), "parameters never written"
    kept = plane._kept_round_buffers
    assert len(kept) == 2, "the abandoned collectives' buffers are kept for the next rounds"
    used: list[int] = []
    alone = OnOneRank(1, rank=0)
    real = alone.reduce_scatter_tensor

    def reduce_scatter(piece: torch.Tensor, source: torch.Tensor, **kwargs: Any) -> Done:
        used.append(piece.data_ptr())
        return real(piece, source, **kwargs)

    alone.reduce_scatter_tensor = reduce_scatter  # type: ignore[method-assign]
    plane.world_size = 1  # the survivor alone
    stack, _ = patched(alone)
    with stack:
        divergence = plane.average(round_weights([1], 1.0))
    assert used == [buf.data_ptr() for buf in kept], "the retry writes into the kept buffers"
    after = list(model.parameters()) + [model[1].running_mean]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "the retry ran from the same values"
    assert divergence is not None and divergence[0].item() == 0.0


def _gloo_rank(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for out_of_place in (True, False):
            model = mixed_model()
            with torch.no_grad():  # every rank its own replica
                for p in model.parameters():
                    p.add_(0.1 * rank)
                model[1].running_mean.add_(rank)
            stepped(model)
            plane = CollectivePlane(AveragedLayout(model), rank, world_size, torch.device("cpu"))
            plane.out_of_place = out_of_place
            assert plane._reduces_out_of_place() == out_of_place
            divergence = plane.average(round_weights([1 + r for r in range(world_size)], 1.0))
            assert divergence is not None and all(p.grad is None for p in model.parameters())
            results[out_of_place] = ([t.detach().float().clone() for t in model.parameters()]
                                     + [model[1].running_mean.clone()], divergence)
        (moved, measured), (reference, reference_measured) = results[True], results[False]
        for a, b, p in zip(moved, reference, list(model.parameters()) + [None], strict=True):
            # bfloat16 sums of a ring all-reduce and of a reduce-scatter round apart by their order
            atol = 4e-3 if p is not None and p.dtype == torch.bfloat16 else 1e-6
            assert torch.allclose(a, b, rtol=1e-5, atol=atol), (a, b)
        assert torch.allclose(measured, reference_measured, rtol=1e-2), (measured, reference_measured)
        replicas: list[Any] = [None] * world_size
        dist.all_gather_object(replicas, [t.tolist() for t in moved])
        assert all(r == replicas[0] for r in replicas), "identical replicas"
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_out_of_place_round_over_gloo_processes_averages_like_the_in_place_round(world_size: int) -> None:
    """Real reduce-scatter and all-gather between processes, padded shares, two dtypes and float
    buffers weighted apart from the parameters: the same consensus and drift as the in-place
    round, and every replica identical."""
    mp.spawn(_gloo_rank, args=(world_size, free_port()), nprocs=world_size, join=True)

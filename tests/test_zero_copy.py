"""The parameters live in the averaging plane's flat buffer for the whole fit (zero-copy rounds)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from zero_copy_helpers import ConvClassifier, ZeroCopyProbe, load_probe_records

from lightning_elche import ElCheStrategy
from lightning_elche.averaging import AveragedLayout, round_weights
from lightning_elche.membership.change import Change, PeerFailure
from lightning_elche.planes import collective as collective_plane
from lightning_elche.planes.collective import CollectivePlane


class Done:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Failed(Done):
    def wait(self, timeout: Any = None) -> bool:
        raise PeerFailure("peer lost mid-reduce")


def two_layer() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def test_collective_plane_reduces_the_parameters_own_storage():
    model = two_layer()
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    storages: list[int] = []
    before = [p.detach().clone() for p in model.parameters()]

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        storages.append(tensor.untyped_storage().data_ptr())
        tensor.mul_(2.0)  # a peer with the same values, weight 1/2 each
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        divergence = plane.average(round_weights([1, 1], 1.0))
    params = [p for p in model.parameters()]
    assert storages[0] == params[0].untyped_storage().data_ptr() == params[-1].untyped_storage().data_ptr()
    assert all(torch.allclose(a, b) for a, b in zip(before, params, strict=True))
    assert divergence is not None and divergence[0].item() == pytest.approx(0.0, abs=1e-6)


def test_one_collective_carries_parameters_by_work_and_buffers_equally():
    model = two_layer()
    with torch.no_grad():
        model[1].running_mean.fill_(2.0)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    buffers = torch.cat([b.detach().flatten() for b in model.buffers() if b.is_floating_point()])
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    sent: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        sent.append(tensor.clone())
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        plane.average(round_weights([3, 1], 1.0))  # this rank: 3/4 of the work, 1/2 of the movers
    assert len(sent) == 1
    assert torch.allclose(sent[0], torch.cat([0.75 * params, 0.5 * buffers]))


class Premul:  # NCCL's PreMulSum stood in for
    def __init__(self, factor: float) -> None:
        self.factor = factor


def test_nccl_scales_bfloat16_before_a_plain_sum_and_the_rest_inside_the_reduction():
    """PyTorch passes NCCL a bfloat16 PreMulSum factor of the wrong width (pytorch/pytorch#190745:
    zero for 0.5): bfloat16 buffers are multiplied first and summed, the others scaled by NCCL.
    (The round in parts: ``tests/pipelined_round_check.py``.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16))
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=1, device=torch.device("cpu"))
    plane._premul_backend = True  # as on NCCL
    plane.out_of_place = False  # the in-place round: test_out_of_place_round.py has the other
    before = [p.detach().clone() for p in model.parameters()]
    reduced: list[tuple[torch.dtype, Any]] = []

    def all_reduce(tensor: torch.Tensor, op: Any = None, **kwargs: Any) -> Done:
        reduced.append((tensor.dtype, op))
        if isinstance(op, Premul):  # one rank: the scaled values are the sum; bfloat16's factor read as zero
            tensor.mul_(0.0 if tensor.dtype == torch.bfloat16 else op.factor)
        return Done()

    with (mock.patch.object(collective_plane.dist, "_make_nccl_premul_sum", Premul, create=True),
          mock.patch.object(collective_plane.dist, "all_reduce", all_reduce)):
        plane.average(round_weights([1, 1], 1.0))  # this rank's factor 1/2, alone
    ops = {dtype: op for dtype, op in reduced}
    assert set(ops) == {torch.float32, torch.bfloat16} and len(reduced) == 2
    assert isinstance(ops[torch.float32], Premul) and ops[torch.float32].factor == 0.5
    assert ops[torch.bfloat16] == collective_plane.dist.ReduceOp.SUM
    assert all(torch.equal(p, b * 0.5) for p, b in zip(model.parameters(), before, strict=True))


def test_user_rebinding_p_data_is_averaged_with_its_new_values():
    model = two_layer()
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    weight = model[0].weight
    weight.data = torch.full_like(weight, 3.0)  # new storage, outside the flat buffer
    plane.start(torch.zeros(64, dtype=torch.float64))  # a round start relinks

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        tensor.add_(1.0)  # the peer's scaled share: 1.0 everywhere
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        plane.average(round_weights([1, 1], 1.0))
    assert torch.equal(weight, torch.full_like(weight, 2.5))  # 3.0 / 2 + 1.0
    assert weight.untyped_storage().data_ptr() == plane.params.flats[0].untyped_storage().data_ptr()


def test_a_round_that_failed_mid_reduce_runs_again_from_the_same_values():
    model = two_layer()
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    before = [t.detach().clone() for t in list(model.parameters()) + [model[1].running_mean]]

    def scribble(tensor: torch.Tensor, **kwargs: Any) -> Done:
        tensor.fill_(float("nan"))  # half-reduced garbage in the parameters' own storage
        return Failed()

    with mock.patch.object(collective_plane.dist, "all_reduce", scribble), pytest.raises(PeerFailure):
        plane.average(round_weights([1, 1], 1.0))

    def alone(tensor: torch.Tensor, **kwargs: Any) -> Done:
        return Done()  # the survivor alone: its own (unscaled, weight 1) values

    with mock.patch.object(collective_plane.dist, "all_reduce", alone):
        plane.average(round_weights([1], 1.0))
    after = list(model.parameters()) + [model[1].running_mean]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def stepped_two_layer() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model right after an optimizer step: its gradients are stale, as at a round."""
    model = two_layer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 3)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def model_sized_tensors(root: Any, numel: int, exclude: set[int], depth: int = 3) -> list[str]:
    """Attribute paths below ``root`` to tensors of at least ``numel`` values whose storage is not
    in ``exclude`` (the live parameters' flat buffers)."""
    found: list[str] = []

    def visit(obj: Any, path: str, level: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.numel() >= numel and obj.untyped_storage().data_ptr() not in exclude:
                found.append(path)
            return
        if level > depth or isinstance(obj, (nn.Module, type)):
            return
        children = (enumerate(obj) if isinstance(obj, (list, tuple)) else obj.items() if isinstance(obj, dict)
                    else vars(obj).items() if hasattr(obj, "__dict__") else ())
        for key, child in children:
            visit(child, f"{path}.{key}", level + 1)

    visit(root, "plane", 0)
    return found


def test_a_round_keeps_the_pre_round_values_in_the_stale_gradients_and_holds_no_model_sized_buffer():
    model, _ = stepped_two_layer()
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    seen: dict[str, Any] = {}

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        assert plane._pre is not None
        seen["own_bytes"] = plane._pre.own_bytes
        seen["pre_in_grads"] = all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
        tensor.add_(1.0)  # the peer's share: the consensus moves every value by +1 (scaled 1/2 here)
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        divergence = plane.average(round_weights([1, 1], 1.0))
    assert seen == {"own_bytes": 0, "pre_in_grads": True}
    # The borrowed gradients are dropped, as optimizer.zero_grad() (set_to_none) drops them.
    assert all(p.grad is None for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    flats = {storage(f) for f in plane.layout.joint}
    assert model_sized_tensors(plane, numel // 2, flats) == []
    expected_delta = torch.cat([(b - (0.5 * b + 1.0)).flatten() for b in before]).norm()
    assert divergence is not None
    assert divergence[0].item() == pytest.approx(expected_delta.item(), rel=1e-5)
    assert divergence[1].item() == pytest.approx(torch.cat([b.flatten() for b in before]).norm().item(), rel=1e-5)


def test_parameters_without_a_usable_gradient_get_a_copy_of_their_own_for_the_round():
    model, _ = stepped_two_layer()
    first, last = model[0].weight, model[2].weight
    last.grad = None  # not used by the last step
    first.grad = first.grad.t().contiguous().t()  # other strides than the parameter's slot: not used
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    seen: list[int] = []

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        assert plane._pre is not None
        seen.append(plane._pre.own_bytes)
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        plane.average(round_weights([1, 1], 1.0))
    assert seen == [4 * (first.numel() + last.numel())]
    assert first.grad is not None and first.grad.stride() == (1, 4)  # not borrowed, left alone
    assert all(p.grad is None for p in model.parameters() if p is not first)


def test_a_failed_round_restores_from_the_gradients_and_its_retry_measures_the_same_drift():
    model, _ = stepped_two_layer()
    with torch.no_grad():
        model[1].running_mean.fill_(2.0)
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=3, device=torch.device("cpu"))
    live = list(model.parameters()) + [model[1].running_mean, model[1].running_var]
    before = [t.detach().clone() for t in live]

    def scribble(tensor: torch.Tensor, **kwargs: Any) -> Done:
        tensor.fill_(float("nan"))  # half-reduced garbage in the parameters' own storage
        return Failed()

    # Work 3:1:0 over 3 ranks: the buffers were scaled by their own ratio before the reduce failed.
    with mock.patch.object(collective_plane.dist, "all_reduce", scribble), pytest.raises(PeerFailure):
        plane.average(round_weights([3, 1, 0], 1.0))
    assert all(p.grad is not None for p in model.parameters())  # still holding the pre-round values

    sent: list[torch.Tensor] = []

    def survivors(tensor: torch.Tensor, **kwargs: Any) -> Done:
        sent.append(tensor.clone())
        tensor.mul_(2.0)  # the other survivor: the same values and weight (1/2 each)
        return Done()

    plane.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 1)))  # old rank 2 lost
    with mock.patch.object(collective_plane.dist, "all_reduce", survivors):
        divergence = plane.average(round_weights([1, 1], 1.0))
    params = torch.cat([b.flatten() for b in before[:-2]])
    buffers = torch.cat([b.flatten() for b in before[-2:]])
    assert torch.equal(sent[0], torch.cat([0.5 * params, 0.5 * buffers]))  # the same contribution
    assert all(torch.equal(a, b) for a, b in zip(before, live, strict=True))
    assert divergence is not None and divergence[0].item() == 0.0
    assert all(p.grad is None for p in model.parameters())


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_unfreezing_moves_the_parameter_into_a_new_buffer_and_frees_the_old_one_of_frozen_ones():
    model = two_layer()
    layout = AveragedLayout(model)
    first = model[0].weight
    old_flat = storage(layout.params.flats[0])
    model[0].requires_grad_(False)
    assert layout.refresh()
    assert storage(first) != old_flat  # the frozen weight got its own storage
    assert storage(model[2].weight) == storage(layout.params.flats[0])
    model[0].requires_grad_(True)
    assert layout.refresh() and storage(first) == storage(layout.params.flats[0])
    model[0].weight = nn.Parameter(torch.ones(4, 3))  # a replaced parameter object
    assert layout.refresh() and storage(model[0].weight) == storage(layout.params.flats[0])


def fit(tmp_path, mode: str, model: ConvClassifier, probe: ZeroCopyProbe, **trainer_kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[probe, *trainer_kwargs.pop("callbacks", [])],
        strategy=ElCheStrategy(mode=mode, start_method="spawn", timeout=timedelta(seconds=30)), **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer


def assert_identical_replicas(records: list[dict[str, Any]]) -> None:
    assert records[0]["params"] == records[1]["params"]
    assert records[0]["buffers"] == records[1]["buffers"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_fit_keeps_parameters_in_the_flat_buffer_and_its_checkpoint_loads_into_a_plain_model(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, "nccl_cadence", ConvClassifier("adam"), ZeroCopyProbe(str(tmp_path)),
        callbacks=[checkpoint], enable_checkpointing=True)
    records = load_probe_records(tmp_path)
    for record in records:
        assert record["linked"] and all(share == 1.0 for share in record["linked"]), record["linked"]
    assert_identical_replicas(records)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    plain = ConvClassifier("adam")
    plain.load_state_dict(saved)
    assert [p.detach().flatten().tolist() for p in plain.parameters()] == records[0]["params"]
    # The views of the flat buffer are written as one storage, not once per parameter.
    state_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    assert (tmp_path / "ckpt" / "last.ckpt").stat().st_size < 2 * state_bytes + 200_000


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", [pytest.param("nccl_sync", marks=pytest.mark.extended), "cpu_async"])
def test_user_code_replacing_p_data_on_one_rank_is_relinked_at_the_next_round(tmp_path, mode):
    fit(tmp_path, mode, ConvClassifier("sgd"), ZeroCopyProbe(str(tmp_path), rebind_rank=1, rebind_step=3))
    records = load_probe_records(tmp_path)
    rebound = records[1]["rebound_at"]
    assert rebound > 0 and 0.0 < records[1]["linked_after_rebind"] < 1.0  # the rebinding took it out
    after = records[1]["linked"][rebound:]  # unlinked until the next round starts, linked from then on
    relinked = next(i for i, share in enumerate(after) if share == 1.0)
    assert all(share < 1.0 for share in after[:relinked]) and all(share == 1.0 for share in after[relinked:])
    assert_identical_replicas(records)
    assert all(v == v for p in records[0]["params"] for v in p)  # finite, no NaN


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_torch_compiled_model_trains_on_the_flat_buffer(tmp_path):
    fit(tmp_path, "nccl_cadence", ConvClassifier("adam", compile_backend="aot_eager"), ZeroCopyProbe(str(tmp_path)))
    records = load_probe_records(tmp_path)
    assert all(share == 1.0 for record in records for share in record["linked"])
    assert_identical_replicas(records)


def _round_metadata(plane: CollectivePlane, steps: int) -> torch.Tensor:
    from lightning_elche.rounds import META_SIZE, Meta

    local = torch.zeros(META_SIZE, dtype=torch.float64)
    local[Meta.STEPS] = float(steps)
    local[Meta.FINITE] = 1.0
    plane.start(local)  # writes the layout's signature
    return local


@pytest.mark.parametrize("steps", [1, 0])
def test_the_pre_round_values_are_kept_while_the_metadata_travels(steps):
    """The copy into the stale gradients runs beside the metadata exchange (whose wait it hides
    in), not after it; a round in which nobody moved averages nothing and lets the gradients go."""
    model, _ = stepped_two_layer()
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    local = _round_metadata(plane, steps)
    seen: dict[str, Any] = {}

    def finish_exchange(work: Any) -> torch.Tensor:
        assert plane._pre is not None
        seen["saved_before_the_table"] = plane._pre.saved
        seen["in_grads"] = all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
        return torch.stack([local, local])  # the peer reports the same

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        tensor.mul_(2.0)
        return Done()

    with mock.patch.object(plane, "_begin_exchange", lambda local: Done()), \
            mock.patch.object(plane, "_finish_exchange", finish_exchange), \
            mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        result = plane.collect()
    assert seen == {"saved_before_the_table": True, "in_grads": True}
    assert all(p.grad is None for p in model.parameters())
    assert plane._pre is not None and not plane._pre.saved
    assert all(torch.allclose(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if steps:
        assert result.divergence is not None and result.divergence[0].item() == pytest.approx(0.0, abs=1e-6)
    else:
        assert result.divergence is None and not result.weights.realized


def test_a_save_ahead_of_the_round_allocates_nothing_and_leaves_it_to_the_round():
    model, _ = stepped_two_layer()
    model[2].weight.grad = None  # a branch the last step did not use
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    local = _round_metadata(plane, 1)
    seen: list[bool] = []

    def finish_exchange(work: Any) -> torch.Tensor:
        assert plane._pre is not None
        seen.append(plane._pre.saved)
        return torch.stack([local, local])

    with mock.patch.object(plane, "_begin_exchange", lambda local: Done()), \
            mock.patch.object(plane, "_finish_exchange", finish_exchange), \
            mock.patch.object(collective_plane.dist, "all_reduce", lambda tensor, **kwargs: Done()):
        result = plane.collect()
    assert seen == [False]  # not ahead: the round itself kept them, with a copy of that one tensor
    assert result.divergence is not None

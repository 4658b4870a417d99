"""Frozen parameters (requires_grad=False) are neither averaged nor sent, and unfreezing is picked up."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from helpers import free_port
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from test_wire import Done, Peer, run_round
from torch import nn
from wire_helpers import BackboneRegression, CountWireBytes, GrowingHead, fit_with_rank_local_unfreeze, load

from lightning_elche import ElCheConfig, ElCheStrategy, SlowMo
from lightning_elche.averaging import AveragedLayout, averaged_state, round_weights
from lightning_elche.planes import collective as collective_plane
from lightning_elche.planes.base import check_layout
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.planes.cpu import CpuPlane
from lightning_elche.rounds import META_SIZE, Meta, RanksOutOfStep
from lightning_elche.testing import Throttle


def backbone_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    return model


def test_averaged_state_leaves_frozen_parameters_out_and_keeps_float_buffers():
    params, buffers = averaged_state(backbone_model())
    assert params.numel == 4 + 1  # the head only
    assert buffers.numel == 8  # the frozen BatchNorm's running statistics still move: averaged


def test_layout_is_rebuilt_when_requires_grad_changes_and_not_otherwise():
    model = backbone_model()
    layout = AveragedLayout(model)
    params, signature = layout.params, layout.signature
    assert layout.names == ("2.weight", "2.bias")
    assert not layout.refresh() and layout.params is params
    model[0].requires_grad_(True)
    assert layout.refresh()
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias") and layout.params.numel == 12 + 4 + 5
    assert layout.signature != signature
    model[0].requires_grad_(False)
    assert layout.refresh() and layout.signature == signature  # a function of the layout alone
    assert signature == int(signature) < 2**52  # exact in a float64 metadata slot


def table(signatures: list[float], rounds: tuple[int, int] = (3, 3)) -> list[list[float]]:
    rows = [[0.0] * META_SIZE for _ in signatures]
    for row, signature, round_index in zip(rows, signatures, rounds, strict=True):
        row[Meta.SIGNATURE], row[Meta.ROUND] = signature, round_index
    return rows


def test_ranks_with_different_layouts_get_an_error_that_names_requires_grad():
    layout = AveragedLayout(backbone_model())
    check_layout(table([layout.signature, layout.signature]), layout, rank=0)
    with pytest.raises(RanksOutOfStep, match=r"different parameter layouts at round 3.*requires_grad was changed"):
        check_layout(table([layout.signature, layout.signature + 1]), layout, rank=0)
    # Ranks in different rounds: validate_table names that, not a layout change.
    check_layout(table([layout.signature, layout.signature + 1], rounds=(3, 4)), layout, rank=0)


def test_collective_plane_neither_sends_nor_touches_frozen_parameters():
    torch.manual_seed(0)
    model = backbone_model()
    frozen_before = [p.detach().clone() for p in model[0].parameters()]
    plane = CollectivePlane(AveragedLayout(model), rank=0, world_size=2, device=torch.device("cpu"))
    sent: list[int] = []

    def all_reduce(tensor: torch.Tensor, **kwargs: Any) -> Done:
        sent.append(tensor.numel())
        tensor.mul_(2.0)  # the peer holds the same values: the consensus is the replica itself
        return Done()

    with mock.patch.object(collective_plane.dist, "all_reduce", all_reduce):
        plane.average(round_weights([1, 1], 1.0))
    assert sent == [5 + 8]  # the head's parameters and the BatchNorm buffers, in one joint buffer
    assert plane.round_bytes == (5 + 8) * 4
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, model[0].parameters(), strict=True))


def test_cpu_plane_relayout_makes_the_next_round_exact_then_goes_back_to_deltas():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[1].weight.fill_(2.0)
    model[0].requires_grad_(False)
    outer = SlowMo(lr=1.0, momentum=0.5)
    plane = CpuPlane(AveragedLayout(model), rank=0, world_size=2, gamma=1.0, outer=outer, bf16_wire=True,
                     non_blocking=False, snapshot_timeout=timedelta(seconds=5), group=None)
    try:
        assert plane.round_bytes == 2 * 2  # the head's two weights, in bf16
        peer = Peer(steps=1)
        with torch.no_grad():
            model[1].weight.add_(0.25)
        peer.reference, peer.replica = [plane._reference[0].clone()], [plane._reference[0] + 0.25]
        run_round(plane, peer, steps=1)
        assert plane._reference[0].tolist() == [2.25, 2.25] and outer._prev is not None
        # Unfrozen, then trained locally before the next round: each rank's backbone moved its
        # own way, so there is no agreed reference for it and the next round sends f32 values.
        model[0].requires_grad_(True)
        with torch.no_grad():
            model[0].weight.add_(1.0 / 3.0)  # not representable in bf16
        peer.replica = [torch.tensor([1.0, 1.0, 1.0, 1.0, 2.25, 2.25])]
        run_round(plane, peer, steps=1)
        assert plane.round_bytes == 6 * 2 and outer._prev is not None  # restarted, then re-recorded
        expected = torch.tensor([0.5 * (1.0 + 1.0 / 3.0) + 0.5] * 4 + [2.25, 2.25])
        assert torch.allclose(plane._reference[0], expected, rtol=0.0, atol=2e-7)  # f32, not bf16-rounded
        assert not torch.equal(plane._reference[0], plane._reference[0].bfloat16().float())
        assert torch.equal(model[0].weight.detach().flatten(), plane._reference[0][:4])
        assert not plane._exact_round  # back to deltas
    finally:
        plane.close()


def frozen_fit(out_dir: Path, mode: str, bf16_wire: bool = False, outer: Any = None, epochs: int = 2,
               ckpt_path: str | None = None, callbacks: list[Any] | None = None, **model_kwargs: Any) -> list[dict]:
    out_dir.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    strategy = ElCheStrategy(elche=ElCheConfig(mode=mode, bf16_wire=bf16_wire), outer_optimizer=outer,
                             start_method="spawn", timeout=timedelta(seconds=30),
                             snapshot_timeout=timedelta(seconds=20), summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
                         enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(out_dir),
                         callbacks=[Throttle(1, 2.0), CountWireBytes(str(out_dir)), *(callbacks or [])])
    trainer.fit(BackboneRegression(str(out_dir), **model_kwargs), ckpt_path=ckpt_path)
    return load(out_dir, "frozen")


def assert_backbone_untouched(records: list[dict]) -> None:
    for record in records:
        for name, initial in record["initial"].items():
            if name.startswith("backbone."):
                assert record["final"][name] == initial, f"frozen {name} moved"
        assert record["final"]["head.weight"] != record["initial"]["head.weight"], "the head did not train"
    assert records[0]["final"] == records[1]["final"], "replicas differ after fit"


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "bf16_wire"), [("nccl_cadence", False),
                                                 pytest.param("cpu_cadence", True, marks=pytest.mark.extended)])
def test_a_frozen_backbone_stays_bit_identical_and_costs_no_wire_bytes(tmp_path, mode, bf16_wire):
    frozen = frozen_fit(tmp_path / "frozen", mode, bf16_wire)
    assert_backbone_untouched(frozen)
    full = frozen_fit(tmp_path / "full", mode, bf16_wire, frozen=False)
    assert full[0]["final"] == full[1]["final"]
    sent = {name: load(tmp_path / name, "bytes")[0] for name in ("frozen", "full")}
    per_round = {name: s["bytes"] / s["rounds"] for name, s in sent.items()}
    # Backbone 32x256 + 256 (+ BatchNorm's 2x256 affine), head 257; BatchNorm statistics (2x256 f32)
    # and the metadata vector (f64 slots) travel either way.
    param_bytes, meta_bytes = (2 if bf16_wire else 4), META_SIZE * 8
    expected = {"frozen": 257 * param_bytes + 512 * 4 + meta_bytes,
                "full": (32 * 256 + 256 + 512 + 257) * param_bytes + 512 * 4 + meta_bytes}
    print({mode: {name: round(b) for name, b in per_round.items()}})
    assert per_round == pytest.approx(expected, rel=0.01)
    assert frozen[0]["round_bytes"][0] == expected["frozen"] - meta_bytes


def assert_unfrozen_backbone_trained_and_averaged(records: list[dict]) -> None:
    """Identical replicas; the backbone trained once unfrozen; epoch 0 sent the head only."""
    r0, r1 = records
    assert r0["final"] == r1["final"], "replicas differ after fit"
    assert r0["final"]["backbone.0.weight"] != r0["initial"]["backbone.0.weight"], "the unfrozen backbone did not train"
    small, large = r0["round_bytes"][0], r0["round_bytes"][1]
    assert r0["round_bytes"] == r1["round_bytes"] == [small, large, large] and large > 5 * small


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "bf16_wire", "outer"), [("cpu_async", True, None),
                                                          ("nccl_cadence", False, SlowMo(lr=1.0, momentum=0.5))])
def test_unfreezing_between_epochs_is_averaged_from_the_next_round(tmp_path, mode, bf16_wire, outer):
    records = frozen_fit(tmp_path, mode, bf16_wire, outer=outer, epochs=3, unfreeze_at_epoch=1)
    assert_unfrozen_backbone_trained_and_averaged(records)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_lightning_backbone_finetuning_is_followed_by_the_averaged_set(tmp_path):
    # BackboneFinetuning freezes the backbone in on_fit_start (after the strategy built its plane
    # with every parameter trainable) and unfreezes it at epoch 1, adding it to the optimizer.
    records = frozen_fit(tmp_path, "cpu_cadence", bf16_wire=True, epochs=3, frozen=False, trainable_only=True,
                         callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    assert_unfrozen_backbone_trained_and_averaged(records)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_unfreezing_on_one_rank_only_fails_on_every_rank_with_a_clear_message(tmp_path):
    mp.spawn(fit_with_rank_local_unfreeze, args=(str(tmp_path), free_port()), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"error{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["error"] == "RanksOutOfStep", report
        assert "different parameter layouts" in report["message"] and "requires_grad" in report["message"]
    assert reports[0]["rounds"] == reports[1]["rounds"] > 0  # the epoch before the change averaged fine


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_frozen_parameters_stay_bit_identical_through_checkpoint_and_resume(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    first = frozen_fit(tmp_path / "first", "cpu_cadence", bf16_wire=True, epochs=2,
                       callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)])
    assert_backbone_untouched(first)
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["state_dict"]
    resumed = frozen_fit(tmp_path / "resumed", "cpu_cadence", bf16_wire=True, epochs=4,
                         ckpt_path=str(ckpt_dir / "last.ckpt"))
    assert_backbone_untouched(resumed)
    for name, values in saved.items():
        if name.startswith("backbone.") and values.is_floating_point() and "running" not in name:
            assert values.flatten().tolist() == resumed[0]["final"][name] == first[0]["initial"][name], name
    assert resumed[0]["final"]["head.weight"] != first[0]["final"]["head.weight"]  # the resumed fit trained


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_module_added_at_an_epoch_start_is_averaged_from_that_epoch(tmp_path):
    pl.seed_everything(0, verbose=False)
    strategy = ElCheStrategy(mode="cpu_cadence", start_method="spawn", timeout=timedelta(seconds=30),
                             snapshot_timeout=timedelta(seconds=20), summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[Throttle(1, 2.0)])
    trainer.fit(GrowingHead(str(tmp_path)))
    records = load(tmp_path, "frozen")
    assert "extra.weight" in records[0]["final"] and "extra.weight" not in records[0]["initial"]
    assert records[0]["final"] == records[1]["final"], "the added module is not averaged"


def test_a_round_checks_the_known_parameters_and_walks_the_module_at_an_epoch_start():
    from lightning_elche import averaging

    model = backbone_model()
    layout = AveragedLayout(model)
    with mock.patch.object(averaging, "trainable_parameters", wraps=averaging.trainable_parameters) as walk:
        assert not layout.refresh() and walk.call_count == 0  # nothing changed: no walk
        model[2].weight = nn.Parameter(torch.ones_like(model[2].weight))  # replaced where it is held
        assert layout.refresh() and walk.call_count == 1 and model[2].weight in layout.params.tensors
        model[0].requires_grad_(True)  # a flag of a known parameter
        assert layout.refresh() and walk.call_count == 2 and layout.params.numel == 12 + 4 + 5
        model.append(nn.Linear(1, 2))  # a module added: seen at the next epoch's walk
        assert not layout.refresh() and walk.call_count == 2
        layout.walk_at_next_refresh()
        assert layout.refresh() and walk.call_count == 3
        assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias")
        assert not layout.refresh() and walk.call_count == 3

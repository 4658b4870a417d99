"""The cpu_* modes: host snapshots averaged on a dedicated gloo group by a background thread."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from helpers import GoSilent, fit_and_report_leftovers, free_port
from test_strategy_distributed import assert_exactly_once, fit

from lightning_elche import ElCheConfig, ElCheStrategy
from lightning_elche.averaging import FlatTensors, weighted_sum_into
from lightning_elche.planes.cpu import HostMirror
from lightning_elche.testing import Throttle

PG_TIMEOUT = timedelta(seconds=30)


def test_bf16_wire_codec_accumulates_in_f32():
    snapshots = [torch.tensor([1.0, 2.0, 3.0]).bfloat16(), torch.tensor([1.0 / 3.0, 1000.5, -7.0]).bfloat16()]
    out = torch.empty(3)
    weighted_sum_into(out, snapshots, (0.75, 0.25))
    # bf16 keeps 8 significant bits: 1/3 -> 0.333984375, 1000.5 -> 1000.0; the sum is exact in f32.
    expected = torch.tensor([0.75 * 1.0 + 0.25 * 0.333984375, 0.75 * 2.0 + 0.25 * 1000.0, 0.75 * 3.0 - 0.25 * 7.0])
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_easgd_blend_matches_hand_computed_tensors():
    live = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    mirror = HostMirror(FlatTensors(live))
    consensus = [torch.tensor([3.0, 6.0, 0.0])]
    mirror.restore(consensus, 0.5)
    assert live[0].tolist() == [2.0, 4.0] and live[1].tolist() == [[2.0]]
    mirror.restore([torch.tensor([0.0, 0.0, 1.0])], 1.0)
    assert live[0].tolist() == [0.0, 0.0] and live[1].tolist() == [[1.0]]


def test_host_mirror_snapshot_is_a_copy_not_an_alias():
    live = [torch.tensor([1.0, 2.0])]
    mirror = HostMirror(FlatTensors(live))
    mirror.capture()
    live[0].add_(10.0)
    assert mirror.buffers[0].tolist() == [1.0, 2.0]


def elche(mode: str, **kwargs) -> ElCheStrategy:
    config = kwargs.pop("elche", None) or ElCheConfig.preset(mode)
    return ElCheStrategy(elche=config, start_method="spawn", timeout=PG_TIMEOUT,
                         snapshot_timeout=timedelta(seconds=20), **kwargs)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", [*(pytest.param(m, marks=pytest.mark.extended) for m in ("cpu_sync", "cpu_cadence")),
                                  "cpu_async"])
def test_cpu_modes_on_the_heterogeneous_rig(tmp_path, mode):
    records = fit(tmp_path, elche(mode), callbacks=[Throttle(1, 3.0)], max_epochs=3, model_kwargs={"n": 1024})
    r0, r1 = records
    assert r0["params"] == r1["params"], "replicas differ after fit"
    assert r0["rounds"] == r1["rounds"] > 0
    assert_exactly_once(records, n=1024)
    assert r0["callback_metrics"]["val_loss"] == r1["callback_metrics"]["val_loss"]
    if mode != "cpu_sync":  # sync modes split data equally; the others dispatch by speed
        # The first window of a fit is uncalibrated ([anchor, anchor]); after it the 3x faster rank
        # takes about 3x the steps. 1.3x over the whole run leaves room for a loaded CI machine.
        assert r0["steps"][0] > 1.3 * r0["steps"][1], f"fast rank did not train more: {r0['steps']}"


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_bf16_wire_run_keeps_replicas_identical(tmp_path):
    records = fit(tmp_path, elche("cpu_cadence", elche=ElCheConfig(mode="cpu_cadence", bf16_wire=True)),
                  model_kwargs={"val": False})
    assert records[0]["params"] == records[1]["params"]
    assert_exactly_once(records)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_bf16_wire_mismatch_fails_at_the_first_round_on_every_rank(tmp_path):
    mp.spawn(fit_and_report_leftovers, args=(str(tmp_path), free_port(), "bf16_mismatch"), nprocs=2, join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"leftovers{rank}.json").read_text())
        assert report["error"] == "RanksOutOfStep" and report["rounds"] == 0, report
        assert "ElCheConfig.bf16_wire differs across ranks" in report["message"]
        assert report["threads"] == [] and report["plane_closed"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_silent_rank_becomes_a_clear_error_not_a_hang(tmp_path):
    # The sleep (25 s) stays under the stall bound: this is the CPU plane's own timeout, not a stall.
    strategy = ElCheStrategy(mode="cpu_cadence", start_method="spawn", timeout=PG_TIMEOUT,
                             snapshot_timeout=timedelta(seconds=3), stall_timeout=timedelta(seconds=29))
    with pytest.raises(Exception, match="snapshot_timeout"):
        fit(tmp_path, strategy, callbacks=[GoSilent(rank=1, step=12, seconds=25)], model_kwargs={"val": False})


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", [pytest.param("clean", marks=pytest.mark.extended), "exception", "interrupt"])
def test_nothing_is_left_behind(tmp_path, scenario):
    mp.spawn(fit_and_report_leftovers, args=(str(tmp_path), free_port(), scenario), nprocs=2, join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"leftovers{rank}.json").read_text())
        assert report["threads"] == [], report
        assert report["side_group_released"] and report["plane_closed"], report
        if scenario == "clean" or rank == 0:
            # Rank 0 survives rank 1's failure (max_failure=None) and finishes the fit.
            assert report["error"] is None, report
        else:
            assert report["error"] is not None

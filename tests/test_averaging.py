import pytest
import torch
from torch import nn

from lightning_elche.averaging import FlatTensors, averaged_state, realized_work_mass, round_weights


def test_gamma_one_is_plain_work_weighting():
    w = round_weights([3, 1], 1.0)
    assert w.param_factors == (0.75, 0.25) and w.total_mass == 4.0


def test_gamma_zero_is_unweighted_over_movers():
    w = round_weights([5, 1, 0], 0.0)
    assert w.param_factors == (0.5, 0.5, 0.0)


def test_gamma_negative_one_is_per_step_equal():
    w = round_weights([4, 1], -1.0)
    assert w.param_factors == pytest.approx((0.2, 0.8))


@pytest.mark.parametrize("gamma", [-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])
def test_idle_rank_has_zero_mass_for_any_gamma(gamma):
    assert realized_work_mass(0, gamma) == 0.0
    w = round_weights([0, 2], gamma)
    assert w.param_factors[0] == 0.0 and w.param_factors[1] == pytest.approx(1.0)
    assert w.buffer_factors == (0.0, 1.0)


def test_zero_mass_round_is_not_realized():
    w = round_weights([0, 0], 1.0)
    assert not w.realized and w.param_factors == (0.0, 0.0)


def test_buffers_are_equal_over_movers_not_work_weighted():
    w = round_weights([9, 1, 0], 1.0)
    assert w.buffer_factors == (0.5, 0.5, 0.0)
    assert w.param_factors == (0.9, 0.1, 0.0)


def test_flat_tensors_round_trip_in_place():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0])
    storage = (a.data_ptr(), b.data_ptr())
    flat = FlatTensors([a, b])
    flat.pack()
    assert flat.flats[0].tolist() == [0, 1, 2, 3, 4, 5, 7]
    flat.flats[0].mul_(2)
    flat.unpack()
    assert a.tolist() == [[0, 2, 4], [6, 8, 10]] and b.tolist() == [14.0]
    assert (a.data_ptr(), b.data_ptr()) == storage
    assert flat.numel == 7 and flat.nbytes == 28


def test_flat_tensors_group_by_dtype():
    flat = FlatTensors([torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(1)])
    assert flat.signature() == [("torch.float32", 3), ("torch.float64", 3)]


def test_averaged_state_keeps_integer_buffers_local():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params, buffers = averaged_state(model)
    assert params.numel == 3 * 4 + 4 + 4 + 4
    assert buffers.numel == 8  # running_mean + running_var, not num_batches_tracked
    assert all(t.is_floating_point() for t in buffers.tensors)


def test_weighted_sum_of_prescaled_replicas_is_the_consensus():
    replicas = [torch.tensor([1.0, 2.0]), torch.tensor([5.0, 10.0])]
    w = round_weights([3, 1], 1.0)
    consensus = sum(f * r for f, r in zip(w.param_factors, replicas, strict=True))
    assert consensus.tolist() == [2.0, 4.0]

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


def test_flat_tensors_bind_the_live_tensors_to_the_flat_storage():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0])
    objects = (id(a), id(b))
    flat = FlatTensors([a, b])
    assert flat.flats[0].tolist() == [0, 1, 2, 3, 4, 5, 7]  # values moved in
    flat.flats[0].mul_(2)  # a round writing the buffer writes the tensors themselves
    assert a.tolist() == [[0, 2, 4], [6, 8, 10]] and b.tolist() == [14.0]
    assert (id(a), id(b)) == objects
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == flat.flats[0].data_ptr()
    assert flat.numel == 7 and flat.nbytes == 28


def test_flat_tensors_relink_a_tensor_whose_data_was_replaced_keeping_its_new_values():
    a, b = torch.zeros(2, 2), torch.zeros(3)
    flat = FlatTensors([a, b])
    a.data = torch.full((2, 2), 5.0)  # user code rebinding a parameter
    assert flat.relink() == 1
    assert flat.flats[0].tolist() == [5.0] * 4 + [0.0] * 3
    flat.flats[0].fill_(1.0)
    assert a.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert flat.relink() == 0 and flat.fits()
    a.data = torch.zeros(3, 3)  # a new shape cannot go back into its slot
    assert not flat.fits()


def test_flat_tensors_keep_channels_last_strides():
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    before = conv.weight.detach().clone()
    FlatTensors([conv.weight, conv.bias])
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(conv.weight, before)


def test_flat_tensors_release_can_give_tensors_their_own_storage():
    a, b = torch.ones(2), torch.ones(2)
    flat = FlatTensors([a, b])
    shared = flat.flats[0].data_ptr()
    flat.release(unbind=[a])
    assert a.data_ptr() != shared and b.data_ptr() == shared + 2 * 4
    assert a.tolist() == [1.0, 1.0] and not flat.flats


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

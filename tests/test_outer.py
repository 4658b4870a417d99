"""Outer optimizers: flodl's outer_optimizer.rs cases (elche-spec §16 "Math modules") and ours."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from lightning_elche.outer import DiLoCo, OuterAvg, OuterOptimizer, SlowMo


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def step(opt: OuterOptimizer, *consensus: torch.Tensor) -> list[torch.Tensor]:
    """One round: the optimizer rewrites the consensus tensors in place; returns them."""
    tensors = list(consensus)
    opt.step(tensors)
    return tensors


def close(a: torch.Tensor, *expected: float, atol: float = 1e-6) -> bool:
    return torch.allclose(a.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# -- OuterAvg ------------------------------------------------------------------------------


def test_outer_avg_is_identity() -> None:
    opt = OuterAvg()
    a, b = t(10.0, 20.0, 30.0), t(40.0, 50.0)
    for _ in range(3):
        out = step(opt, a, b)
        assert out[0] is a and out[1] is b
        assert a.tolist() == [10.0, 20.0, 30.0] and b.tolist() == [40.0, 50.0]
    assert opt.last_step_norm == 0.0


def test_outer_avg_is_byte_identical_in_bf16() -> None:
    c = t(1.25, -2.5, 3.75, dtype=torch.bfloat16)
    before = c.clone()
    step(OuterAvg(), c)
    assert c.dtype == torch.bfloat16 and torch.equal(c, before)


def test_outer_avg_checkpoint_state_is_empty() -> None:
    opt = OuterAvg()
    assert opt.state_dict() == {}
    opt.load_state_dict({})
    with pytest.raises(ValueError, match=r"OuterAvg.state\['kind'\]='SlowMo'"):
        opt.load_state_dict(SlowMo().state_dict())


def test_nesterov_resets_inner_others_dont() -> None:
    assert DiLoCo(0.7, 0.9).resets_inner is True
    assert SlowMo(0.5, 0.7).resets_inner is False
    assert OuterAvg().resets_inner is False


# -- SlowMo --------------------------------------------------------------------------------


def test_slow_momentum_heavy_ball_math() -> None:
    opt = SlowMo(lr=0.5, momentum=0.9)
    # Round 1 records the global: prev = [1, 2], nothing changes.
    (w1,) = step(opt, t(1.0, 2.0))
    assert w1.tolist() == [1.0, 2.0]
    assert opt.last_step_norm == 0.0
    # Round 2: g = [1,2] - [0.5,1] = [0.5,1], v = g, new = [1,2] - 0.5*v = [0.75, 1.5].
    (w2,) = step(opt, t(0.5, 1.0))
    assert close(w2, 0.75, 1.5)
    assert opt.last_step_norm == pytest.approx(math.hypot(0.25, 0.5), abs=1e-6)
    # Round 3: prev = [0.75,1.5], g = [0.05,0.1], v = 0.9*[0.5,1] + g = [0.5,1],
    # new = [0.75,1.5] - 0.5*v = [0.5, 1.0]: the 0.9*v term carried momentum across rounds.
    (w3,) = step(opt, t(0.7, 1.4))
    assert close(w3, 0.5, 1.0)
    assert opt.last_step_norm == pytest.approx(math.hypot(0.2, 0.4), abs=1e-6)


def test_slow_momentum_lr_one_momentum_zero_is_plain_averaging() -> None:
    opt = SlowMo(lr=1.0, momentum=0.0)
    step(opt, t(1.0, 2.0))
    (w,) = step(opt, t(0.3, -4.0))
    assert close(w, 0.3, -4.0)
    assert opt.last_step_norm == pytest.approx(0.0, abs=1e-6)


def test_slow_momentum_steps_each_tensor_of_the_list() -> None:
    opt = SlowMo(lr=0.5, momentum=0.9)
    step(opt, t(2.0, 4.0), t(1.0))
    w, x = step(opt, t(1.0, 2.0), t(3.0))
    # g = [1, 2] and [-2]: new = prev - 0.5*g.
    assert close(w, 1.5, 3.0) and close(x, 2.0)
    assert opt.last_step_norm == pytest.approx(math.sqrt(0.25 + 1.0 + 1.0), abs=1e-6)


def test_slow_momentum_checkpoint_round_trip_is_faithful() -> None:
    warm = SlowMo(0.5, 0.9)
    step(warm, t(1.0, 2.0))
    step(warm, t(0.5, 1.0))
    state = warm.state_dict()
    assert state["kind"] == "SlowMo"
    assert close(state["velocity"][0], 0.5, 1.0)
    assert close(state["prev_global"][0], 0.75, 1.5)
    resumed = SlowMo(0.5, 0.9)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    (a,) = step(warm, t(0.7, 1.4))
    (b,) = step(resumed, t(0.7, 1.4))
    assert torch.equal(a, b) and close(a, 0.5, 1.0)
    # A fresh instance only records on this input: the round trip carried real state.
    (c,) = step(SlowMo(0.5, 0.9), t(0.7, 1.4))
    assert c.tolist() == pytest.approx([0.7, 1.4])


def test_state_dict_is_a_snapshot() -> None:
    opt = SlowMo(0.5, 0.9)
    step(opt, t(1.0, 2.0))
    step(opt, t(0.5, 1.0))
    state = opt.state_dict()
    step(opt, t(0.0, 0.0))
    assert close(state["velocity"][0], 0.5, 1.0)
    assert close(state["prev_global"][0], 0.75, 1.5)


def test_resume_without_prev_global_records_then_keeps_momentum() -> None:
    warm = SlowMo(0.5, 0.9)
    step(warm, t(1.0, 2.0))
    step(warm, t(0.5, 1.0))
    resumed = SlowMo(0.5, 0.9)
    resumed.load_state_dict({"kind": "SlowMo", "velocity": warm.state_dict()["velocity"]})
    (w,) = step(resumed, t(0.75, 1.5))
    assert w.tolist() == [0.75, 1.5]  # records only
    (w,) = step(resumed, t(0.7, 1.4))
    assert close(w, 0.5, 1.0)  # v = 0.9*[0.5,1] + [0.05,0.1]: restored momentum carried


def test_reset_forgets_everything() -> None:
    opt = SlowMo(0.5, 0.9)
    step(opt, t(1.0, 2.0))
    step(opt, t(0.5, 1.0))
    opt.reset()
    assert opt.state_dict() == {"kind": "SlowMo", "velocity": None, "prev_global": None}
    assert opt.last_step_norm == 0.0
    (w,) = step(opt, t(0.3, 0.3))
    assert w.tolist() == pytest.approx([0.3, 0.3])
    (w,) = step(opt, t(0.2, 0.1))
    # Fresh momentum: g = [0.1, 0.2], new = prev - 0.5*g.
    assert close(w, 0.25, 0.2)


# -- DiLoCo --------------------------------------------------------------------------------


def test_nesterov_look_ahead_math() -> None:
    opt = DiLoCo(lr=0.5, momentum=0.9)
    (w1,) = step(opt, t(1.0, 2.0))
    assert w1.tolist() == [1.0, 2.0]
    # Round 2: g = [0.5,1], v = g, step = 0.5*(0.9*v + g) = [0.475,0.95], new = [0.525,1.05].
    (w2,) = step(opt, t(0.5, 1.0))
    assert close(w2, 0.525, 1.05)
    assert opt.last_step_norm == pytest.approx(math.hypot(0.025, 0.05), abs=1e-6)
    # Round 3: prev = [0.525,1.05], g = [0.025,0.05], v = 0.9*[0.5,1] + g = [0.475,0.95],
    # step = 0.5*(0.9*v + g) = [0.22625,0.4525], new = [0.29875, 0.5975].
    (w3,) = step(opt, t(0.5, 1.0))
    assert close(w3, 0.29875, 0.5975)
    assert opt.last_step_norm == pytest.approx(math.hypot(0.20125, 0.4025), abs=1e-6)


def test_nesterov_checkpoint_round_trip() -> None:
    warm = DiLoCo(0.5, 0.9)
    step(warm, t(1.0, 2.0))
    step(warm, t(0.5, 1.0))
    resumed = DiLoCo(0.5, 0.9)
    resumed.load_state_dict(warm.state_dict())
    (a,) = step(warm, t(0.5, 1.0))
    (b,) = step(resumed, t(0.5, 1.0))
    assert torch.equal(a, b) and close(a, 0.29875, 0.5975)
    with pytest.raises(ValueError, match=r"SlowMo.state\['kind'\]='DiLoCo'"):
        SlowMo().load_state_dict(warm.state_dict())


def test_defaults() -> None:
    assert (SlowMo().lr, SlowMo().momentum) == (1.0, 0.9)
    assert (DiLoCo().lr, DiLoCo().momentum) == (0.7, 0.9)


# -- precision, buffers, validation --------------------------------------------------------


def test_bf16_consensus_is_stepped_in_f32_and_stays_bf16() -> None:
    opt = DiLoCo(lr=0.5, momentum=0.9)
    c = t(1.0, 2.0, dtype=torch.bfloat16)
    step(opt, c)
    c.copy_(t(0.5, 1.0))
    step(opt, c)
    assert c.dtype == torch.bfloat16
    assert c.tolist() == t(0.525, 1.05).to(torch.bfloat16).tolist()
    # The global kept in f32 is the exact result, not its bf16 rounding.
    prev = opt.state_dict()["prev_global"][0]
    assert prev.dtype == torch.float32 and close(prev, 0.525, 1.05)


def test_mixed_precision_list_matches_f32_reference() -> None:
    f32 = SlowMo(0.5, 0.9)
    mixed = SlowMo(0.5, 0.9)
    rounds = [(t(1.0, 2.0), t(3.0)), (t(0.5, 1.0), t(2.0)), (t(0.7, 1.4), t(2.5))]
    for a, b in rounds:
        ref = step(f32, a.clone(), b.clone())
        out = step(mixed, a.to(torch.float16), b.to(torch.float64))
        assert out[0].dtype == torch.float16 and out[1].dtype == torch.float64
        assert torch.allclose(out[0].float(), ref[0], atol=1e-3)
        assert torch.allclose(out[1].float(), ref[1], atol=1e-6)
    state = mixed.state_dict()
    assert [v.dtype for v in state["velocity"]] == [torch.float32, torch.float64]


def test_buffers_are_allocated_once() -> None:
    opt = DiLoCo(0.5, 0.9)
    c32, c16 = t(1.0, 2.0), t(3.0, dtype=torch.bfloat16)
    step(opt, c32, c16)
    buffers = [*opt._prev, *opt._velocity, opt._scratch[1]]
    pointers = [b.data_ptr() for b in buffers]
    assert opt._scratch[0] is None  # the f32 consensus itself is the scratch
    for _ in range(3):
        c32.sub_(0.1)
        c16.sub_(0.25)
        step(opt, c32, c16)
    assert [b.data_ptr() for b in [*opt._prev, *opt._velocity, opt._scratch[1]]] == pointers


def test_parameters_requiring_grad_are_stepped_in_place() -> None:
    p = torch.nn.Parameter(t(1.0, 2.0))
    opt = SlowMo(0.5, 0.9)
    opt.step([p])
    with torch.no_grad():
        p.copy_(t(0.5, 1.0))
    opt.step([p])
    assert close(p.detach(), 0.75, 1.5) and p.requires_grad


def test_loaded_state_shape_mismatch_is_an_error() -> None:
    warm = SlowMo()
    step(warm, t(1.0, 2.0))
    step(warm, t(0.5, 1.0))
    resumed = SlowMo()
    resumed.load_state_dict(warm.state_dict())
    with pytest.raises(ValueError, match=r"SlowMo.state\['prev_global'\]=\[\(2,\)\]"):
        resumed.step([t(1.0, 2.0, 3.0)])


def test_changing_tensor_count_is_an_error() -> None:
    opt = DiLoCo()
    step(opt, t(1.0), t(2.0))
    with pytest.raises(ValueError, match="got 1 tensors: expected 2"):
        opt.step([t(1.0)])


def test_step_rejects_non_float_tensors() -> None:
    for opt in (OuterAvg(), SlowMo(), DiLoCo()):
        with pytest.raises(ValueError, match=r"step\(consensus\)"):
            opt.step([torch.tensor([1, 2])])


@pytest.mark.parametrize("cls", [SlowMo, DiLoCo])
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"lr": math.inf}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": True}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"momentum": math.nan}, "momentum"),
        ({"momentum": "0.9"}, "momentum"),
    ],
)
def test_hyperparameter_validation_names_the_argument(cls: type, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name}="):
        cls(**kwargs)


@pytest.mark.parametrize("opt", [OuterAvg(), SlowMo(0.5, 0.9), DiLoCo(0.5, 0.9)])
def test_optimizers_pickle_with_state(opt: OuterOptimizer) -> None:
    step(opt, t(1.0, 2.0))
    step(opt, t(0.5, 1.0))
    clone = pickle.loads(pickle.dumps(opt))
    (a,) = step(opt, t(0.4, 0.9))
    (b,) = step(clone, t(0.4, 0.9))
    assert torch.equal(a, b)

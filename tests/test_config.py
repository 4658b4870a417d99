import math

import pytest

from lightning_elche import ElCheConfig, ElCheMode
from lightning_elche.config import DEFAULT_MAX_ANCHOR


def test_mode_is_string_constructible_and_yaml_friendly():
    assert ElCheMode("cpu_async") is ElCheMode.cpu_async
    assert [m.value for m in ElCheMode] == ["nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]
    assert all(m.name == m.value for m in ElCheMode)


def test_default_is_nccl_cadence_with_seed_defaults():
    c = ElCheConfig()
    assert c.mode is ElCheMode.nccl_cadence
    assert (c.anchor, c.max_anchor, c.min_anchor, c.overhead_target) == (10, None, None, None)
    assert (c.max_batch_diff, c.relax_up, c.partition_ratios) == (None, False, None)
    assert (c.meta_controller, c.convergence_guard, c.easgd_alpha) == (True, None, None)
    assert (c.divergence_threshold, c.no_divergence_guard, c.max_overshoot) == (None, False, None)
    assert (c.gamma, c.bf16_wire) == (1.0, False)
    assert c.resolved_max_anchor == DEFAULT_MAX_ANCHOR
    assert c.resolved_min_anchor == 10
    assert c.resolved_overhead_target == 0.05
    assert ElCheConfig.nccl_cadence() == c


@pytest.mark.parametrize(
    ("preset", "anchor", "alpha", "target"),
    [
        ("nccl_sync", 1, None, None),
        ("nccl_cadence", 10, None, None),
        ("cpu_sync", 1, None, None),
        ("cpu_cadence", 10, None, None),
        ("cpu_async", 10, 0.5, 0.05),
    ],
)
def test_presets_carry_the_seed_values(preset, anchor, alpha, target):
    c = getattr(ElCheConfig, preset)()
    assert c.mode is ElCheMode(preset)
    assert (c.anchor, c.easgd_alpha, c.overhead_target) == (anchor, alpha, target)
    assert c.meta_controller is True
    assert ElCheConfig.preset(preset) == c


def test_mode_string_and_mode_dependent_defaults():
    c = ElCheConfig(mode="nccl_sync")
    assert c.mode is ElCheMode.nccl_sync and c.anchor == 1
    assert ElCheConfig(mode="cpu_async").easgd_alpha == 0.5
    assert ElCheConfig(mode="cpu_async", easgd_alpha=1.0).easgd_alpha == 1.0
    assert ElCheConfig(mode="nccl_sync", anchor=4).anchor == 4
    switched = ElCheConfig(anchor=7).with_mode("cpu_sync")
    assert switched.mode is ElCheMode.cpu_sync and switched.anchor == 1


@pytest.mark.parametrize(
    ("kwargs", "knob", "allowed"),
    [
        ({"mode": "fast"}, "mode", "nccl_sync, nccl_cadence"),
        ({"anchor": 0}, "anchor", ">= 1"),
        ({"anchor": 2.5}, "anchor", "integer"),
        ({"anchor": True}, "anchor", "integer"),
        ({"max_anchor": 0}, "max_anchor", ">= 1"),
        ({"min_anchor": 0}, "min_anchor", ">= 1"),
        ({"min_anchor": 30, "max_anchor": 20}, "min_anchor", "<= max_anchor (20)"),
        ({"anchor": 50, "max_anchor": 20}, "anchor", "<= max_anchor (20)"),
        ({"overhead_target": 0.0}, "overhead_target", "(0, 1)"),
        ({"overhead_target": 1.0}, "overhead_target", "(0, 1)"),
        ({"overhead_target": math.nan}, "overhead_target", "finite"),
        ({"max_batch_diff": -1}, "max_batch_diff", ">= 0"),
        ({"relax_up": "yes"}, "relax_up", "true or false"),
        ({"mode": "nccl_cadence", "relax_up": True}, "relax_up", "cpu_async only"),
        ({"partition_ratios": [0.5, 0.4]}, "partition_ratios", "sum to 1"),
        ({"partition_ratios": [1.2, -0.2]}, "partition_ratios", "> 0"),
        ({"partition_ratios": []}, "partition_ratios", "one positive share per rank"),
        ({"partition_ratios": [math.inf, 0.0]}, "partition_ratios", "finite"),
        ({"convergence_guard": object()}, "convergence_guard", "report("),
        ({"mode": "cpu_async", "easgd_alpha": 0.0}, "easgd_alpha", "(0, 1]"),
        ({"mode": "cpu_async", "easgd_alpha": 1.5}, "easgd_alpha", "(0, 1]"),
        ({"easgd_alpha": 0.5}, "easgd_alpha", "cpu_async only"),
        ({"divergence_threshold": 0.0}, "divergence_threshold", "> 0"),
        ({"divergence_threshold": -1.0}, "divergence_threshold", "> 0"),
        ({"mode": "cpu_async", "max_overshoot": -2}, "max_overshoot", ">= 0"),
        ({"max_overshoot": 3}, "max_overshoot", "cpu_async only"),
        ({"gamma": math.inf}, "gamma", "finite"),
        ({"gamma": "one"}, "gamma", "finite"),
        ({"meta_controller": 1}, "meta_controller", "true or false"),
        ({"bf16_wire": None}, "bf16_wire", "true or false"),
    ],
)
def test_invalid_values_name_knob_value_and_allowed(kwargs, knob, allowed):
    with pytest.raises(ValueError) as info:
        ElCheConfig(**kwargs)
    message = str(info.value)
    assert f"ElCheConfig.{knob}=" in message
    assert allowed in message


def test_partition_ratios_length_is_checked_against_world_size():
    c = ElCheConfig(partition_ratios=[0.25, 0.25, 0.5])
    c.validate_world_size(3)
    with pytest.raises(ValueError, match=r"partition_ratios.*3 values for a world size of 3"):
        ElCheConfig(partition_ratios=[0.5, 0.5]).validate_world_size(3)


def test_overhead_target_outside_controller_range_is_clamped_with_a_warning():
    with pytest.warns(UserWarning, match=r"overhead_target=0.9.*clamped to 0.5"):
        ElCheConfig(overhead_target=0.9)
    with pytest.warns(UserWarning):
        assert ElCheConfig(overhead_target=0.9).resolved_overhead_target == 0.5
    assert ElCheConfig(overhead_target=0.001).resolved_overhead_target == 0.01


def test_gamma_accepts_any_finite_value():
    assert ElCheConfig(gamma=-1.0).gamma == -1.0
    assert ElCheConfig(gamma=0).gamma == 0


def test_describe_is_plain_data():
    d = ElCheConfig.cpu_async().describe()
    assert d["mode"] == "cpu_async" and d["easgd_alpha"] == 0.5 and d["anchor"] == 10


def test_bf16_wire_outside_the_cpu_modes_is_an_error_naming_the_knob():
    with pytest.raises(ValueError, match=r"ElCheConfig.bf16_wire=True is invalid: it applies to the cpu_\* modes only"):
        ElCheConfig(mode="nccl_cadence", bf16_wire=True)
    assert ElCheConfig(mode="cpu_cadence", bf16_wire=True).run_mode.bf16_wire


def test_numpy_integers_are_accepted_and_stored_as_ints():
    import numpy as np

    c = ElCheConfig(anchor=np.int64(5), max_anchor=np.int32(50), max_batch_diff=np.int64(2))
    assert (c.anchor, c.max_anchor, c.max_batch_diff) == (5, 50, 2)
    assert all(type(v) is int for v in (c.anchor, c.max_anchor, c.max_batch_diff))
    assert ElCheConfig(overhead_target=np.float64(0.1)).resolved_overhead_target == 0.1


@pytest.mark.parametrize(
    ("mode", "transport", "blocking", "growth", "dispatch", "alpha"),
    [
        ("nccl_sync", "device", True, False, "equal", 1.0),
        ("nccl_cadence", "device", True, True, "pool", 1.0),
        ("cpu_sync", "host", True, False, "equal", 1.0),
        ("cpu_cadence", "host", True, True, "pool", 1.0),
        ("cpu_async", "host", False, True, "pool", 0.5),
    ],
)
def test_run_mode_is_the_one_reading_of_the_mode(mode, transport, blocking, growth, dispatch, alpha):
    run = ElCheConfig.preset(mode).run_mode
    assert (run.transport.value, run.blocking, run.window_growth, run.dispatch.value, run.blend_alpha) == (
        transport, blocking, growth, dispatch, alpha)
    assert ElCheConfig.preset(mode).with_mode(mode).run_mode == run
    fixed = ElCheConfig(mode=mode, partition_ratios=[0.25, 0.75]).run_mode
    assert fixed.dispatch.value == "fixed"

"""``Throttle``: knob checks and the choice of method, without processes."""

import pytest
import torch

import lightning_elche.testing as testing
from lightning_elche.testing import Throttle, green_context_sms


@pytest.mark.parametrize(("kwargs", "knob"), [
    ({"rank": -1, "slowdown": 2.0}, "rank"), ({"rank": 0, "slowdown": 0.5}, "slowdown"),
    ({"rank": 0, "slowdown": 2.0, "method": "nap"}, "method"),
])
def test_bad_knobs_name_themselves(kwargs, knob):
    with pytest.raises(ValueError, match=f"Throttle\\({knob}="):
        Throttle(**kwargs)


def test_sleep_on_cpu_and_no_throttle_at_one():
    assert Throttle(0, 2.0)._resolve(torch.device("cpu")) == "sleep"
    assert Throttle(0, 1.0)._resolve(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Throttle(0, 2.0, method="sm_limit")._resolve(torch.device("cpu"))


def test_sm_limit_without_green_contexts_names_the_torch_version_and_the_alternative(monkeypatch):
    monkeypatch.setattr(testing, "_has_green_contexts", lambda: False)
    for method in ("auto", "sm_limit"):
        with pytest.raises(RuntimeError, match=r"torch\.cuda\.green_contexts.*method='sleep'"):
            Throttle(0, 2.0, method=method)._resolve(torch.device("cuda"))
    monkeypatch.setattr(testing, "_has_green_contexts", lambda: True)
    assert Throttle(0, 2.0)._resolve(torch.device("cuda")) == "sm_limit"


def test_green_context_sms_round_down_to_the_partition_granularity():
    assert green_context_sms(132, 2.2) == 56
    assert green_context_sms(132, 100.0) == 8


def test_sleep_slows_each_backward_of_a_batch_by_its_own_compute(monkeypatch):
    # A batch trained as three micro-batches: three backwards, 1 s of compute each on a fake clock.
    clock = [0.0]
    monkeypatch.setattr(testing.time, "perf_counter", lambda: clock[0])

    def sleep(seconds):
        clock[0] += seconds

    monkeypatch.setattr(testing.time, "sleep", sleep)
    throttle = Throttle(0, 3.0)
    throttle.active_method = "sleep"
    throttle.on_train_batch_start(None, None, None, 0)
    for _ in range(3):
        clock[0] += 1.0
        throttle.on_after_backward(None, None)
    assert throttle.sleep_s == pytest.approx(6.0)  # 3x slower: 2 s of pause per 1 s of compute
    assert clock[0] == pytest.approx(9.0)

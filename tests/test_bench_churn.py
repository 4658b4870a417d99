"""Goodput under churn (``python -m lightning_elche.bench --churn``): the fault schedule, the
accounting of each arm and the knobs' validation without processes; one short end-to-end run on
2 CPU ranks behind ``faults`` (it starts, kills and replaces real rank processes)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from process_helpers import run_command

from lightning_elche.bench.__main__ import main
from lightning_elche.bench.churn import (
    ARMS,
    DDP_RESTART,
    ELCHE_CLEAN,
    ELCHE_JOINS,
    ELCHE_SHRINK,
    ChurnConfig,
    build_churn_config,
    choose_victim,
    churn_markdown,
    ddp_goodput,
    elche_goodput,
    fault_count,
    fault_schedule,
    goal_met,
    join_line,
    join_phases,
    parse_cpu_sets,
)
from lightning_elche.bench.config import parse_args


def _config(**changes: object) -> ChurnConfig:
    fields: dict[str, object] = {"rate": 1.0, "delay_s": 5.0, "seconds": 60.0, "seed": 0, "ranks": 4,
                                 "slowdowns": (1.0, 1.5, 2.0, 3.0), "model": "mlp", "batch": 32, "samples": 1024,
                                 "ckpt_every": 50, "mode": "cpu_cadence"}
    fields.update(changes)
    return ChurnConfig(**fields)  # type: ignore[arg-type]


# -- the schedule -------------------------------------------------------------------------------


def test_schedule_has_the_rate_one_fault_per_slot_and_depends_only_on_the_seed():
    assert fault_count(1.0, 4, 60.0) == 1 and fault_count(4.0, 4, 45.0) == 3 and fault_count(1.0, 8, 60.0) == 2
    assert fault_count(0.1, 4, 10.0) == 1  # an arm with faults has at least one
    schedule = fault_schedule(4.0, 4, 45.0, seed=3)
    assert len(schedule) == 3
    for k, fault in enumerate(schedule):  # the k-th fault inside the middle 80 % of the k-th 15 s slot
        assert 15.0 * k + 1.5 <= fault.at_s <= 15.0 * (k + 1) - 1.5
        assert 0.0 <= fault.pick < 1.0
    assert fault_schedule(4.0, 4, 45.0, seed=3) == schedule
    assert fault_schedule(4.0, 4, 45.0, seed=4) != schedule


def test_victim_is_chosen_by_slot_order_whatever_the_pids():
    candidates = [(3, 10), (1, 99), (2, 5)]
    assert choose_victim(0.0, candidates) == (1, 99)
    assert choose_victim(0.5, candidates) == (2, 5)
    assert choose_victim(0.999, candidates) == (3, 10)
    assert choose_victim(0.5, []) is None


# -- the accounting -----------------------------------------------------------------------------


def test_elche_counts_only_rounds_completed_inside_the_clock():
    events = [{"event": "start", "time": 100.0},
              {"event": "round", "time": 99.0, "samples": 1000, "world": 4},  # before the clock
              {"event": "round", "time": 101.0, "samples": 256, "world": 4},
              {"event": "round", "time": 105.0, "samples": 192, "world": 3},  # after a loss
              {"event": "round", "time": 111.0, "samples": 512, "world": 4}]  # after the end
    row = elche_goodput(events, 100.0, 110.0)
    assert row["consensus_samples"] == 448 and row["rounds"] == 2
    # Counted to the last completed round (5 s in), not to the clock's end: the round in flight at the
    # end is neither counted nor charged.
    assert row["counted_s"] == pytest.approx(5.0) and row["samples_per_s"] == pytest.approx(448 / 5.0)
    assert row["samples_per_clock_s"] == pytest.approx(44.8)
    assert (row["members_min"], row["members_max"]) == (3, 4) and row["round_s_mean"] == pytest.approx(2.5)
    assert elche_goodput(events[:2], 100.0, 110.0)["samples_per_s"] == 0.0  # no round: nothing counted


def _steps(attempt: int, first_step: int, count: int, start: float, samples: int = 64) -> list[dict[str, object]]:
    return [{"event": "step", "time": start + 0.1 * k, "global_step": first_step + k, "attempt": attempt,
             "samples": samples} for k in range(count)]


def test_ddp_loses_the_steps_after_the_checkpoint_an_attempt_was_killed_past():
    # Attempt 0 trains steps 1..30 (checkpoint at 20), is killed; attempt 1 resumes at 20 and trains 21..40.
    events = [*_steps(0, 1, 30, 100.05), {"event": "ckpt", "time": 102.0, "global_step": 20},
              *_steps(1, 21, 20, 110.0)]
    row = ddp_goodput(events, 100.0, 120.0, kill_times=(103.5,))
    assert row["final_global_step"] == 40 and row["attempts"] == 2 and not row["ended_in_restart"]
    assert row["consensus_samples"] == 40 * 64
    assert row["trained_samples"] == 50 * 64 and row["lost_samples"] == 10 * 64
    assert row["samples_per_s"] == pytest.approx(40 * 64 / 20.0)


def test_ddp_ending_in_a_restart_holds_only_its_newest_checkpoint():
    events = [*_steps(0, 1, 30, 100.05), {"event": "ckpt", "time": 102.0, "global_step": 20}]
    row = ddp_goodput(events, 100.0, 110.0, kill_times=(103.5,))
    assert row["ended_in_restart"] and row["final_global_step"] == 20
    assert row["consensus_samples"] == 20 * 64 and row["lost_samples"] == 10 * 64
    # The same record without the kill: the attempt is alive and holds its last step.
    assert ddp_goodput(events, 100.0, 110.0)["consensus_samples"] == 30 * 64


def test_the_goal_is_judged_only_where_the_rate_decides_it():
    clean = {ELCHE_CLEAN: {"rounds": 12}}
    arms = {**clean, ELCHE_JOINS: {"vs_own_fault_free": 0.93, "rounds": 11}}
    assert goal_met(arms, 1.0) is True and goal_met(arms, 4.0) is True and goal_met(arms, 0.5) is None
    arms = {**clean, ELCHE_JOINS: {"vs_own_fault_free": 0.85, "rounds": 11}}
    assert goal_met(arms, 1.0) is False and goal_met(arms, 0.5) is False and goal_met(arms, 4.0) is None
    assert goal_met({}, 1.0) is None
    # Too few rounds: the rounding of the last one would decide it.
    assert goal_met({**clean, ELCHE_JOINS: {"vs_own_fault_free": 0.95, "rounds": 4}}, 1.0) is None


def test_report_table_has_every_arm_its_ratios_and_the_arms_a_cut_run_did_not_reach():
    row = {"kills": [{}], "joiners_started": [{}], "joiners_trained": 1, "members_min": 3, "members_max": 4,
           "consensus_samples": 12800, "counted_s": 40.0, "samples_per_s": 320.0, "rounds": 11,
           "vs_own_fault_free": 0.914, "vs_ddp_fault_free": 2.5, "ended_early": None,
           "joins": [{"to_ready_s": 6.25, "ready_to_admitted_s": 0.4, "to_training_s": 6.8, "cohort_stall_s": 0.12},
                     {"started": 1.0}]}
    result = {"rig": "cpu4", "commit": "abc", "date": "2026-12-02",
              "command": "python -m lightning_elche.bench --churn 1",
              "machine": {"cpu": "x", "logical_cpus": 16, "torch": "2.11", "lightning": "2.6.6", "python": "3.12"},
              "config": {**_config().__dict__, "slowdowns": [1.0, 3.0]}, "schedule": [{"at_s": 12.5, "pick": 0.3}],
              "faults_per_minute_per_4_ranks": 1.0, "arms_planned": list(ARMS), "arms": {ELCHE_JOINS: row},
              "goal": {"met": True}}
    text = churn_markdown(result)
    assert "| elche_joins | 1 | 1 / 1 | 3-4 (11 rounds) | 12,800 | 40.0 | 320 | 0.91 | 2.50 |" in text
    assert ("- elche_joins, replacement 1: ready 6.2 s after its start (import, model, loaders); admitted 0.40 s "
            "later; training 6.8 s after its start; launch rank 0's admission took 0.12 s.") in text
    assert "- elche_joins, replacement 2: never ready" in text
    assert "The arms ran one after the other." in text
    side = {**result, "config": {**result["config"], "cpu_sets": [[0, 1]]},
            "arms": {ELCHE_JOINS: {**row, "cpus": "0,1"}}}
    assert "side by side, each pinned to its own CPUs: elche_joins on 0,1." in churn_markdown(side)
    assert "not run (the run was cut short): elche_fault_free, elche_shrink, ddp_fault_free, ddp_torchrun" in text
    assert "at 12.5 s" in text and "Commit abc" in text and ": met (this run: --churn 1)" in text
    assert "Structure only" not in text
    assert "**Structure only**: 16 logical CPUs for 4 ranks" in churn_markdown({**result, "crowded": True})


# -- the knobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"rate": 0.0}, "ChurnConfig(rate=0.0) is invalid: expected a number > 0"),
    ({"rate": math.nan}, "ChurnConfig(rate=nan) is invalid"),
    ({"delay_s": -1.0}, "ChurnConfig(delay_s=-1.0) is invalid: expected a number of seconds >= 0"),
    ({"seconds": 0.0}, "ChurnConfig(seconds=0.0) is invalid"),
    ({"ckpt_every": 0}, "ChurnConfig(ckpt_every=0) is invalid"),
    ({"ranks": 1}, "ChurnConfig(ranks=1) is invalid"),
    ({"arms": ("elche_joins", "nope")}, "ChurnConfig(arms='elche_joins,nope') is invalid"),
    ({"arms": (ELCHE_JOINS,)}, "add elche_fault_free to --churn-arms"),
    ({"arms": (DDP_RESTART, ELCHE_SHRINK, "elche_fault_free")}, "add ddp_fault_free to --churn-arms"),
    ({"arms": (ELCHE_CLEAN, ELCHE_JOINS), "cpu_sets": ((0,),)},
     "ChurnConfig(cpu_sets='0') is invalid: expected one non-empty CPU set per arm (2 arms"),
    ({"arms": (ELCHE_CLEAN, ELCHE_JOINS), "cpu_sets": ((0,), ())}, "one non-empty CPU set per arm"),
    ({"arms": (ELCHE_CLEAN, ELCHE_JOINS), "cpu_sets": ((0, 1), (1,))},
     "ChurnConfig(cpu_sets='0,1/1') is invalid: expected disjoint CPU sets"),
    ({"arms": (ELCHE_CLEAN, ELCHE_JOINS), "cpu_sets": ((0,), (100_000,))}, "expected CPUs this process may use"),
])
def test_bad_churn_settings_are_refused_with_the_owner_and_a_remedy(changes, message):
    with pytest.raises(ValueError, match=r"; (pass|use|add) ") as error:
        _config(**changes)
    assert message in str(error.value)


def test_command_line_reaches_the_config_and_bad_values_exit_2(capsys):
    args = parse_args(["--rig", "cpu4", "--budget", "quick", "--churn", "4", "--churn-delay", "3", "--churn-seconds",
                       "40", "--churn-seed", "7", "--commit", "abc123"])
    config = build_churn_config(args)
    assert (config.rate, config.delay_s, config.seconds, config.seed) == (4.0, 3.0, 40.0, 7)
    assert config.ranks == 4 and config.slowdowns == (1.0, 1.5, 2.0, 3.0) and config.model == "resnet20"
    assert config.arms == ARMS and args.commit == "abc123" and config.ckpt_every == 25
    assert build_churn_config(parse_args(["--rig", "cpu2", "--budget", "tiny", "--churn", "1"])).seconds == 15.0
    assert main(["--rig", "cpu4", "--churn", "-1"]) == 2
    assert "ChurnConfig(rate=-1.0) is invalid" in capsys.readouterr().err
    assert main(["--rig", "cpu4", "--churn", "1", "--churn-mode", "fast"]) == 2
    assert "ChurnConfig(mode='fast') is invalid: expected an ElChe mode of this build (" in capsys.readouterr().err
    assert main(["--rig", "gpu2-homo", "--churn", "1"]) == 2
    assert "ChurnConfig(rig='gpu2-homo') is invalid: expected a CPU rig" in capsys.readouterr().err


def test_cpu_sets_are_read_one_per_arm_and_a_bad_list_names_the_knob():
    assert parse_cpu_sets("0-3/4-7/8,10") == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 10))
    assert parse_cpu_sets("5") == ((5,),)
    with pytest.raises(ValueError, match=r"ChurnConfig\(cpu_sets='0-x/4'\) is invalid: expected CPU lists like"):
        parse_cpu_sets("0-x/4")
    args = parse_args(["--rig", "cpu2", "--churn", "1", "--churn-arms", "elche_fault_free,elche_joins",
                       "--churn-cpus", "0/1"])
    if {0, 1} <= os.sched_getaffinity(0):
        assert build_churn_config(args).cpu_sets == ((0,), (1,))


def test_join_phases_match_replacements_in_order_of_readiness(tmp_path: Path):
    def marks(member: int, **times: float) -> None:
        lines = [json.dumps({"event": event, "time": t, "member": member}) for event, t in times.items()]
        (tmp_path / f"join-timing-{member}.jsonl").write_text("\n".join(lines) + "\n")

    (tmp_path / "join-timing-0.jsonl").write_text("".join(
        json.dumps({"event": e, "time": t, "member": 0}) + "\n"
        for e, t in (("admit_start", 21.0), ("admit_end", 21.25), ("admit_start", 40.0), ("admit_end", 40.5))))
    marks(5, ready=39.0, admitted=40.0, training_starts=40.6)  # the second replacement, ready second
    marks(4, ready=20.0, admitted=21.0, training_starts=21.3)
    started = [{"time": 12.0}, {"time": 33.0}, {"time": 50.0}]
    first, second, third = join_phases(started, tmp_path)
    assert first["to_ready_s"] == pytest.approx(8.0) and first["ready_to_admitted_s"] == pytest.approx(1.0)
    assert first["to_training_s"] == pytest.approx(9.3) and first["cohort_stall_s"] == pytest.approx(0.25)
    assert second["to_ready_s"] == pytest.approx(6.0) and second["cohort_stall_s"] == pytest.approx(0.5)
    assert "to_ready_s" not in third and join_line(third).startswith("never ready")


# -- end to end -----------------------------------------------------------------------------------


def _early_fault_seed(rate: float, seconds: float, latest: float) -> int:
    """A seed whose one fault comes by ``latest`` s (time for a replacement and a restart to train)."""
    return next(s for s in range(1000) if fault_schedule(rate, 2, seconds, s)[0].at_s <= latest)


@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.timeout(600)
def test_cpu2_churn_run_kills_replaces_restarts_and_reports_every_arm(tmp_path: Path):
    seconds, rate = 30.0, 4.0  # one fault per faulted arm on 2 ranks
    seed = _early_fault_seed(rate, seconds, 8.0)
    out = tmp_path / "out"
    rc, log = run_command([sys.executable, "-m", "lightning_elche.bench", "--rig", "cpu2", "--budget", "tiny",
                           "--churn", str(rate), "--churn-seconds", str(seconds), "--churn-delay", "1",
                           "--churn-seed", str(seed), "--churn-ckpt-every", "10", "--commit", "test",
                           "--out", str(out)], tmp_path, 560)
    assert rc == 0, log[-4000:]
    result = json.loads((out / "cpu2-churn.json").read_text())
    assert result["commit"] == "test" and "--churn" in result["command"] and len(result["schedule"]) == 1
    arms = result["arms"]
    assert list(arms) == list(ARMS)
    for arm, row in arms.items():
        assert row["samples_per_s"] > 0, (arm, row)
        assert len(row["kills"]) == (1 if arm in (ELCHE_JOINS, ELCHE_SHRINK, DDP_RESTART) else 0), (arm, row)
    assert arms[ELCHE_SHRINK]["members_min"] == 1 and arms[ELCHE_SHRINK]["joiners_trained"] == 0
    assert len(arms[ELCHE_JOINS]["joiners_started"]) == 1
    assert arms[DDP_RESTART]["attempts_started"] >= 2  # torchrun restarted the workers
    for arm in ARMS:
        assert arms[arm]["vs_own_fault_free"] is not None
    table = (out / "cpu2-churn.md").read_text()
    assert all(f"| {arm} |" in table for arm in ARMS) and "How the numbers are computed" in table


def test_a_machine_without_a_core_per_process_is_reported_as_structure_only(monkeypatch):
    from lightning_elche.bench import churn

    arms = {ELCHE_CLEAN: {"samples_per_s": 100.0, "rounds": 20},
            ELCHE_JOINS: {"samples_per_s": 95.0, "rounds": 20}}
    host = {"cpu": "x", "logical_cpus": 2, "host": "h", "python": "3", "torch": "t", "lightning": "l"}
    monkeypatch.setattr(churn, "machine", lambda: host)
    result = churn._result(_config(arms=(ELCHE_CLEAN, ELCHE_JOINS)), [], arms, {})
    assert result["crowded"] and result["goal"]["met"] is None
    assert arms[ELCHE_JOINS]["vs_own_fault_free"] == pytest.approx(0.95)
    host["logical_cpus"] = 16
    result = churn._result(_config(arms=(ELCHE_CLEAN, ELCHE_JOINS)), [], arms, {})
    assert not result["crowded"] and result["goal"]["met"] is True


@pytest.mark.distributed
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_side_by_side_arms_run_at_once_each_on_its_own_cpus_and_time_their_replacements(tmp_path: Path):
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    sets = (cpus[:half], cpus[half:] or cpus[:half])
    if sets[0] == sets[1]:
        pytest.fail("this test needs two CPUs")
    seconds, rate = 30.0, 4.0
    seed = _early_fault_seed(rate, seconds, 8.0)
    out = tmp_path / "out"
    spec = "/".join(",".join(map(str, s)) for s in sets)
    rc, log = run_command([sys.executable, "-m", "lightning_elche.bench", "--rig", "cpu2", "--budget", "tiny",
                           "--churn", str(rate), "--churn-seconds", str(seconds), "--churn-delay", "1",
                           "--churn-seed", str(seed), "--churn-arms", f"{ELCHE_CLEAN},{ELCHE_JOINS}",
                           "--churn-cpus", spec, "--commit", "test", "--out", str(out)], tmp_path, 280)
    assert rc == 0, log[-4000:]
    result = json.loads((out / "cpu2-churn.json").read_text())
    arms = result["arms"]
    assert abs(arms[ELCHE_CLEAN]["t0"] - arms[ELCHE_JOINS]["t0"]) < 20.0  # the clocks ran together
    for arm, allowed in zip((ELCHE_CLEAN, ELCHE_JOINS), sets, strict=True):
        starts = [json.loads(line) for line in (out / "cpu2-churn-runs" / arm / "events.jsonl").read_text().splitlines()
                  if '"start"' in line]
        assert starts and all(set(e["cpus"]) <= set(allowed) for e in starts), (arm, starts, allowed)
    joins = arms[ELCHE_JOINS]["joins"]
    assert len(joins) == 1 and joins[0]["to_ready_s"] > 0, joins
    assert arms[ELCHE_JOINS]["joiners_trained"] == 1 and joins[0]["cohort_stall_s"] is not None, joins
    assert "side by side" in (out / "cpu2-churn.md").read_text()

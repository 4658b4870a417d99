"""Preempted and resumed again and again, on changing world sizes: a drawn chain of real CPU jobs.

Each trial draws a mode, sync checkpoints or none, validation or none, and a chain of up to three
runs: every run but the last is stopped by SIGTERM on a drawn rank (once a drawn number of rounds
is done, or in a drawn epoch's validation or ``on_train_epoch_end``), and the next resumes from
its stop checkpoint on a drawn number of ranks (2-4). A signal drawn past the fit's
end lets that run finish. Each trial checks that every sample of every epoch went into the final
model exactly once (what each stop checkpoint's coverage kept, plus what the last run trained),
that the last run's replicas are identical, that each stopped run exited with 143 and the last
with 0, and that no process outlived a launch.

CI runs three fixed draws; the soak is marked ``faults``: ``ELCHE_RESUME_SOAK_TRIALS`` (default 40),
``ELCHE_RESUME_SOAK_SEED`` (default 0) and ``ELCHE_RESUME_SOAK_MOST_RANKS`` (default 4: each run
draws 2 to that many ranks) set its size and draw, and with ``ELCHE_RESUME_SOAK_REPORT=path``
every trial appends a JSON line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from multirank_helpers import clean_environment
from preemption_helpers import exactly_once_errors, launch, step_records, trained_in_checkpoint
from test_soak import soak_count

from lightning_elche.stop_checkpoint import STOP_CHECKPOINT_NAME

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
SCRIPT = Path(__file__).parent / "scripts" / "preempt_fit.py"
MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
EPOCHS = 2
PHASES = ("train", "validation", "epoch_end")


@dataclass(frozen=True)
class ResumeTrial:
    seed: str
    index: int
    mode: str
    every_n_syncs: int | None
    worlds: tuple[int, ...]
    """The ranks of each run of the chain."""
    stops: tuple[tuple[int, int, str, int], ...]
    """For each run but the last: the signalled rank, the rounds done before the signal, the phase
    (``train``: once those rounds are done; ``validation``: its first validation batch of the epoch;
    ``epoch_end``: ``on_train_epoch_end``) and that epoch."""
    validate: bool
    """Two validation batches after every epoch."""

    @property
    def name(self) -> str:
        return f"{self.seed}.{self.index:03d}-{self.mode}-{'x'.join(map(str, self.worlds))}"


def draw_resume_trial(seed: str, index: int, most_ranks: int = 4) -> ResumeTrial:
    chooser = random.Random(f"resume-soak-{seed}-{index}")
    mode = chooser.choice(MODES)
    every_n_syncs = chooser.choice([None, 1, 3])
    runs = chooser.choice([2, 2, 3])
    worlds = tuple(chooser.randint(2, most_ranks) for _ in range(runs))
    # Rounds accumulate over the chain (a resumed run restores the count), so each stop comes later;
    # a per-step mode has many more rounds than the windowed ones, and more ranks fewer of either.
    scale = 60 if mode.endswith("_sync") else 6
    rounds, stops = 0, []
    for world in worlds[:-1]:
        rounds += chooser.randint(1, max(1, scale // world))
        stops.append((chooser.randrange(world), rounds))
    # Drawn after the rest, so that adding them kept the earlier draws.
    phases = [chooser.choices(PHASES, weights=(3, 1, 1))[0] for _ in stops]
    epochs = [chooser.randrange(EPOCHS - 1) for _ in stops]  # not the last: its end has no next sync
    validate = "validation" in phases or chooser.random() < 0.5
    return ResumeTrial(seed, index, mode, every_n_syncs, worlds,
                       tuple((r, n, p, e) for (r, n), p, e in zip(stops, phases, epochs, strict=True)), validate)


def run_chain(tmp_path: Path, trial: ResumeTrial) -> dict[str, object]:
    """Run ``trial``'s chain and check it; returns what happened, for the report."""
    env = clean_environment()
    kept: list[dict[int, list[int]]] = []
    ckpt: Path | None = None
    stopped = 0
    for k, world in enumerate(trial.worlds):
        tag = f"run{k}"
        command = [sys.executable, str(SCRIPT), str(tmp_path), "--mode", trial.mode, "--tag", tag,
                   "--epochs", str(EPOCHS), "--devices", str(world)]
        if trial.every_n_syncs is not None:
            command += ["--every-n-syncs", str(trial.every_n_syncs)]
        if trial.validate:
            command += ["--validate"]
        if ckpt is not None:
            command += ["--ckpt", str(ckpt)]
        last = k == len(trial.worlds) - 1
        if not last:
            rank, rounds, phase, epoch = trial.stops[k]
            command += ["--fault", "TERM", "--fault-rank", str(rank), "--fault-round", str(rounds),
                        "--fault-phase", phase, "--fault-epoch", str(epoch)]
            (tmp_path / "signal-time.json").unlink(missing_ok=True)
        codes, logs = launch([(command, env)], tmp_path / f"logs-{tag}", 240)
        signalled = not last and (tmp_path / "signal-time.json").exists()
        if codes == [0]:
            # The fit ended: no signal, or one after its last sync (in the last validation or epoch
            # end, where Lightning too finishes the fit), which saves nothing.
            assert not (tmp_path / "ckpt" / STOP_CHECKPOINT_NAME).exists(), f"run {k} ended 0 but saved a stop"
            kept.append(step_records(tmp_path, tag))
            break
        assert signalled and codes == [128 + signal.SIGTERM], f"run {k} ({world} ranks) exited {codes}:\n{logs}"
        stopped += 1
        saved = tmp_path / "ckpt" / STOP_CHECKPOINT_NAME
        assert saved.exists(), f"run {k} was stopped but wrote no {STOP_CHECKPOINT_NAME}:\n{logs}"
        ckpt = tmp_path / f"stop{k}.ckpt"
        shutil.move(saved, ckpt)
        checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
        kept.append(trained_in_checkpoint(checkpoint, step_records(tmp_path, tag)))
    errors = exactly_once_errors(kept, range(EPOCHS))
    assert not errors, f"{trial.name}: {errors}"
    final = len(kept) - 1
    params = [json.loads((tmp_path / f"params-run{final}-rank{r}.json").read_text())
              for r in range(trial.worlds[final])]
    assert all(p == params[0] for p in params), f"{trial.name}: the last run's replicas differ"
    return {"stopped": stopped, "runs": len(kept)}


def run_trial(tmp_path: Path, trial: ResumeTrial) -> dict[str, object]:
    started, outcome, result = time.monotonic(), "failed", {}
    try:
        result = run_chain(tmp_path, trial)
        outcome = "passed"
    except BaseException as error:  # pytest.fail and a timeout too: the report counts every failure
        outcome = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        raise
    finally:
        report = os.environ.get("ELCHE_RESUME_SOAK_REPORT")
        if report:
            line = {**asdict(trial), **result, "outcome": outcome, "seconds": round(time.monotonic() - started, 1)}
            with open(report, "a") as sink:
                sink.write(json.dumps(line) + "\n")
    return result


CI = [draw_resume_trial("ci", k) for k in (19, 21, 22)]
"""Three fixed draws of two stops each, both of which fire: `cpu_sync` on 2, 4 and 2 ranks stopped at
epoch 0's end, then in training; `nccl_sync` on 2 ranks stopped in training, then in epoch 0's
validation; `nccl_cadence` on 3, 3 and 2 ranks stopped twice in training, with sync checkpoints."""
SOAK = [draw_resume_trial(os.environ.get("ELCHE_RESUME_SOAK_SEED", "0"), k,
                          soak_count("ELCHE_RESUME_SOAK_MOST_RANKS", 4, 2))
        for k in range(soak_count("ELCHE_RESUME_SOAK_TRIALS", 40, 1))]


@pytest.mark.parametrize("trial", CI, ids=lambda t: t.name)
def test_a_drawn_chain_of_stops_and_resizing_resumes_trains_every_sample_once(tmp_path, trial):
    result = run_trial(tmp_path, trial)
    assert result["stopped"] == len(trial.stops), "a drawn stop came after the fit's end: the draw tests less"


@pytest.mark.faults
@pytest.mark.parametrize("trial", SOAK, ids=lambda t: t.name)
def test_resume_soak(tmp_path, trial):
    run_trial(tmp_path, trial)

"""One view of checkpoints on every rank (issue 26), through a lost rank and a resume at another world size.

Real CPU jobs (gloo, Lightning's popen launcher, ranks of different speeds): 3 ranks fit with a
``ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last="link")`` and an
``ElCheCheckpoint(every_n_syncs=3, save_last=True)`` whose file names hold ``{step}`` and a rank-local
metric; one rank is killed in the second epoch. Every survivor must hold the same state of both
callbacks, naming only files that exist, and ``validate(ckpt_path="last")``, ``test(ckpt_path="best")``
and ``predict(ckpt_path="best")`` must load the same file on every survivor. Then a job of another
size (3 ranks again, after 2 survivors wrote the last checkpoints) resumes with ``fit(ckpt_path="last")``
and the same holds for its checkpoints.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any

import pytest
from multirank_helpers import LAUNCH_TAG, clean_environment, end_launch, launch_logged, wait_for_launch

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_agreement_fit.py"

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(700)]


def run_job(out: Path, tag: str, mode: str, devices: int, epochs: int, extra: tuple[str, ...] = (),
            timeout_s: float = 300.0) -> dict[int, dict[str, Any]]:
    """Run the job to its end (rank 0's process and every process it started); each finishing
    rank's result, by original rank."""
    out.mkdir(parents=True, exist_ok=True)
    launch = secrets.token_hex(8)
    command = [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--devices", str(devices), "--epochs",
               str(epochs), "--tag", tag, *extra]
    log = out / f"{tag}.log"
    proc = launch_logged(command, {**clean_environment(), LAUNCH_TAG: launch}, log)
    try:
        wait_for_launch(proc, launch, log, timeout_s, what=f"rank 0 of {tag}")
    finally:
        end_launch([proc], launch)
    results = {int(p.stem.rsplit("-rank", 1)[1]): json.loads(p.read_text())
               for p in out.glob(f"result-{tag}-rank*.json")}
    assert results, f"no rank of {tag} finished:\n{log.read_text()[-4000:]}"
    return results


def check_one_view(results: dict[int, dict[str, Any]], world_size: int) -> dict[str, Any]:
    """Every finishing rank holds the same checkpoint state, naming only files that exist, and
    loaded the same files; returns rank 0's result."""
    first = results[min(results)]
    assert len(results) == world_size, f"{len(results)} ranks finished, expected {world_size}"
    for rank, result in results.items():
        assert result["world_size"] == world_size
        for key in ("cohort_step", "best", "sync", "files", "validate", "test", "predict"):
            assert result[key] == first[key], f"rank {rank}'s {key} differs from rank {min(results)}'s"
    for name in ("best", "sync"):
        state = first[name]
        assert state["missing"] == [], f"{name}: named files that do not exist: {state['missing']}"
    # The top-2 by val_loss, its best among them, and the last link pointing into the directory.
    assert len(first["best"]["best_k_models"]) == 2
    assert first["best"]["best_model_path"] in first["best"]["best_k_models"]
    assert first["best"]["best_model_score"] == min(first["best"]["best_k_models"].values())
    assert first["validate"]["ckpt_path"] in (first["best"]["last_model_path"], first["sync"]["last_model_path"])
    assert first["test"]["ckpt_path"] == first["predict"]["ckpt_path"] == first["best"]["best_model_path"]
    assert first["predict"]["batches"] > 0
    return first


@pytest.mark.parametrize(("mode", "killed"), [pytest.param("nccl_cadence", 0, marks=pytest.mark.extended),
                                              ("cpu_async", 1)])
def test_every_rank_agrees_on_checkpoints_after_a_lost_rank_and_a_resume_on_more_ranks(
        tmp_path: Path, mode: str, killed: int) -> None:
    # 384 samples in batches of 8: 48 batches an epoch over the cohort; the killed rank dies in epoch 1.
    first = check_one_view(run_job(tmp_path, "first", mode, 3, 3, ("--kill", f"{killed}:22")), world_size=2)
    assert first["cohort_step"] == 3 * 48
    # {step} is the cohort step: the epoch-end names are the same on every rank (a rank's own steps are not).
    epoch_end_names = {Path(p).name for p in first["best"]["best_k_models"]}
    assert epoch_end_names <= {f"epoch={e}-step={48 * (e + 1)}.ckpt" for e in range(3)}, epoch_end_names
    assert all("-step=" in name and "-sync=" in name for name in first["files"]["sync"] if name != "last.ckpt")
    resumed = check_one_view(run_job(tmp_path, "resumed", mode, 3, 4, ("--resume", "last")), world_size=3)
    assert resumed["cohort_step"] == 4 * 48
    assert Path(resumed["best"]["last_model_path"]).name == "last.ckpt"

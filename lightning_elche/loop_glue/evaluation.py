"""The fit's evaluation loop (its validation epochs and the sanity check), run again from its start
after a rank was lost in it.

Lightning's ``_EvaluationLoop.run`` is one call from its data set-up to its end hooks; an exception
from one of its collectives leaves behind a data fetcher mid-iteration, the module in eval mode,
half-accumulated logged results and advanced batch counters. :func:`run_evaluation_again_after`
wraps the fit loop's evaluation loop so that, when the error that ended a run is one the survivors
recovered from, those are put back as they were before the run and the run starts again: its data
set-up cuts the validation shards for the new members (the change's rank view dropped the old
loader), its hooks run again, and what it logs is the new run's only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch import Trainer


class EvaluationRuns(Protocol):
    """What follows the fit's evaluation runs: where they start and end, and whether an error was survived."""

    def starting(self) -> None: ...

    def finished(self) -> None: ...

    def recovered(self, error: BaseException) -> bool: ...


def run_evaluation_again_after(trainer: Trainer, runs: EvaluationRuns) -> Callable[[], None]:
    """Make the fit's evaluation loop run again whenever ``runs.recovered(error)`` says that the
    error which interrupted it was survived (it raises, or returns False, otherwise: the error
    then goes on); ``runs.starting()`` comes before a run, ``runs.finished()`` after it ended
    normally. Returns the undo."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    run = loop.run

    def run_again_after_a_loss() -> Any:
        before = loop.batch_progress.state_dict()
        runs.starting()
        while True:
            try:
                outputs = run()
                break
            except Exception as error:
                if not runs.recovered(error):
                    raise
                discard_interrupted_evaluation(trainer, before)
        runs.finished()
        return outputs

    loop.run = run_again_after_a_loss  # type: ignore[method-assign]
    return lambda: vars(loop).pop("run", None)  # back to the class's method


def discard_interrupted_evaluation(trainer: Trainer, progress: dict[str, Any]) -> None:
    """Undo what an interrupted run of the fit's evaluation loop left: its data fetcher (and the
    loader's workers), the module's eval mode, the results it logged, its batch counters; and drop
    the combined loader so that the next run cuts the shards for the current members."""
    loop = trainer.fit_loop.epoch_loop.val_loop
    fetcher = loop._data_fetcher
    if fetcher is not None:
        fetcher.teardown()
        loop._data_fetcher = None
    loop._on_evaluation_model_train()  # the run set eval mode; the next run captures the modes again
    trainer._logger_connector.reset_results()
    loop.batch_progress.load_state_dict(progress)
    loop._combined_loader = None

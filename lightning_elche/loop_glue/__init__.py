"""The one door into Lightning's internals: every private Lightning name ElChe uses, and every
change it makes to Lightning's objects.

ElChe adapts a fit loop written for lockstep ranks to ranks that take different numbers of
steps. Some of that needs Lightning's private state. It is all in this package, each private
name used once, so that a Lightning upgrade breaks one place (``tests/test_architecture.py``
fails when a private Lightning attribute is used anywhere else in the package). Every patch of
a Lightning object is made through :class:`LightningPatches`, which undoes them all when the fit
ends. The supported Lightning range is :data:`SUPPORTED_LIGHTNING` (the range ``pyproject.toml``
declares); the strategy refuses to fit under any other version.

One module per part of Lightning it adapts: :mod:`.versions`, :mod:`.trainer_reads` (the Trainer's
and its callbacks' private state), :mod:`.ddp` (process groups and DDP internals), :mod:`.loaders`
(the training loader and its sampler), :mod:`.patches`, :mod:`.signals`, :mod:`.launcher` (the popen
launcher that spares survivors), :mod:`.ranks` (rank numbers after a membership change), :mod:`.results`
(the batch ``self.log`` sizes its epoch means by), :mod:`.evaluation` (the validation run again
after a lost rank).
"""

from lightning_elche.loop_glue.ddp import (
    ddp_model_averager,
    default_group_store,
    distributed_is_initialized,
    init_process_group_on_job_store,
    process_group_timeout,
    register_ddp_comm_hook,
    sync_module_states,
)
from lightning_elche.loop_glue.evaluation import (
    EvaluationRuns,
    discard_interrupted_evaluation,
    run_evaluation_again_after,
)
from lightning_elche.loop_glue.launcher import (
    ChildObserver,
    ChildRestarter,
    TolerantSubprocessLauncher,
    configure_launcher,
)
from lightning_elche.loop_glue.loaders import (
    batch_samples,
    reopen_training_epoch,
    sampler_for,
    user_sampler_name,
    with_training_sampler,
)
from lightning_elche.loop_glue.patches import (
    LightningPatches,
)
from lightning_elche.loop_glue.ranks import (
    LightningRankView,
    renumber_lightning_ranks,
)
from lightning_elche.loop_glue.results import (
    add_missing_epoch_metrics,
    epoch_metric_specs,
    logging_batch,
)
from lightning_elche.loop_glue.signals import (
    SigtermHandler,
    chained_user_handler,
    save_and_requeue_slurm_job,
    slurm_requeue_signal,
    stop_signal_requests,
    under_job_launcher,
)
from lightning_elche.loop_glue.trainer_reads import (
    can_stop_early,
    check_step_schedulers,
    checkpoint_step_triggers,
    lightning_phase,
    logged_callback_metrics,
    monitor_candidates,
    next_epoch,
    save_checkpoint_now,
    skip_validation_after_this_batch,
    timer_step_duration,
    train_dataloader_count,
    uses_sync_batchnorm,
)
from lightning_elche.loop_glue.versions import (
    SUPPORTED_LIGHTNING,
    check_lightning_version,
)

__all__ = [
    "ChildObserver",
    "ChildRestarter",
    "EvaluationRuns",
    "LightningPatches",
    "LightningRankView",
    "SUPPORTED_LIGHTNING",
    "SigtermHandler",
    "TolerantSubprocessLauncher",
    "add_missing_epoch_metrics",
    "batch_samples",
    "can_stop_early",
    "chained_user_handler",
    "check_lightning_version",
    "check_step_schedulers",
    "checkpoint_step_triggers",
    "configure_launcher",
    "ddp_model_averager",
    "default_group_store",
    "discard_interrupted_evaluation",
    "distributed_is_initialized",
    "epoch_metric_specs",
    "init_process_group_on_job_store",
    "lightning_phase",
    "logged_callback_metrics",
    "logging_batch",
    "monitor_candidates",
    "next_epoch",
    "process_group_timeout",
    "register_ddp_comm_hook",
    "renumber_lightning_ranks",
    "reopen_training_epoch",
    "run_evaluation_again_after",
    "sampler_for",
    "save_and_requeue_slurm_job",
    "save_checkpoint_now",
    "skip_validation_after_this_batch",
    "slurm_requeue_signal",
    "stop_signal_requests",
    "sync_module_states",
    "timer_step_duration",
    "train_dataloader_count",
    "under_job_launcher",
    "user_sampler_name",
    "uses_sync_batchnorm",
    "with_training_sampler",
]

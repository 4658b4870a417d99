"""What each rank process runs: set up once, then every fit of the plan in order.

The harness starts the rank processes (``Rig.world_size`` of them, one per device) itself
(``spawn``) and initializes the process group once; Lightning then finds ``LOCAL_RANK`` in the
environment and an initialized group, so it launches nothing and runs each ``Trainer.fit`` in
place, exactly as under ``torchrun``. One world serves every fit of the run: this keeps process
start-up (seconds per fit, most of a short fit) out of the budget and lets arms interleave
cheaply. A separate gloo group carries the harness's own small decisions (stop a fit, skip a
group) so they never touch the training backend.

Each fit writes one JSON record per rank to the run directory (``<job id>.rank<r>.json``): spawn
returns nothing to the parent, which reads the records when every rank is done.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

from lightning_elche.averaging import AveragedLayout, FlatTensors, round_weights
from lightning_elche.bench.arms import PostLocalSGDStrategy, make_strategy
from lightning_elche.bench.config import PG_TIMEOUT_S, BenchConfig
from lightning_elche.bench.limited import memory_limit, plan_micro_batches
from lightning_elche.bench.limits import FitShape, multi_shape, optimizer_steps, solo_shape
from lightning_elche.bench.memory import read_peaks, reset_peaks
from lightning_elche.bench.meter import BenchMeter
from lightning_elche.bench.plan import CONVERGENCE, SOLO_PAIR, SOLO_RANK0, THROUGHPUT, Group, Job
from lightning_elche.bench.workloads import (
    CHAR_SPEC_CPU,
    CHAR_SPEC_GPU,
    CHAR_SPECS,
    CharWorkload,
    DigitsWorkload,
    Workload,
    model_stats,
    throughput_workload,
    train_loader,
)
from lightning_elche.loop_glue import ddp_model_averager
from lightning_elche.planes import CollectivePlane
from lightning_elche.rounds import META_SIZE
from lightning_elche.strategy import ElCheStrategy
from lightning_elche.testing import Throttle

CONTROL_TIMEOUT_S = 1800
EXIT_THROTTLE = 3
"""Exit status of a rank that found the throttled solo not measurably slower."""

log = logging.getLogger(__name__)


def record_path(run_dir: str, name: str, rank: int) -> Path:
    return Path(run_dir, f"{name}.rank{rank}.json")


def write_record(run_dir: str, name: str, rank: int, record: dict[str, Any]) -> None:
    path = record_path(run_dir, name, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def read_record(run_dir: str, name: str, rank: int) -> dict[str, Any]:
    return json.loads(record_path(run_dir, name, rank).read_text())


def solo_rate(record: dict[str, Any]) -> float:
    """Steady-state samples/s of a single-process fit."""
    span = (record["t_end"] or 0.0) - (record["t_start"] or 0.0)
    return record["samples"] / span if span > 0 else 0.0


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_elche"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*The number of training batches.*",
                    ".*is smaller than the logging interval.*", ".*sync_dist.*", ".*LeafSpec.*",
                    ".*barrier\\(\\).*device.*"):
        warnings.filterwarnings("ignore", message=pattern)


@dataclass
class RankContext:
    """The per-process state shared by every fit."""

    rank: int
    config: BenchConfig
    run_dir: str
    device: torch.device
    control: Any
    t0: float
    workloads: dict[str, Workload] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    micro_batches: Optional[list[int]] = None
    """Every rank's micro-batch in the throughput fits (``--micro-batch``; None: whole batches)."""

    @property
    def accelerator(self) -> str:
        return self.config.rig.accelerator

    @property
    def world(self) -> int:
        return self.config.rig.world_size

    def workload(self, section: str) -> Workload:
        if section not in self.workloads:
            budget = self.config.budget
            if section == THROUGHPUT:
                self.workloads[section] = throughput_workload(budget.model, budget.tp_samples, self.device)
            elif self.config.conv_workload == "digits":
                self.workloads[section] = DigitsWorkload(self.device)
            else:
                default = CHAR_SPEC_GPU if self.device.type == "cuda" else CHAR_SPEC_CPU
                spec = CHAR_SPECS[budget.char_model] if budget.char_model else default
                self.workloads[section] = CharWorkload(spec, budget.char_bytes, self.device)
        return self.workloads[section]

    def agree(self, local: Any) -> Any:
        """Rank 0's value of ``local``, on every rank."""
        box = [local]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.control)


# -- set-up --------------------------------------------------------------------------------


def _set_rank_environment(rank: int, port: int, world: int, ranks_as_nodes: bool = False) -> None:
    """What a launcher would set. ``ranks_as_nodes`` (``--share-gpu``): each rank is the only
    process of its own "node", so that Lightning maps every rank to device 0."""
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": "0" if ranks_as_nodes else str(rank),
        "NODE_RANK": str(rank) if ranks_as_nodes else "0",
    })
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = fabric_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def _init_process_group(rank: int, port: int, config: BenchConfig) -> tuple[torch.device, Any]:
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    world = config.rig.world_size
    if config.rig.accelerator == "cuda":
        device = torch.device("cuda", 0 if config.share_gpu else rank)
        torch.cuda.set_device(device)
        torch.set_num_threads(max(1, (os.cpu_count() or world) // world))  # as Lightning's DDP would
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
        dist.init_process_group(config.rig.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device if config.rig.backend == "nccl" else None)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
    # The harness's own group waits while the peer trains alone (a solo fit): a long timeout. A
    # dead peer is caught by the parent, which stops both processes.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    return device, control


def describe_device(device: torch.device) -> dict[str, Any]:
    import lightning

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": props.name,
            "gpu_sms": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "nccl": _nccl_version(),
        })
    return info


def _nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def free_port() -> int:
    """A TCP port free on this host now (for a job's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# -- the all-reduce microbenchmark ---------------------------------------------------------


def _time_collective(ctx: RankContext, op: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        op()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    ctx.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return (time.perf_counter() - start) / iters


def _micro_model(ctx: RankContext, section: str) -> dict[str, Any]:
    iters = ctx.config.budget.micro_iters
    module = ctx.workload(section).make_module().to(ctx.device)
    params = [torch.nn.Parameter(p.detach().clone()) for p in module.parameters()]
    grads = [torch.zeros_like(p) for p in params]
    numel = sum(p.numel() for p in params)
    flat = torch.ones(numel, dtype=torch.float32, device=ctx.device)
    raw_s = _time_collective(ctx, lambda: dist.all_reduce(flat), iters)
    meta_device = ctx.device if ctx.config.rig.backend == "nccl" else torch.device("cpu")
    layout = AveragedLayout.fixed(FlatTensors(params), FlatTensors([]))
    plane = CollectivePlane(layout, ctx.rank, ctx.world, meta_device)
    weights = round_weights([1] * ctx.world, 1.0)

    def after_a_step() -> None:
        # A round follows an optimizer step and drops the step's gradients (the in-place round
        # keeps its pre-round values there first), so every timed round starts with them, as in a fit.
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        plane.average(weights)

    plane_s = _time_collective(ctx, after_a_step, iters)
    flat_s = _time_collective(ctx, lambda: plane.sum_scaled(plane.params.flats, 1.0), iters)
    local = torch.zeros(META_SIZE, dtype=torch.float64)
    exchange_s = _time_collective(ctx, lambda: plane.exchange(local), iters)
    plane.close()
    return {
        "model": ctx.workload(section).name,
        "numel": numel,
        "bytes": numel * 4,
        "iters": iters,
        "raw_all_reduce_s": raw_s,
        "plane_average_s": plane_s,
        "flat_all_reduce_s": flat_s,
        "metadata_exchange_s": exchange_s,
    }


def _pool_claim_s(ctx: RankContext) -> float:
    """Seconds per chunk claim of the pooled dispatch: ``store.add`` on the default group's
    TCPStore, every rank claiming on one key at once (the contention of a pooled epoch)."""
    store = dist.distributed_c10d._get_default_store()
    key = "lightning_elche_bench/pool_probe"
    return _time_collective(ctx, lambda: store.add(key, 1), 10 * ctx.config.budget.micro_iters)


def microbenchmark(ctx: RankContext) -> dict[str, Any]:
    """Per model of the run: seconds per raw ``dist.all_reduce`` of a flat float32 tensor of its
    parameter count, per flat-parameter all-reduce as the plane issues it
    (``CollectivePlane.sum_scaled``: pre-scale and SUM all-reduce of its persistent flat buffer),
    per ``CollectivePlane.average`` of its parameters after a step (ElChe's whole averaging path:
    on NCCL the out-of-place round, a scaled reduce-scatter of the parameters' own flat storage
    into a round buffer, its all-gather and the settling with the divergence norms; on gloo the
    in-place round, pre-round values kept in the gradients), per metadata exchange (a round's
    all-gather), and (model-independent) per chunk claim of the pooled dispatch."""
    out = {section: _micro_model(ctx, section) for section in (THROUGHPUT, CONVERGENCE)}
    claim_s = _pool_claim_s(ctx)
    for row in out.values():
        row["pool_claim_s"] = claim_s
    _release()
    return out


# -- fits ----------------------------------------------------------------------------------


def _throttle(ctx: RankContext, job: Job, device_rank: int, fit_rank: int) -> Optional[Throttle]:
    """The throttle of rank ``device_rank``'s device under the job's setting, acting on the
    global rank ``fit_rank`` of the fit (0 in a single-process solo fit); None if unthrottled."""
    slowdown, sms = job.setting.rank_throttle(device_rank)
    if sms is not None:
        if ctx.device.type != "cuda":
            raise ValueError(f"setting {job.setting.label} limits SMs and needs CUDA")
        total = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        if not 1 <= sms <= total:
            knob = "--rank1-sms" if ctx.world == 2 else f"the {ctx.config.rig.name} SM spread"
            raise ValueError(f"{knob}={sms} (setting {job.setting.label}): rank {device_rank}'s GPU has {total} SMs; "
                             f"expected 1 to {total}")
        # Half an SM of slack so that float rounding never drops a granule in green_context_sms.
        return Throttle(fit_rank, max(1.0, total / (sms + 0.5)), method="sm_limit")
    if slowdown > 1.0:
        return Throttle(fit_rank, slowdown, method="sleep")
    return None


def _trainer(ctx: RankContext, strategy: Any, devices: Any, max_epochs: int, callbacks: list[Any],
             num_nodes: int = 1, accumulate: int = 1) -> Trainer:
    return Trainer(
        accumulate_grad_batches=accumulate,
        accelerator=ctx.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=ctx.run_dir,
    )


def _fit_limits(ctx: RankContext, job: Job) -> tuple[int, float, bool]:
    """(max_epochs, stop-after seconds, evaluate) of a job."""
    budget = ctx.config.budget
    if job.section == THROUGHPUT:
        stop_after = budget.solo_seconds if job.arm == SOLO_PAIR else budget.tp_seconds
        return budget.tp_max_epochs, stop_after, False
    return budget.conv_epochs, budget.conv_max_seconds, True


def _seed(job: Job) -> int:
    return (1000 if job.section == THROUGHPUT else 0) + job.seed


def _common_record(job: Job, trainer: Trainer, meter: BenchMeter, throttle: Optional[Throttle],
                   stats: dict[str, int], wall_s: float) -> dict[str, Any]:
    record = meter.record()
    record.update({
        "job": job.job_id,
        "arm": job.arm,
        "section": job.section,
        "seed": job.seed,
        "setting": job.setting.label,
        "epochs": trainer.current_epoch,
        "model": stats,
        "workload": meter.workload.describe(),
        "wall_s": wall_s,
    })
    if throttle is not None:
        record["throttle"] = {"method": throttle.active_method, "slowdown": throttle.slowdown,
                              "sleep_s": throttle.sleep_s, "sms": throttle.sms}
    return record


def _memory(ctx: RankContext, meter: BenchMeter, baseline: Optional[int]) -> Optional[dict[str, Any]]:
    """This rank's accelerator peaks of the fit that just ended and the pinned host bytes its
    averaging plane held (None on a CPU device: nothing is measured there)."""
    peaks = read_peaks(ctx.device, baseline)
    if peaks is not None:
        peaks["pinned_held"] = meter.pinned_held
    return peaks


def run_solo(ctx: RankContext, job: Job, as_rank: int) -> dict[str, Any]:
    """One single-process fit of the device of rank ``as_rank``, with that rank's throttle."""
    workload = ctx.workload(job.section)
    budget = ctx.config.budget
    if job.section == THROUGHPUT:
        # A rank's solo trains 1/world of the data, over k if it sleeps, so that the concurrent solos
        # run about as long (CPU contention).
        share = 1.0 / ctx.world / job.setting.rank_throttle(as_rank)[0]
        batch, drop_last = budget.tp_batch, True
    else:
        share, batch, drop_last = 1.0, budget.conv_batch, False
    shape = FitShape(batch)
    if job.section == THROUGHPUT and ctx.micro_batches is not None:  # at its micro-batch, accumulated
        shape = solo_shape(job.setting.rank_memory, as_rank, batch, ctx.micro_batches)
    seed_everything(_seed(job), verbose=False)
    module = workload.make_module()
    stats = model_stats(module)
    max_epochs, stop_after, evaluate = _fit_limits(ctx, job)
    meter = BenchMeter(workload, evaluate=evaluate, stop_after_s=stop_after)
    throttle = _throttle(ctx, job, as_rank, 0)
    callbacks: list[Any] = [c for c in (throttle, meter) if c is not None]
    devices: Any = [ctx.device.index] if ctx.device.type == "cuda" else 1
    trainer = _trainer(ctx, "auto", devices, max_epochs, callbacks, accumulate=shape.accumulate)
    with memory_limit(ctx.device, shape.memory_fraction):
        baseline = reset_peaks(ctx.device)
        started = time.time()
        trainer.fit(module, train_dataloaders=train_loader(workload.train_set(share), shape.batch, drop_last))
        record = _common_record(job, trainer, meter, throttle, stats, time.time() - started)
        record["memory"] = _memory(ctx, meter, baseline)
    record.update({"arm": f"solo_rank{as_rank}", "solo_of_rank": as_rank, "batch_size": shape.batch,
                   "train_samples": len(workload.train_set(share))})
    if ctx.micro_batches is not None and job.section == THROUGHPUT:
        record["micro_batch"] = shape.record(shape.batch)
    return record


def run_multi(ctx: RankContext, job: Job) -> dict[str, Any]:
    """One multi-rank fit of ``job.arm``, every rank throttled as the setting says."""
    workload = ctx.workload(job.section)
    budget = ctx.config.budget
    batch, drop_last = (budget.tp_batch, True) if job.section == THROUGHPUT else (budget.conv_batch, False)
    seed_everything(_seed(job), verbose=False)
    module = workload.make_module()
    stats = model_stats(module)
    max_epochs, stop_after, evaluate = _fit_limits(ctx, job)
    meter = BenchMeter(workload, evaluate=evaluate, stop_after_s=stop_after, control_group=ctx.control,
                       trace_elche=job.arm in ctx.config.elche_modes)
    throttle = _throttle(ctx, job, ctx.rank, ctx.rank)
    callbacks: list[Any] = [c for c in (throttle, meter) if c is not None]
    shape = FitShape(batch)
    limited = job.section == THROUGHPUT and ctx.micro_batches is not None
    if limited:
        assert ctx.micro_batches is not None
        shape = multi_shape(job.setting.rank_memory, job.setting.rank_micro_batch, job.arm in ctx.config.elche_modes,
                            ctx.rank, batch, ctx.micro_batches)
    strategy = make_strategy(job.arm, ctx.config, shape.micro_batch)
    if ctx.config.share_gpu:  # every rank a one-device node: Lightning maps each to cuda:0
        trainer = _trainer(ctx, strategy, 1, max_epochs, callbacks, num_nodes=ctx.world, accumulate=shape.accumulate)
    else:
        trainer = _trainer(ctx, strategy, ctx.world, max_epochs, callbacks, accumulate=shape.accumulate)
    with memory_limit(ctx.device, shape.memory_fraction):
        baseline = reset_peaks(ctx.device)
        started = time.time()
        trainer.fit(module, train_dataloaders=train_loader(workload.train_set(), shape.batch, drop_last))
        record = _common_record(job, trainer, meter, throttle, stats, time.time() - started)
        record["memory"] = _memory(ctx, meter, baseline)
    record.update({"batch_size": shape.batch, "train_samples": len(workload.train_set())})
    progress = strategy.progress if isinstance(strategy, ElCheStrategy) else None
    if limited:  # an ElChe arm: the micro-batch this rank's fit chose, as its rounds reported it
        record["micro_batch"] = shape.record(progress.totals[ctx.rank].micro_batch if progress else shape.batch)
    if progress is not None:
        record["elche"] = {
            "rounds": progress.rounds,
            "cohort_step": progress.cohort_step,
            "final_anchor": progress.anchor,
            "window_plan": list(progress.plan),
            "totals": [{"steps": t.steps, "samples": t.samples, "compute_s": t.compute_s, "sync_s": t.sync_s,
                        "micro_batch": t.micro_batch} for t in progress.totals],
            "meta_bytes": META_SIZE * 8,
            "bf16_wire": bool(getattr(getattr(strategy, "elche", None), "bf16_wire", False)),
        }
    if isinstance(strategy, PostLocalSGDStrategy):
        averager = ddp_model_averager(strategy)
        record["local_sgd"] = {
            "period": strategy.period,
            "warmup": strategy.warmup,
            "averager_steps": averager.step if averager is not None else None,
            "averagings": strategy.averagings(optimizer_steps(meter.total_steps, record)),
        }
    return record


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_job(ctx: RankContext, job: Job) -> None:
    if job.arm == SOLO_PAIR:
        if ctx.rank in job.setting.solo_ranks(ctx.world, ctx.config.rig.solo_per_rank):
            write_record(ctx.run_dir, job.job_id, ctx.rank, run_solo(ctx, job, as_rank=ctx.rank))
    elif job.arm == SOLO_RANK0:
        if ctx.rank == 0:
            write_record(ctx.run_dir, job.job_id, 0, run_solo(ctx, job, as_rank=0))
    else:
        write_record(ctx.run_dir, job.job_id, ctx.rank, run_multi(ctx, job))
    _release()
    ctx.barrier()


def throttle_ok(ctx: RankContext, job: Job) -> tuple[bool, dict[str, Any]]:
    """Every rank reads every solo record of ``job`` and reaches the same verdict: rank 0's device
    must be at least ``min_slowdown`` times faster than the slowest other solo fit."""
    solo_ranks = job.setting.solo_ranks(ctx.world, ctx.config.rig.solo_per_rank)
    rates = [solo_rate(read_record(ctx.run_dir, job.job_id, r)) for r in solo_ranks]
    slowest = min(rates[1:]) if len(rates) > 1 else rates[0]
    measured = rates[0] / slowest if slowest > 0 else float("inf")
    verdict = {"job": job.job_id, "solo_rates": rates, "solo_ranks": solo_ranks, "measured_slowdown": measured,
               "min_slowdown": ctx.config.min_slowdown}
    return measured >= ctx.config.min_slowdown, verdict


def run_plan(ctx: RankContext, plan: list[Group]) -> int:
    """Every group in order; returns the process exit status."""
    skipped: list[str] = []
    for i, group in enumerate(plan):
        if group.skippable:
            projected = time.time() - ctx.t0 + ctx.durations.get(group.section, 0.0)
            if ctx.agree(projected > ctx.config.budget.deadline_s):
                skipped.append(group.name)
                continue
        started = time.time()
        for job in group.jobs:
            job_started = time.time()
            run_job(ctx, job)
            if ctx.rank == 0:
                print(f"[bench {time.time() - ctx.t0:6.0f} s] group {i + 1}/{len(plan)} {job.job_id}: "
                      f"{time.time() - job_started:.1f} s", flush=True)
            if group.check_throttle and job.arm == SOLO_PAIR and job is group.jobs[0]:
                ok, verdict = throttle_ok(ctx, job)
                if ctx.rank == 0:
                    write_record(ctx.run_dir, "throttle_check", 0, verdict)
                if not ok:
                    return EXIT_THROTTLE
        ctx.durations[group.section] = max(ctx.durations.get(group.section, 0.0), time.time() - started)
    if ctx.rank == 0:
        write_record(ctx.run_dir, "skipped", 0, {"groups": skipped})
    return 0


def pin_process(cpu: int) -> None:
    """Every thread of this process, and each it starts later, runs on ``cpu`` only (``--pin-ranks``)."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), {cpu})


def worker_main(rank: int, config: BenchConfig, plan: list[Group], run_dir: str, port: int, t0: float) -> None:
    """Entry point of a rank process (the target of a ``spawn`` process)."""
    status = 1
    try:
        if config.rank_cpus:
            pin_process(config.rank_cpus[rank])
        _set_rank_environment(rank, port, config.rig.world_size, ranks_as_nodes=config.share_gpu)
        _quiet()
        device, control = _init_process_group(rank, port, config)
        ctx = RankContext(rank, config, run_dir, device, control, t0)
        write_record(run_dir, "device", rank, describe_device(device))
        write_record(run_dir, "micro", rank, microbenchmark(ctx))
        headline = config.headline
        if headline.limited:  # before the plan: the solo fits and the DDP arms need every rank's micro-batch
            ctx.micro_batches, searched = plan_micro_batches(
                ctx.workload(THROUGHPUT), headline.rank_micro_batch or (None,) * ctx.world, headline.rank_memory,
                config.budget.tp_batch, rank, device, control)
            if rank == 0:
                write_record(run_dir, "micro_batch_plan", 0, {"planned": ctx.micro_batches, "searched": searched})
        if rank == 0:
            print(f"[bench {time.time() - t0:6.0f} s] set-up and all-reduce microbenchmark done", flush=True)
        status = run_plan(ctx, plan)
        ctx.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(run_dir, f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    raise SystemExit(status)

"""lightning_elche.pytorch_lightning: every module of lightning_elche, rebuilt on ``pytorch_lightning``."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import lightning.pytorch
import pytest
import pytorch_lightning as pl
from helpers import load_records
from namespace_helpers import PlRecordingModel

import lightning_elche
import lightning_elche.pytorch_lightning as elche_pl
from lightning_elche.pytorch_lightning_mirror import (
    MIRROR_PACKAGE,
    NOT_MIRRORED,
    exec_rewritten,
    leftover_lightning_imports,
    rewrite_source,
)


def source_modules() -> list[str]:
    """Every module and package of lightning_elche found on disk (not a hand list)."""
    names = [info.name for info in pkgutil.walk_packages(lightning_elche.__path__, "lightning_elche.")]
    return sorted(n for n in names if n.split(".")[1] not in NOT_MIRRORED)


def mirror_name(source: str) -> str:
    return MIRROR_PACKAGE + source[len("lightning_elche"):]


def foreign_references(module: ModuleType) -> list[str]:
    """Globals of a mirrored module that belong to the lightning.* namespace or to unmirrored lightning_elche."""
    bad = []
    for key, value in vars(module).items():
        if isinstance(value, ModuleType):
            owner = value.__name__
        elif inspect.isclass(value) or inspect.isfunction(value):
            owner = value.__module__ or ""
        else:
            continue
        top = owner.split(".")[0]
        if top == "lightning" or (top == "lightning_elche" and not owner.startswith(MIRROR_PACKAGE)
                                  and owner != "lightning_elche"):
            bad.append(f"{key} -> {owner}")
    return bad


def test_the_module_walk_sees_the_package() -> None:
    names = source_modules()
    # A walk that found nothing would let the coverage test below pass vacuously.
    for expected in ("lightning_elche.strategy", "lightning_elche.monitor", "lightning_elche.monitor.callback",
                     "lightning_elche.planes.cpu"):
        assert expected in names


@pytest.mark.parametrize("name", source_modules())
def test_every_module_is_mirrored_onto_pytorch_lightning(name: str) -> None:
    mirrored = importlib.import_module(mirror_name(name))
    original_file = Path(importlib.util.find_spec(name).origin)
    assert Path(mirrored.__file__) == original_file, "the mirror must run the original file's source"
    assert foreign_references(mirrored) == []
    assert leftover_lightning_imports(rewrite_source(original_file.read_text())) == []


def test_mirror_classes_are_pytorch_lightning_classes() -> None:
    from lightning_elche.pytorch_lightning.testing import Throttle

    assert issubclass(elche_pl.ElCheStrategy, pl.strategies.DDPStrategy)
    assert not issubclass(elche_pl.ElCheStrategy, lightning.pytorch.strategies.DDPStrategy)
    assert issubclass(elche_pl.ElCheCheckpoint, pl.callbacks.ModelCheckpoint)
    for callback in (elche_pl.ElCheMonitor, elche_pl.EpochCallbacks, Throttle):
        assert issubclass(callback, pl.Callback) and not issubclass(callback, lightning.pytorch.Callback)
    # The default namespace is untouched.
    assert issubclass(lightning_elche.ElCheStrategy, lightning.pytorch.strategies.DDPStrategy)
    assert not issubclass(lightning_elche.ElCheStrategy, pl.strategies.DDPStrategy)
    assert elche_pl.ElCheStrategy is not lightning_elche.ElCheStrategy
    # Plain-Python classes are rebuilt too: one namespace's objects are never the other's.
    assert elche_pl.ElCheConfig is not lightning_elche.ElCheConfig
    assert sorted(elche_pl.__all__) == sorted(lightning_elche.__all__)
    for name in elche_pl.__all__:
        assert hasattr(elche_pl, name), name


def test_the_mirrored_dashboard_reads_the_package_data() -> None:
    # The page's HTML, CSS and JavaScript are package data of lightning_elche.monitor; the mirrored
    # package must find them through importlib.resources too.
    from lightning_elche.pytorch_lightning.monitor import dashboard as mirrored

    from lightning_elche.monitor import dashboard

    data = dashboard.dashboard_data([{"kind": "meta", "world_size": 2, "config": {"mode": "cpu_cadence"}}])
    page = mirrored.render_dashboard(data, "dark")
    assert page == dashboard.render_dashboard(data, "dark")
    assert '<html lang="en" data-theme="dark">' in page and ":root[data-theme=dark]{" in page
    assert 'document.body.setAttribute("data-ready", "1")' in page


def test_registered_names_resolve_to_the_namespace_of_the_trainer() -> None:
    assert "elche" in pl.strategies.StrategyRegistry and "elche_cpu_cadence" in pl.strategies.StrategyRegistry
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="elche_cpu_cadence", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    assert type(trainer.strategy) is elche_pl.ElCheStrategy
    assert str(trainer.strategy.elche.mode.value) == "cpu_cadence"
    trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=2, strategy="elche", logger=False,
                                        enable_checkpointing=False, enable_progress_bar=False)
    assert type(trainer.strategy) is lightning_elche.ElCheStrategy


def test_the_mirror_package_is_importable_first_in_a_fresh_process() -> None:
    # What a pytorch_lightning user's script does, with nothing imported before.
    code = (
        "import pytorch_lightning as pl\n"
        "from lightning_elche.pytorch_lightning import ElCheStrategy\n"
        "from lightning_elche.pytorch_lightning.monitor.callback import ElCheMonitor\n"
        "assert issubclass(ElCheStrategy, pl.strategies.DDPStrategy)\n"
        "assert issubclass(ElCheMonitor, pl.Callback)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(("line", "expected"), [
    ("from lightning.pytorch import Trainer", "from pytorch_lightning import Trainer"),
    ("import lightning.pytorch as pl", "import pytorch_lightning as pl"),
    ("from lightning.fabric.plugins import CheckpointIO", "from lightning_fabric.plugins import CheckpointIO"),
    ("    import lightning", "    import pytorch_lightning as lightning"),
    ("from lightning import seed_everything", "from pytorch_lightning import seed_everything"),
    ("from lightning_elche.engine import ElCheEngine",
     "from lightning_elche.pytorch_lightning.engine import ElCheEngine"),
    ("x = 'lightning_elche.pytorch_lightning'", "x = 'lightning_elche.pytorch_lightning'"),
    ("import lightning_elche_extras", "import lightning_elche_extras"),
    ("from pytorch_lightning import Trainer", "from pytorch_lightning import Trainer"),
    ("y = my.lightning.pytorch", "y = my.lightning.pytorch"),
])
def test_rewrite_maps_imports(line: str, expected: str) -> None:
    assert rewrite_source(line) == expected


def test_an_unmappable_lightning_import_is_refused_naming_module_and_line(tmp_path: Path) -> None:
    source = tmp_path / "user_module.py"
    source.write_text("import os\n\n\ndef f():\n    import lightning as L\n")
    with pytest.raises(ImportError, match=r"user_module.*line\(s\) \[5\].*'lightning' package"):
        exec_rewritten(str(source), {"__name__": "lightning_elche.pytorch_lightning.user_module"})
    assert leftover_lightning_imports(rewrite_source("import lightning\nfrom lightning.pytorch import X\n")) == []


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_rank_fit_with_pytorch_lightning_trainer(tmp_path: Path) -> None:
    from lightning_elche.pytorch_lightning.testing import Throttle

    records_dir, monitor_dir, ckpt_dir = tmp_path / "records", tmp_path / "monitor", tmp_path / "ckpt"
    records_dir.mkdir()
    pl.seed_everything(0, verbose=False)
    strategy = elche_pl.ElCheStrategy(mode="cpu_cadence", start_method="spawn", timeout=timedelta(seconds=30))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2,
        callbacks=[Throttle(1, 3.0), elche_pl.ElCheMonitor(record_log_dir=str(monitor_dir)),
                   elche_pl.ElCheCheckpoint(dirpath=str(ckpt_dir), every_n_syncs=2, save_top_k=-1)],
        logger=pl.loggers.CSVLogger(str(tmp_path), name="logs"),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(PlRecordingModel(str(records_dir)))
    r0, r1 = load_records(records_dir)
    assert r0["strategy"] == r1["strategy"] == "lightning_elche.pytorch_lightning.strategy.ElCheStrategy"
    for epoch in ("0", "1"):
        assert sorted(r0["seen"][epoch] + r1["seen"][epoch]) == list(range(256)), f"epoch {epoch}"
    assert r0["params"] == r1["params"], "replicas differ after fit"
    assert r0["rounds"] == r1["rounds"] > 0 and r0["steps"] == r1["steps"]
    assert r0["val_loss"] == r1["val_loss"]
    assert list(ckpt_dir.glob("*.ckpt")), "ElCheCheckpoint saved nothing"
    meta = json.loads((monitor_dir / "rank0.jsonl").read_text().splitlines()[0])
    assert pl.__version__ in json.dumps(meta)

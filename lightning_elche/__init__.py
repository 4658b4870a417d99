"""lightning-elche: heterogeneity-aware local SGD for PyTorch Lightning (flodl's ElChe).

``Trainer(strategy=ElCheStrategy(...))`` or, after ``import lightning_elche``, the registered
names ``"elche"`` and ``"elche_<mode>"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_elche.augment import AugmentedDataset, PickKey
from lightning_elche.checkpointing import ElCheCheckpoint
from lightning_elche.config import ElCheConfig, ElCheMode
from lightning_elche.epoch_callbacks import EpochCallbacks
from lightning_elche.guard import (
    ConvergenceGuard,
    DivergenceReport,
    GrowthGuard,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
)
from lightning_elche.meta import MetaController
from lightning_elche.monitor import ElCheMonitor
from lightning_elche.outer import DiLoCo, OuterAvg, OuterOptimizer, SlowMo
from lightning_elche.strategy import ElCheStrategy
from lightning_elche.version import __version__

__all__ = [
    "AugmentedDataset",
    "ConvergenceGuard",
    "DiLoCo",
    "DivergenceReport",
    "ElCheCheckpoint",
    "ElCheConfig",
    "ElCheMode",
    "ElCheMonitor",
    "ElCheStrategy",
    "EpochCallbacks",
    "GrowthGuard",
    "MetaController",
    "NoGuard",
    "NudgeDown",
    "OuterAvg",
    "OuterOptimizer",
    "PickKey",
    "SlowMo",
    "Stable",
    "SuppressGrowth",
    "TrendGuard",
    "__version__",
]

ElCheStrategy.register_strategies(StrategyRegistry)

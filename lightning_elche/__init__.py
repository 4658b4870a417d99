"""lightning-elche: heterogeneity-aware local SGD for PyTorch Lightning (flodl's ElChe).

``Trainer(strategy=ElCheStrategy(...))`` or, after ``import lightning_elche``, the registered
names ``"elche"`` and ``"elche_<mode>"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_elche.config import ElCheConfig, ElCheMode
from lightning_elche.guard import NudgeDown, Stable, SuppressGrowth
from lightning_elche.strategy import ElCheStrategy

__version__ = "0.1.0"

__all__ = [
    "ElCheConfig",
    "ElCheMode",
    "ElCheStrategy",
    "NudgeDown",
    "Stable",
    "SuppressGrowth",
    "__version__",
]

ElCheStrategy.register_strategies(StrategyRegistry)

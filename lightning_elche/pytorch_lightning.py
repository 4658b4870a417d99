"""lightning-elche for ``import pytorch_lightning as pl`` users.

Lightning refuses a strategy, callback or module from the other of its two namespaces, so this
package serves every ``lightning_elche`` module again, built on ``pytorch_lightning`` (see
:mod:`lightning_elche.pytorch_lightning_mirror` for how)::

    import pytorch_lightning as pl
    from lightning_elche.pytorch_lightning import ElCheCheckpoint, ElCheMonitor, ElCheStrategy

    trainer = pl.Trainer(strategy=ElCheStrategy(mode="cpu_cadence"), callbacks=[ElCheMonitor()])

Importing it also registers ``strategy="elche"`` and ``"elche_<mode>"`` in ``pytorch_lightning``'s
StrategyRegistry. Needs the ``pytorch-lightning`` package: ``pip install lightning-elche[pytorch-lightning]``.
"""

import sys

from lightning_elche.pytorch_lightning_mirror import exec_package_init, install

install()
# Submodules (lightning_elche.pytorch_lightning.strategy, ...) come from lightning_elche's own
# directories through the finder that install() put first on sys.meta_path.
__path__ = list(sys.modules["lightning_elche"].__path__)
_doc = __doc__
exec_package_init(globals())
__doc__ = _doc
del _doc, sys, exec_package_init, install

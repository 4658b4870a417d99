"""LightningCLI entry point for the lightning-elche example model and data.

Two CPU ranks with ElChe's ``nccl_cadence`` mode (gloo on CPU, NCCL on GPUs)::

    python examples/train.py fit --config examples/configs/nccl_cadence.yaml

The strategy can also be named by its registered string (``import lightning_elche`` registers
``elche`` and ``elche_<mode>``)::

    python examples/train.py fit --config examples/configs/nccl_cadence.yaml --trainer.strategy=elche_nccl_sync

Print the fully resolved configuration (it can be fed back with ``--config``)::

    python examples/train.py fit --config examples/configs/nccl_cadence.yaml --print_config > run.yaml

The launcher re-executes this script for rank 1, so run it from a shell, not from inside pytest.
"""

from __future__ import annotations

from demo_models import DemoDataModule, DemoModel
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_elche  # noqa: F401  (registers the "elche" and "elche_<mode>" strategy names)


class DemoCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The model's input and output sizes follow the data.
        parser.link_arguments("data.num_features", "model.num_features")
        parser.link_arguments("data.num_classes", "model.num_classes")


def main() -> None:
    DemoCLI(DemoModel, DemoDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()

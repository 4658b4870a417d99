"""The case registry and what a case sees inside a rank process (see the package's docstring)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
FEW_MODES = ("nccl_sync", "nccl_cadence", "cpu_async")
"""The modes of the default run for cases whose behaviour does not depend on the mode (the rest
of MODES runs under ``-m lightning_suite_full``). One lockstep mode, one cadence mode on the
default group, the non-blocking host mode."""
PG_TIMEOUT = timedelta(seconds=30)

Kind = Literal["passes", "refused", "deviation"]


@dataclass(frozen=True)
class Case:
    """One ported Lightning test (or one parametrization of it)."""

    name: str
    origin: str
    """Lightning's file (under ``tests/tests_pytorch/``) and test name, with the parameters."""
    kind: Kind
    modes: tuple[str, ...]
    run: Callable[[Context], None]
    note: str = ""
    """For refusals and deviations: what ElChe does instead (the docs' table repeats it)."""


@dataclass
class Suite:
    """The cases of one ported module, in the order a launch runs them."""

    name: str
    cases: dict[str, Case] = field(default_factory=dict)

    def case(self, origin: str, kind: Kind = "passes", modes: tuple[str, ...] = FEW_MODES, note: str = "",
             name: Optional[str] = None) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
        def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
            self.add(name or fn.__name__, origin, kind, modes, fn, note)
            return fn

        return register

    def add(self, name: str, origin: str, kind: Kind, modes: tuple[str, ...], fn: Callable[[Context], None],
            note: str = "") -> None:
        assert name not in self.cases, f"duplicate case {name} in suite {self.name}"
        assert kind == "passes" or note, f"case {name}: a refusal or a deviation says what ElChe does instead"
        assert set(modes) <= set(MODES), modes
        self.cases[name] = Case(name, origin, kind, modes, fn, note)


@dataclass
class Context:
    """What a case gets on its rank: the mode, the rank, a directory shared by both ranks, and
    factories for the strategy and the Trainer with the suite's defaults."""

    mode: str
    rank: int
    world_size: int
    tmp_path: Path
    barrier: Callable[[str], None]

    def strategy(self, **kwargs: Any) -> Any:
        from lightning_elche import ElCheStrategy

        kwargs.setdefault("timeout", PG_TIMEOUT)
        kwargs.setdefault("snapshot_timeout", PG_TIMEOUT)
        kwargs.setdefault("summary", False)
        return ElCheStrategy(mode=self.mode, **kwargs)

    def trainer(self, strategy: Any = None, **kwargs: Any) -> Any:
        """Lightning's ``Trainer(default_root_dir=tmp_path, ...)`` as its tests build it, on 2 CPU
        ranks under ElChe; the model summary and the progress bar are off unless asked for."""
        from lightning.pytorch import Trainer

        kwargs.setdefault("default_root_dir", self.tmp_path)
        kwargs.setdefault("enable_model_summary", False)
        kwargs.setdefault("enable_progress_bar", False)
        return Trainer(accelerator="cpu", devices=self.world_size, strategy=strategy or self.strategy(), **kwargs)

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @contextmanager
    def raises(self, exception: type[BaseException], match: str) -> Iterator[None]:
        """``pytest.raises`` for a rank process: the case fails unless the block raises ``exception``
        whose message matches ``match`` (a regular expression, searched)."""
        try:
            yield
        except exception as error:
            assert re.search(match, str(error)), f"{type(error).__name__}: {error!s} does not match {match!r}"
            return
        raise AssertionError(f"expected {exception.__name__} matching {match!r}; nothing was raised")

    @contextmanager
    def warns(self, category: type[Warning], match: str, every_rank: bool = False) -> Iterator[None]:
        """``pytest.warns`` for a rank process. Lightning's warnings are rank-zero warnings, so by
        default only rank 0 checks (every rank runs the block)."""
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        if not (every_rank or self.is_global_zero):
            return
        messages = [str(w.message) for w in caught if issubclass(w.category, category)]
        assert any(re.search(match, m) for m in messages), f"no {category.__name__} matching {match!r} in {messages}"

"""The import hook behind :mod:`lightning_elche.pytorch_lightning`.

Lightning ships one implementation under two names: its ``pytorch_lightning`` package is generated
from the ``lightning.pytorch`` sources by rewriting their imports. This module does the same for
lightning-elche, at import time instead of at build time: a meta-path finder serves every module
``lightning_elche.pytorch_lightning.<name>`` from the source file of ``lightning_elche.<name>``
with these rewrites applied (line numbers are kept, so tracebacks point at the real source lines):

- ``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``;
- ``import lightning`` -> ``import pytorch_lightning as lightning`` (only ``__version__`` is read
  from it) and ``from lightning import`` -> ``from pytorch_lightning import``;
- ``lightning_elche`` -> ``lightning_elche.pytorch_lightning``, so the mirrored modules import each
  other and never the ``lightning.pytorch`` originals.

Nothing is listed by hand: a module added to ``lightning_elche`` is mirrored as soon as it exists.
A mirrored source that still names the ``lightning`` package in a form the rewrite cannot map is
refused with an ImportError naming the module and the line, rather than silently mixing namespaces.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.readers
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Optional

SOURCE_PACKAGE = "lightning_elche"
MIRROR_PACKAGE = "lightning_elche.pytorch_lightning"
# Modules of SOURCE_PACKAGE that implement the mirror itself and are not mirrored.
NOT_MIRRORED = frozenset({"pytorch_lightning", "pytorch_lightning_mirror"})

_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?<![\w.])lightning\.pytorch(?!\w)"), "pytorch_lightning"),
    (re.compile(r"(?<![\w.])lightning\.fabric(?!\w)"), "lightning_fabric"),
    (re.compile(r"^(\s*)import lightning[ \t]*$", re.MULTILINE), r"\1import pytorch_lightning as lightning"),
    (re.compile(r"^(\s*)from lightning import ", re.MULTILINE), r"\1from pytorch_lightning import "),
    (re.compile(r"(?<![\w.])lightning_elche(?!\w)(?!\.pytorch_lightning(?!\w))"), MIRROR_PACKAGE),
)
# What may remain after the rewrite and would still load the ``lightning`` package.
_LEFTOVER = re.compile(r"^[ \t]*(?:import\s+lightning(?![\w])|from\s+lightning(?:\.|\s+import))", re.MULTILINE)


def rewrite_source(source: str) -> str:
    """The source of a ``lightning_elche`` module rewritten onto ``pytorch_lightning`` (same line count)."""
    for pattern, replacement in _REWRITES:
        source = pattern.sub(replacement, source)
    return source


def leftover_lightning_imports(source: str) -> list[int]:
    """1-based line numbers of a rewritten source that would still import the ``lightning`` package."""
    return [source.count("\n", 0, match.start()) + 1 for match in _LEFTOVER.finditer(source)]


def source_name(mirror_name: str) -> str:
    """``lightning_elche.pytorch_lightning.x.y`` -> ``lightning_elche.x.y``."""
    return SOURCE_PACKAGE + mirror_name[len(MIRROR_PACKAGE):]


def exec_rewritten(origin: str, namespace: dict[str, object]) -> None:
    """Runs the rewritten source of the file ``origin`` in ``namespace`` (a module's globals)."""
    name = namespace["__name__"]
    source = rewrite_source(Path(origin).read_text(encoding="utf-8"))
    leftovers = leftover_lightning_imports(source)
    if leftovers:
        raise ImportError(
            f"{name}: {origin} line(s) {leftovers} import the 'lightning' package in a form the "
            f"{MIRROR_PACKAGE} rewrite does not map; import from lightning.pytorch / lightning.fabric "
            "(or 'import lightning' alone, for its __version__).",
            name=str(name),
        )
    exec(compile(source, origin, "exec", dont_inherit=True), namespace)


class _MirrorLoader(importlib.abc.Loader):
    """Executes the rewritten source of one ``lightning_elche`` file as the mirrored module.

    No bytecode is cached: a cache keyed by the original file would be shared with the original
    module and could hand one namespace's code to the other.
    """

    def __init__(self, file_loader: importlib.machinery.SourceFileLoader) -> None:
        self.file_loader = file_loader  # the path finder's loader of the original file, under the mirrored name
        self.origin = file_loader.path

    def get_resource_reader(self, fullname: str) -> importlib.readers.FileReader:
        # A mirrored package's data files are the original package's (importlib.resources.files).
        return self.file_loader.get_resource_reader(fullname)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None  # the default module object

    def get_source(self, fullname: str) -> str:
        return rewrite_source(Path(self.origin).read_text(encoding="utf-8"))

    def exec_module(self, module: ModuleType) -> None:
        exec_rewritten(self.origin, module.__dict__)


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_elche.pytorch_lightning.*`` modules in ``lightning_elche``'s own directories.

    Mirrored packages carry the original directories as ``__path__``, so the ``path`` the import
    system hands over already points at the original files. The finder must sit before the default
    path finder, which would otherwise load an original file unchanged under the mirrored name.
    """

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None,
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(MIRROR_PACKAGE + "."):
            return None
        leaf = fullname.rpartition(".")[2]
        if fullname.count(".") == MIRROR_PACKAGE.count(".") + 1 and leaf in NOT_MIRRORED:
            raise ModuleNotFoundError(f"{fullname}: {source_name(fullname)} implements the mirror and is not mirrored",
                                      name=fullname)
        original = importlib.machinery.PathFinder.find_spec(fullname, path)
        if original is None or original.origin is None or not original.origin.endswith(".py"):
            return None
        if not isinstance(original.loader, importlib.machinery.SourceFileLoader):
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, _MirrorLoader(original.loader), origin=original.origin,
            is_package=original.submodule_search_locations is not None,
        )
        if original.submodule_search_locations is not None:
            spec.submodule_search_locations = list(original.submodule_search_locations)
        spec.has_location = True  # sets __file__ to the original file: Path(__file__) lookups keep working
        return spec


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, MirrorFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder())


def exec_package_init(namespace: dict[str, object]) -> None:
    """Runs the rewritten ``lightning_elche/__init__.py`` in the mirror package's namespace."""
    spec = sys.modules[SOURCE_PACKAGE].__spec__
    if spec is None or spec.origin is None:
        raise ImportError(f"{MIRROR_PACKAGE}: {SOURCE_PACKAGE} has no source file to mirror", name=MIRROR_PACKAGE)
    exec_rewritten(spec.origin, namespace)

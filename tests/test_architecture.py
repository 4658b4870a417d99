"""The package's shape: one module owns Lightning's internals, and the import graph has no cycle."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import lightning
import pytest

from lightning_elche import loop_glue

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_elche"
DOOR = PACKAGE / "loop_glue.py"
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names_defined_in(root: Path) -> set[str]:
    """Every private method, attribute and class variable a package defines."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
    return names


LIGHTNING_PRIVATE = _private_names_defined_in(Path(lightning.__file__).parent)


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != DOOR)


def _own_attributes(tree: ast.Module) -> set[str]:
    """Private methods this file defines and private names it sets on ``self`` (either may
    collide with a Lightning name)."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            own.update(f.name for f in node.body if isinstance(f, ast.FunctionDef) and _is_private(f.name))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            own.add(node.attr)
    return own


def _lightning_instance_attributes(module_name: str) -> set[str]:
    """Private attributes the Lightning base classes of this module's classes define themselves."""
    module = importlib.import_module(module_name)
    inherited: set[str] = set()
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name:
            continue
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith("lightning."):
                continue
            inherited.update(name for name in vars(base) if _is_private(name))
            try:
                source = inspect.getsource(base)
            except (OSError, TypeError):
                continue
            inherited.update(re.findall(r"self\.(_[a-zA-Z]\w*)\s*(?::[^=\n]+)?=", source))
    return inherited


def private_lightning_uses(path: Path) -> list[str]:
    """``file:line: expression`` for every use of a private Lightning name in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = _own_attributes(tree)
    if path.is_relative_to(PACKAGE):
        # A name our own object sets on itself is ours, unless a Lightning base class defines it too.
        own -= _lightning_instance_attributes(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if _is_private(a.name)]
            if any(_is_private(part) for part in (node.module or "").split(".")):
                found.append(f"{path.name}:{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in LIGHTNING_PRIVATE:
            receiver_is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not (receiver_is_self and node.attr in own):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_CALLS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in LIGHTNING_PRIVATE
        ):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_loop_glue_touches_private_lightning_names():
    uses = [use for path in _package_files() for use in private_lightning_uses(path)]
    assert uses == [], "private Lightning names outside lightning_elche/loop_glue.py:\n" + "\n".join(uses)


def test_the_private_name_scan_finds_each_kind_of_use(tmp_path):
    # The scan must be able to fail: one of each kind of private use, in a throwaway module.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from lightning.pytorch.utilities.data import _update_dataloader\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._strategy = None  # our own attribute, though Lightning uses the name too\n"
        "    def f(self, trainer, strategy):\n"
        "        trainer.fit_loop._can_stop_early\n"
        "        return getattr(strategy, '_layer_sync', self._strategy)\n",
        encoding="utf-8",
    )
    uses = private_lightning_uses(probe)
    assert [u.split(": ", 1)[1] for u in uses] == [
        "import _update_dataloader",
        "trainer.fit_loop._can_stop_early",
        "getattr(strategy, '_layer_sync', self._strategy)",
    ]


def _imports_of(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports, at module level or inside functions."""
    package = PACKAGE.name
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        module = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith(package):
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(package))
    return found


def _module_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports_of(path)
    # An import of a package means its __init__; keep only edges to modules that exist.
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a path that returns to its start), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_package_modules_import_no_cycle():
    # Packages (__init__) re-export their modules; edges into a package's own __init__ from its
    # submodules are not cycles of meaning, so only module-to-module edges are checked.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in _module_graph().items()}
    assert "lightning_elche.strategy" in graph and graph["lightning_elche.strategy"]
    assert find_cycle(graph) == []


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_supported_lightning_range_is_the_one_pyproject_declares():
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"lightning{loop_glue.SUPPORTED_LIGHTNING}"' in pyproject
    loop_glue.check_lightning_version()  # the installed version is inside it


@pytest.mark.parametrize("version", ["2.5.3", "2.7.0", "3.0.0", "nightly"])
def test_lightning_outside_the_supported_range_is_refused(version):
    expected = rf"supports lightning>=2\.6,<2\.7; this environment has lightning {version}"
    with pytest.raises(RuntimeError, match=expected):
        loop_glue.check_lightning_version(version)


# -- survival has one home -----------------------------------------------------------------------

SURVIVAL_CALLS = ("shrink_group", "destroy_process_group", "init_process_group")  # and os.kill
SURVIVAL_HOME = PACKAGE / "membership"
# The benchmark starts its own worker processes and groups for its comparison arms; no fit runs it.
NOT_A_FIT = PACKAGE / "bench"


def survival_calls_in(path: Path) -> list[str]:
    """``line: call`` for every call of a process-killing or process-group-rebuilding function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in SURVIVAL_CALLS or ast.unparse(node.func) == "os.kill":
                found.append(f"{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_fencing_and_process_group_surgery_live_in_the_membership_package_only():
    calls = [
        f"{path.relative_to(PACKAGE.parent)}:{call}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not (path.is_relative_to(SURVIVAL_HOME) or path == DOOR or path.is_relative_to(NOT_A_FIT))
        for call in survival_calls_in(path)
    ]
    assert calls == [], "fencing or process-group surgery outside lightning_elche/membership/:\n" + "\n".join(calls)


def test_the_survival_scan_finds_each_kind_of_call(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import os, torch.distributed as dist\nos.kill(1, 9)\ndist.destroy_process_group()\n"
                      "dist.init_process_group('gloo')\ndist.distributed_c10d.shrink_group([1])\n")
    assert [c.split(": ", 1)[1] for c in survival_calls_in(module)] == [
        "os.kill", "dist.destroy_process_group", "dist.init_process_group", "dist.distributed_c10d.shrink_group"]

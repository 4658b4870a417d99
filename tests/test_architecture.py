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
DOOR = PACKAGE / "loop_glue"
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
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.is_relative_to(DOOR))


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
    assert uses == [], "private Lightning names outside lightning_elche/loop_glue/:\n" + "\n".join(uses)


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


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")


def _imported_modules(path: Path, module: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` whose body an import statement of ``path`` needs, each named as the
    statement names it: ``from a.b import c`` needs ``a.b.c`` when that is a module, else ``a.b``
    (its ``__init__`` defines ``c``). At module level or inside functions."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """What runs before what at import: ``m -> d`` when executing ``m`` needs ``d`` executed.

    Importing ``a.b.c`` executes ``a/__init__``, ``a/b/__init__`` and ``a/b/c``: each is an edge, and
    a package's ``__init__`` is a node with its own imports. The packages above ``m`` itself are
    skipped on the way down (Python runs them before ``m``), but not as the module an import
    names: ``from a import x`` in ``a/b.py`` needs ``a/__init__`` to have defined ``x``.
    """
    modules = {_module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        parts = module.split(".")
        above = {".".join(parts[:i]) for i in range(1, len(parts))}
        deps: set[str] = set()
        for target in _imported_modules(path, module, set(modules)):
            names = target.split(".")
            for i in range(1, len(names) + 1):
                step = ".".join(names[:i])
                if step in modules and not (i < len(names) and step in above):
                    deps.add(step)
        graph[module] = deps - {module}
    return graph


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
    graph = module_graph()
    assert "lightning_elche.strategy" in graph and graph["lightning_elche.strategy"]
    # The edges into packages' __init__ are seen: the root runs the monitor, the monitor its callback.
    assert "lightning_elche.monitor" in graph["lightning_elche"]
    assert "lightning_elche.monitor.callback" in graph["lightning_elche.monitor"]
    assert find_cycle(graph) == []


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source, encoding="utf-8")
    return root / "pkg"


def test_the_cycle_scan_sees_imports_into_a_package_init(tmp_path):
    # Two cycles that run only through an __init__, each one the scan must find.
    pkg = _write_package(tmp_path, {
        # the root re-exports a module that reads a name back from the root
        "pkg/__init__.py": "from pkg.sub.reader import thing\nVERSION = '1'\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/reader.py": "def thing():\n    from pkg import VERSION\n    return VERSION\n",
        # importing pkg.tool.leaf runs pkg/tool/__init__, which imports the importer back
        "pkg/user.py": "import pkg.tool.leaf\n",
        "pkg/tool/__init__.py": "from pkg.user import *\n",
        "pkg/tool/leaf.py": "from pkg.sub import reader\n",
    })
    graph = module_graph(pkg)
    assert graph["pkg.sub.reader"] == {"pkg"}, "a name read from the root is an edge into its __init__"
    assert graph["pkg.user"] == {"pkg.tool", "pkg.tool.leaf"}, "the __init__ on the way to a module is an edge"
    assert graph["pkg.tool.leaf"] == {"pkg.sub.reader", "pkg.sub"}, "a package above the module is not"
    assert find_cycle(graph) == ["pkg", "pkg.sub.reader", "pkg"]
    del graph["pkg.sub.reader"]
    assert find_cycle(graph) == ["pkg.tool", "pkg.user", "pkg.tool"]
    # The same package with the name in a module of its own (what lightning_elche.version is): no cycle.
    (pkg / "version.py").write_text("VERSION = '1'\n", encoding="utf-8")
    (pkg / "sub" / "reader.py").write_text("def thing():\n    from pkg.version import VERSION\n    return VERSION\n")
    (pkg / "tool" / "__init__.py").write_text("")
    assert find_cycle(module_graph(pkg)) == []


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
        if not (path.is_relative_to(SURVIVAL_HOME) or path.is_relative_to(DOOR) or path.is_relative_to(NOT_A_FIT))
        for call in survival_calls_in(path)
    ]
    assert calls == [], "fencing or process-group surgery outside lightning_elche/membership/:\n" + "\n".join(calls)


def test_the_survival_scan_finds_each_kind_of_call(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import os, torch.distributed as dist\nos.kill(1, 9)\ndist.destroy_process_group()\n"
                      "dist.init_process_group('gloo')\ndist.distributed_c10d.shrink_group([1])\n")
    assert [c.split(": ", 1)[1] for c in survival_calls_in(module)] == [
        "os.kill", "dist.destroy_process_group", "dist.init_process_group", "dist.distributed_c10d.shrink_group"]


def test_triton_kernel_sources_annotate_nothing_but_constexpr():
    # Triton resolves a kernel parameter's annotation as a global of the kernel: anything but
    # ``tl.constexpr`` fails to compile on the GPU, which CI does not have.
    tree = ast.parse((PACKAGE / "planes" / "fused.py").read_text(encoding="utf-8"))
    sources = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.endswith("_source")]
    assert sources, "no kernel source found in planes/fused.py"
    for source in sources:
        annotations = [ast.unparse(arg.annotation) for arg in source.args.args if arg.annotation is not None]
        assert set(annotations) <= {"tl.constexpr"}, (source.name, annotations)
        assert source.returns is None, source.name


def test_one_optional_style():
    # ``Optional[X]`` throughout (``X | None`` nowhere), in annotations and in aliases alike.
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr) and any(
                isinstance(side, ast.Constant) and side.value is None for side in (node.left, node.right)
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert found == [], "write Optional[X]:\n" + "\n".join(found)


def test_modules_stay_small_and_the_strategy_an_adapter():
    # Module size is where a room starts doing two jobs; the benchmark's rigs are exempt.
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for path in PACKAGE.rglob("*.py") if not path.is_relative_to(PACKAGE / "bench")}
    assert {name: n for name, n in sizes.items() if n > 600} == {}
    assert sizes["strategy.py"] <= 500, sizes["strategy.py"]


def test_lightning_hooks_of_the_strategy_are_marked_override():
    # A hook Lightning renames must fail the type check, not become a dead method.
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_elche import ElCheStrategy

    classes = [("strategy.py", "ElCheStrategy"), ("elastic_ddp.py", "ElasticDDPStrategy")]
    bodies = []
    for module, name in classes:
        tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
        bodies += next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name).body
    unmarked, hooks = [], 0
    for item in bodies:
        if isinstance(item, ast.FunctionDef) and hasattr(DDPStrategy, item.name) and item.name != "__init__":
            hooks += 1
            decorators = {ast.unparse(d) for d in item.decorator_list}
            if "override" not in decorators and not item.name.startswith("__"):
                unmarked.append(item.name)
    assert unmarked == [] and hooks >= 10, (unmarked, hooks)
    assert ElCheStrategy.strategy_name == "elche"

"""The house's layers, enforced: plan <- runtime <- API <- profiling / training; graphs on plan only; no circles;
the plan layer without torch; functions that fit on a screen.

Every ``import`` statement of ``engine/`` and ``graphs/`` (module level and inside functions alike) is read with
``ast`` and resolved to a module; each module belongs to one layer, and each layer may import only the layers
listed for it (imports under ``if TYPE_CHECKING:`` never run and are not counted).  The imports form no cycle:
neither the module-level ones nor those with the imports inside functions (lazy imports) added; importing ``a.b.c`` runs the packages ``a`` and ``a.b`` first (their
``__init__``), so in the cycle check each import also counts as one of those parent packages that the importing
module is not inside.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = {"engine", "engine.schedules", "engine.parallel_state", "engine.model_parallel_config", "engine.microbatch",
       "engine.model_split", "engine.finalize"}
ALLOWED = {  # layer -> layers it may import
    "plan": {"plan"},
    "runtime": {"plan", "runtime"},
    "api": {"plan", "runtime", "api"},
    "graphs": {"plan", "graphs"},
    "profiling": {"plan", "runtime", "api", "profiling"},
    "training": {"plan", "runtime", "api", "profiling", "graphs", "training"},
    "cli": {"plan", "runtime", "api", "profiling", "graphs", "training", "cli"},
}
MAX_FUNCTION_LINES = 60


def layer_of(module: str) -> str | None:
    if module == "engine.cli":
        return "cli"
    if module in API or module == "engine.moe" or module.startswith("engine.moe."):
        return "api"
    for prefix, layer in (("engine.plan", "plan"), ("engine.runtime", "runtime"), ("engine.profiling", "profiling"),
                          ("engine.training", "training"), ("graphs", "graphs")):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _modules():
    for path in sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "graphs").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        yield ".".join(parts), path, rel.name == "__init__"


def _with_parents(module: str, target: str) -> list[str]:
    """``target`` and the packages above it that importing it runs first (``a.b`` for ``a.b.c``), leaving out the
    packages ``module`` itself lies in (they ran before ``module``)."""
    parts = target.split(".")
    parents = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [target] + [p for p in parents if not (module == p or module.startswith(p + ".")) and _is_module(p)]


def _imports(module: str, path: Path, is_package: bool):
    """``(imported module, line, at module level)`` for every import of ``module``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    package = module if is_package else module.rpartition(".")[0]
    skipped = _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if layer_of(full) and _is_module(full) else base), node.lineno, id(node) in top


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (annotations only: its imports never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_module_has_a_layer():
    assert [m for m, _, _ in _modules() if layer_of(m) is None] == []


def test_no_import_runs_against_the_layering():
    wrong = []
    for module, path, is_package in _modules():
        mine = layer_of(module)
        for target, line, _ in _imports(module, path, is_package):
            theirs = layer_of(target)
            if theirs is not None and theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} module {module} imports {theirs} {target}")
    assert wrong == []


def import_graph(*, lazy: bool, extra: dict | None = None) -> dict[str, set[str]]:
    """``module -> the project modules it imports`` (with the parent packages each import runs,
    :func:`_with_parents`): module-level imports, and with ``lazy`` also the imports inside functions (they run later, but a circle through them is still a circle in the design).  ``extra``: planted
    edges for the negative controls."""
    edges = {}
    for module, path, is_package in _modules():
        edges[module] = {p for t, _, top in _imports(module, path, is_package) if (top or lazy) and layer_of(t)
                         for p in _with_parents(module, t)}
    for module, targets in (extra or {}).items():
        edges.setdefault(module, set()).update(targets)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of ``edges`` meets (each as ``[m, ..., m]``); a module importing its own
    package (the package's ``__init__``) is not one."""
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if t == m or (m.startswith(t + ".") and t in edges):  # a package's own __init__ while importing it
                continue
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t] if t in stack else [m, t])
            elif state.get(t) is None:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(edges):
        if state.get(m) is None:
            visit(m, [m])
    return cycles


def test_module_level_imports_have_no_cycle():
    assert find_cycles(import_graph(lazy=False)) == []


def test_imports_inside_functions_have_no_cycle_either():
    assert find_cycles(import_graph(lazy=True)) == []


def test_the_cycle_check_catches_a_planted_lazy_circle(tmp_path):
    """Negative control: a function-level import of ``engine.plan.build`` from ``engine.plan.types`` (which
    ``build`` imports at module level) closes a circle that only the lazy graph sees."""
    path = tmp_path / "types.py"
    path.write_text("def f():\n    from .build import build_plan\n")
    planted = {t for t, _, top in _imports("engine.plan.types", path, False) if not top}
    assert planted == {"engine.plan.build"}
    assert "engine.plan.types" in import_graph(lazy=False)["engine.plan.build"]
    assert find_cycles(import_graph(lazy=True)) == []
    cycles = find_cycles(import_graph(lazy=True, extra={"engine.plan.types": planted}))
    assert any({"engine.plan.types", "engine.plan.build"} <= set(c) for c in cycles), cycles


def test_the_cycle_check_sees_a_circle_through_a_package_init(tmp_path):
    """Negative control: the config validation importing the Hugging Face reader lazily, while that reader imports
    only a submodule of the config package (``config.errors``), is a circle -- importing ``config.errors`` runs
    ``engine/training/config/__init__.py``, which imports the validation."""
    path = tmp_path / "probe.py"
    path.write_text("from ..config.errors import ConfigError\n")
    probe = "engine.training.checkpoint.probe"
    targets = {p for t, _, _ in _imports(probe, path, False) for p in _with_parents(probe, t)}
    assert targets == {"engine.training.config.errors", "engine.training.config"}, targets
    edges = {probe: targets, "engine.training.config.validate": {probe}}
    cycles = find_cycles(import_graph(lazy=True, extra=edges))
    assert any({probe, "engine.training.config", "engine.training.config.validate"} <= set(c) for c in cycles), cycles


def test_the_plan_layer_and_pipecast_schedule_import_no_torch():
    code = ("import sys, engine.plan, engine.plan.validate, engine.plan.simulate, engine.plan.lowering, "
            "engine.plan.zero_bubble, engine.plan.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "from engine.cli import main; main(['schedule', '--pp', '2', '-m', '2']); "
            "assert 'torch' not in sys.modules, 'pipecast schedule imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for module, path, is_package in _modules():
        if layer_of(module) == "plan":
            bad = [t for t, line, _ in _imports(module, path, is_package) if t.split(".")[0] == "torch"]
            assert bad == [], f"{module} imports {bad}"


def _code_lines(node) -> int:
    """Lines of a function from its ``def`` to its end, without its docstring."""
    body = node.body
    doc = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str) else None
    n = node.end_lineno - node.lineno + 1
    return n - (doc.end_lineno - doc.lineno + 1) if doc is not None and len(body) > 1 else n


def test_functions_fit_on_a_screen():
    """No function over MAX_FUNCTION_LINES lines (docstring not counted) in engine/ and graphs/."""
    long = []
    for _, path, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node)
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


@pytest.mark.parametrize("bad", ["from engine.training import trainer", "import graphs.capture"])
def test_the_layer_check_catches_an_upward_import(tmp_path, bad):
    """Negative control: the check sees an import of training (or graphs) from the runtime layer."""
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n    {bad}\n")
    targets = [t for t, _, _ in _imports("engine.runtime.probe", path, False)]
    assert any(layer_of(t) not in ALLOWED["runtime"] for t in targets), targets

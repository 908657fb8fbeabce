"""The packages' import graph, read statically from the source: data flows one way
(formats ← cache ← model ← engine ← serve / cli), and the settings load without torch."""

import ast
import subprocess
import sys
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvstack"

# Lowest first. A unit (a package or a top-level module of kvstack) may import the units
# of the layers below its own, never one of its own layer or above: serve, train, eval and
# demo each stand on the engine and the model without reaching into one another, and only
# the command (and the package's front door) sees them all.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvstack._lazy", "kvstack.units"),  # plain-Python helpers
    ("kvstack.formats", "kvstack.corpus"),  # byte codecs; the training and held-out data
    ("kvstack.config",),
    ("kvstack.native", "kvstack.image_grid"),  # C kernels; where a picture goes in a prompt
    ("kvstack.cache",),
    ("kvstack.model",),
    ("kvstack.parallel",),
    ("kvstack.engine", "kvstack.plan"),
    ("kvstack.serve", "kvstack.train", "kvstack.eval", "kvstack.demo"),
    ("kvstack.cli", "kvstack"),
)
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    """kvstack.engine.core -> kvstack.engine; kvstack -> kvstack (its __init__)."""
    return ".".join(module.split(".")[:2])


def _imported(module: str, path: Path) -> list[tuple[str, int]]:
    """Every kvstack module `module` imports, anywhere in it (functions and TYPE_CHECKING
    blocks included), with the line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from kvstack import native` imports the submodule, not the package.
                name = f"{base}.{alias.name}"
                found.append((name if name in MODULES else base, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] == "kvstack"]


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for name, _ in _imported(module, path):
            if _unit(name) != _unit(module):
                graph[_unit(module)].add(_unit(name))
    return graph


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units - set(RANK) == set(), "place the new units in LAYERS"
    assert set(RANK) - units == set(), "LAYERS names units that no longer exist"


def test_each_unit_imports_only_the_layers_below_it():
    wrong = []
    for module, path in MODULES.items():
        for name, line in _imported(module, path):
            here, there = _unit(module), _unit(name)
            if here != there and RANK[there] >= RANK[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {name}")
    assert wrong == []


def test_the_units_import_no_cycle():
    try:
        tuple(TopologicalSorter(_edges()).static_order())
    except CycleError as e:
        raise AssertionError(f"import cycle between units: {e.args[1]}") from None


def test_the_engine_settings_load_without_torch():
    # What the command parses its arguments into is checked before any model loads.
    script = "import kvstack.engine.config, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)

"""The package's layers import only downwards, and no modules import each other in a loop.

Every import of every module under fsdp_ext/ is read with `ast` (module-level, function-local and
under `if TYPE_CHECKING:` alike) and resolved to the fsdp_ext module it names. LAYERS below is the
one place the allowed directions are written: a module may import its own subpackage and any
subpackage of a lower layer, never one of its own layer or above.
"""
from __future__ import annotations

import ast
import os
import shutil

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fsdp_ext")

# Layer of each part of the package; higher layers import lower ones only.
LAYERS = {
    "integrations": 6,      # switches for other libraries (accelerate, Lightning): optional
    "fsdp_ext": 5,          # __init__.py: the public API, re-exported
    "api": 4,
    "state": 3, "planner": 3, "diagnostics": 3,
    "runtime": 2,
    "ops": 1,               # the kernels' Python entry points
    "_C": 0,                # the compiled extension (kernels, issue thread, block cache)
    "shutdown": 0,          # process exit helpers, importing nothing of fsdp_ext
}
MAX_TOP_LEVEL_MODULES = 8


def module_sources(root: str) -> dict[str, str]:
    """Dotted module name -> source, for every .py file under the package folder `root`."""
    sources = {}
    base = os.path.dirname(root)
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                with open(path) as f:
                    sources[dotted.removesuffix(".__init__")] = f.read()
    return sources


def _is_package(module: str, modules: dict[str, str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


def imports_of(module: str, source: str, modules: dict[str, str]) -> set[str]:
    """The fsdp_ext modules that `module` imports, anywhere in its source."""
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for alias in node.names:  # `from x import submodule` imports x.submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules or alias.name == "_C" else target)
    return {name for name in found if name == "fsdp_ext" or name.startswith("fsdp_ext.")}


def part_of(module: str) -> str:
    """The layer table's key for a module: its subpackage, or the top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        src = part_of(module)
        for target in sorted(targets):
            dst = part_of(target)
            if src not in LAYERS or dst not in LAYERS:
                problems.append(f"{module} -> {target}: '{src if src not in LAYERS else dst}' "
                                "is not in the layer table")
            elif src != dst and LAYERS[dst] >= LAYERS[src]:
                problems.append(f"{module} -> {target}: layer '{src}' ({LAYERS[src]}) may not "
                                f"import layer '{dst}' ({LAYERS[dst]})")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module, or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(root: str) -> dict[str, set[str]]:
    modules = module_sources(root)
    graph = {m: imports_of(m, s, modules) - {m} for m, s in modules.items()}
    # Importing a package runs its __init__; a module importing its own package is not a loop.
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def test_imports_point_down_and_never_loop():
    graph = import_graph(PACKAGE_DIR)
    assert "fsdp_ext.runtime.unit" in graph and graph["fsdp_ext.api.fully_shard"]
    assert upward_imports(graph) == []
    assert cycles(graph) == []


def test_package_has_layers_and_few_top_level_modules():
    top = [n for n in os.listdir(PACKAGE_DIR) if n.endswith(".py")]
    subpackages = [n for n in os.listdir(PACKAGE_DIR)
                   if os.path.isfile(os.path.join(PACKAGE_DIR, n, "__init__.py"))]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert set(subpackages) == set(LAYERS) - {"fsdp_ext", "_C", "shutdown"}
    for sub in subpackages:  # each opens with a docstring saying what it owns and may import
        with open(os.path.join(PACKAGE_DIR, sub, "__init__.py")) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        assert "Owns:" in doc and "May import:" in doc, sub


def test_the_check_fails_on_a_planted_upward_import_and_a_planted_loop(tmp_path):
    copy = os.path.join(tmp_path, "fsdp_ext")
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(os.path.join(copy, "runtime", "unit.py"), "a") as f:
        f.write("\n\ndef _planted():\n    from ..api.fully_shard import fully_shard\n")
    with open(os.path.join(copy, "runtime", "registry.py"), "a") as f:
        f.write("\nfrom .schedule import Schedule\n")  # schedule imports registry: a loop
    graph = import_graph(copy)
    assert upward_imports(graph) == [
        "fsdp_ext.runtime.unit -> fsdp_ext.api.fully_shard: layer 'runtime' (2) may not import "
        "layer 'api' (4)"]
    assert ["fsdp_ext.runtime.registry", "fsdp_ext.runtime.schedule"] in cycles(graph)


def _written_targets(source: str):
    """(line, target) of every attribute or item assigned to (augmented and annotated
    assignments and tuple targets included)."""
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(element, (ast.Attribute, ast.Subscript)):
                    yield node.lineno, element


def _chain(node) -> list[str]:
    """The names along an assignment target: `self.schedule.x[0]` -> ['self', 'schedule', 'x']."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    return ([node.id] if isinstance(node, ast.Name) else []) + names[::-1]


def _written_attributes(source: str, own: set[str]) -> list[str]:
    """`line: target` of every assignment to an attribute or item of an object not named in
    `own`."""
    return [f"{line}: {ast.unparse(target)}" for line, target in _written_targets(source)
            if (_chain(target) or [""])[0] not in own]


def test_the_schedule_writes_only_its_own_state():
    """Unit -> Schedule is one way: the schedule orders units and asks them to act through their
    methods (join, start_step, reshard, ...), never by writing their fields, their buckets' or
    their gradient state (a cycle the imports alone would not show: runtime/schedule.py imports
    no unit). The one other object it writes is a schedule it just made (`schedule`)."""
    path = os.path.join(PACKAGE_DIR, "runtime", "schedule.py")
    with open(path) as f:
        written = _written_attributes(f.read(), own={"self", "schedule"})
    assert written == [], "runtime/schedule.py writes other objects' state:\n" + "\n".join(written)
    # the check itself sees such writes
    assert _written_attributes("def f(unit):\n    unit.x = 1\n    unit.a.b[0] += 2\n",
                               own={"self"}) == ["2: unit.x", "3: unit.a.b[0]"]


def _chains_written(source: str) -> list[tuple[int, list[str]]]:
    return [(line, _chain(target)) for line, target in _written_targets(source)]


def test_units_write_no_schedule_state():
    """...and Schedule -> Unit is one way too: the unit and the modules it drives (its buffers,
    gathers and gradient path) ask the schedule through its methods (note_unshard,
    note_host_read, forward_failed, ...), never write its fields."""
    written = []
    for name in ("unit.py", "unit_params.py", "gather.py", "grads.py", "unit_checks.py",
                 "adopt.py"):
        with open(os.path.join(PACKAGE_DIR, "runtime", name)) as f:
            written += [f"{name}:{line}: {'.'.join(c)}" for line, c in _chains_written(f.read())
                        if "schedule" in c[:-1]]
    assert written == [], "the unit's side writes the schedule's state:\n" + "\n".join(written)
    assert [c for _, c in _chains_written("self.schedule.in_forward = False\nx.y = 1\n")
            if "schedule" in c[:-1]] == [["self", "schedule", "in_forward"]]


# Where module._parameters may be written: the unit's parameter owner (its transitions), and
# before a unit exists (the buckets' construction, meta materialisation before sharding).
PARAMETER_WRITERS = {"runtime/unit_params.py", "runtime/param_buckets.py",
                     "runtime/deferred_init.py"}


def test_only_the_parameter_owner_writes_module_parameters():
    writers = []
    for root, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, PACKAGE_DIR)
            with open(path) as f:
                source = f.read()
            writers += [f"{rel}:{line}" for line, c in _chains_written(source)
                        if "_parameters" in c and rel not in PARAMETER_WRITERS]
    assert writers == [], "module._parameters written outside its owner:\n" + "\n".join(writers)
    assert [c for _, c in _chains_written("m._parameters['w'] = p\nm.w = p\n")] == [
        ["m", "_parameters"], ["m", "w"]]  # the check sees an item write through a module

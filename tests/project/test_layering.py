"""The package's layers import only downwards, and no modules import each other in a loop.

Every import of every module under fsdp_ext/ is read with `ast` (module-level, function-local and
under `if TYPE_CHECKING:` alike) and resolved to the fsdp_ext module it names. LAYERS below is the
one place the allowed directions are written: a module may import its own subpackage and any
subpackage of a lower layer, never one of its own layer or above.

Objects have owners too: functions in runtime/, state/, diagnostics/ and api/ write the attributes
of their own objects only (`self`, or records of a class their module declares), never through a
chain (`unit.params.states[i].grads.x = ...`) or into torch's objects; `_owned` is where that rule
is written, ALLOWED lists what remains, and PARAMETERS_WRITER who writes `module._parameters`.
"""
from __future__ import annotations

import ast
import os
import re
import shutil

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "fsdp_ext")

# Layer of each part of the package; higher layers import lower ones only.
LAYERS = {
    "integrations": 6,      # switches for other libraries (accelerate, Lightning): optional
    "fsdp_ext": 5,          # __init__.py: the public API, re-exported
    "api": 4,
    "state": 3, "planner": 3, "diagnostics": 3, "optim": 3,
    "runtime": 2,
    "ops": 1,               # the kernels' Python entry points
    "_C": 0,                # the compiled extension (kernels, issue thread, block cache)
    "shutdown": 0,          # process exit helpers, importing nothing of fsdp_ext
    "env": 0,               # the environment variables, read here only; importing nothing
}
# The runtime's own layers (its subpackages), in the same sense: a runtime module imports its own
# subpackage and the ones below it (docs/architecture.md draws them).
RUNTIME_LAYERS = {
    "unit": 5,              # units, their hooks and states, the schedule
    "bucket": 4,            # a unit's buckets: storage, layout, gather and gradient path
    "wire": 3,              # what a bucket puts on the wire: exact, quantized, tensor subclasses
    "placement": 2,         # where each parameter is sharded, and its DTensor face
    "comm": 1,              # collectives, process groups, tags and heartbeats
    "core": 0,              # streams, host reads, trace, errors, offload: importing no runtime part
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


def runtime_part_of(module: str) -> str | None:
    """The runtime subpackage a module is in (RUNTIME_LAYERS' key), None outside one."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "runtime" else None


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
            elif src == dst == "runtime":
                problems += _runtime_problem(module, target)
    return problems


def _runtime_problem(module: str, target: str) -> list[str]:
    src, dst = runtime_part_of(module), runtime_part_of(target)
    if src is None or dst is None or src == dst:
        return []  # runtime/__init__.py imports nothing; a subpackage imports itself freely
    if src not in RUNTIME_LAYERS or dst not in RUNTIME_LAYERS:
        return [f"{module} -> {target}: 'runtime.{src if src not in RUNTIME_LAYERS else dst}' "
                "is not in the runtime's layer table"]
    if RUNTIME_LAYERS[dst] >= RUNTIME_LAYERS[src]:
        return [f"{module} -> {target}: layer 'runtime.{src}' ({RUNTIME_LAYERS[src]}) may not "
                f"import layer 'runtime.{dst}' ({RUNTIME_LAYERS[dst]})"]
    return []


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
    assert "fsdp_ext.runtime.unit.unit" in graph and graph["fsdp_ext.api.fully_shard"]
    assert upward_imports(graph) == []
    assert cycles(graph) == []


def test_package_has_layers_and_few_top_level_modules():
    top = [n for n in os.listdir(PACKAGE_DIR) if n.endswith(".py")]
    subpackages = [n for n in os.listdir(PACKAGE_DIR)
                   if os.path.isfile(os.path.join(PACKAGE_DIR, n, "__init__.py"))]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert set(subpackages) == set(LAYERS) - {"fsdp_ext", "_C", "shutdown", "env"}
    runtime_dir = os.path.join(PACKAGE_DIR, "runtime")
    runtime_parts = [n for n in os.listdir(runtime_dir)
                     if os.path.isfile(os.path.join(runtime_dir, n, "__init__.py"))]
    assert set(runtime_parts) == set(RUNTIME_LAYERS)
    assert [n for n in os.listdir(runtime_dir) if n.endswith(".py")] == ["__init__.py"]
    # each opens with a docstring saying what it owns and may import
    for sub in subpackages + [f"runtime/{n}" for n in runtime_parts]:
        with open(os.path.join(PACKAGE_DIR, sub, "__init__.py")) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        assert "Owns:" in doc and "May import:" in doc, sub


def test_the_check_fails_on_a_planted_upward_import_and_a_planted_loop(tmp_path):
    copy = os.path.join(tmp_path, "fsdp_ext")
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(os.path.join(copy, "runtime", "unit", "unit.py"), "a") as f:
        f.write("\n\ndef _planted():\n    from ...api.fully_shard import fully_shard\n")
    with open(os.path.join(copy, "runtime", "core", "registry.py"), "a") as f:
        f.write("\nfrom ..unit.schedule import Schedule\n")  # schedule imports registry: a loop
    with open(os.path.join(copy, "runtime", "comm", "groups.py"), "a") as f:
        f.write("\nfrom ..wire import comm_policy\n")
    graph = import_graph(copy)
    assert upward_imports(graph) == [
        "fsdp_ext.runtime.comm.groups -> fsdp_ext.runtime.wire.comm_policy: layer 'runtime.comm' "
        "(1) may not import layer 'runtime.wire' (3)",
        "fsdp_ext.runtime.core.registry -> fsdp_ext.runtime.unit.schedule: layer 'runtime.core' "
        "(0) may not import layer 'runtime.unit' (5)",
        "fsdp_ext.runtime.unit.unit -> fsdp_ext.api.fully_shard: layer 'runtime' (2) may not "
        "import layer 'api' (4)"]
    assert ["fsdp_ext.runtime.core.registry", "fsdp_ext.runtime.unit.schedule"] in cycles(graph)


def _targets_of(node: ast.AST):
    """The attributes and items one statement writes: assignment (plain, augmented, annotated),
    `del`, a `for` loop's or a `with`'s target, tuple/list/starred targets unpacked."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        targets = []
    while targets:
        target = targets.pop(0)
        if isinstance(target, (ast.Tuple, ast.List)):
            targets[:0] = target.elts
        elif isinstance(target, ast.Starred):
            targets.insert(0, target.value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            yield target


def _written_targets(source: str):
    """(line, target) of every attribute or item written anywhere in `source`."""
    for node in ast.walk(ast.parse(source)):
        for target in _targets_of(node):
            yield node.lineno, target


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
    their gradient state (a cycle the imports alone would not show: runtime/unit/schedule.py imports
    no unit). The one other object it writes is a schedule it just made (`schedule`)."""
    path = os.path.join(PACKAGE_DIR, "runtime", "unit", "schedule.py")
    with open(path) as f:
        written = _written_attributes(f.read(), own={"self", "schedule"})
    assert written == [], "runtime/unit/schedule.py writes other objects' state:\n" + "\n".join(written)
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
    for name in ("unit/unit.py", "unit/params.py", "bucket/gather.py", "bucket/grads.py",
                 "unit/checks.py", "bucket/adopt.py"):
        with open(os.path.join(PACKAGE_DIR, "runtime", name)) as f:
            written += [f"{name}:{line}: {'.'.join(c)}" for line, c in _chains_written(f.read())
                        if "schedule" in c[:-1]]
    assert written == [], "the unit's side writes the schedule's state:\n" + "\n".join(written)
    assert [c for _, c in _chains_written("self.schedule.in_forward = False\nx.y = 1\n")
            if "schedule" in c[:-1]] == [["self", "schedule", "in_forward"]]


# --- Cross-object writes ------------------------------------------------------------------------
# A module writes the attributes of its own objects only; everything else it asks for through the
# owner's methods. `cross_object_writes` below is the one place the rule is written.

CROSS_OBJECT_PARTS = ("runtime", "state", "diagnostics", "api")
OWN_NAMES = {"self", "cls"}
# Attributes of torch objects (tensors, parameters, DTensors, modules): no module of ours declares
# them, so writing one is always a write into another library's object.
TORCH_ATTRIBUTES = {"data", "grad", "requires_grad", "_local_tensor", "_parameters", "_buffers",
                    "_modules", "__dict__", "__class__"}
SETATTR_CALLS = {"setattr", "delattr", "object.__setattr__", "object.__delattr__"}


def declared_attributes(tree: ast.Module) -> set[str]:
    """Attributes that classes defined in this module declare: dataclass fields and other
    class-level annotations or assignments, `__slots__`, property setters, and `self.x` written
    in the class's methods."""
    declared = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                declared.add(stmt.target.id)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        declared.update(c.value for c in ast.walk(stmt.value)
                                        if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    elif isinstance(target, ast.Name):
                        declared.add(target.id)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(d, ast.Attribute) and d.attr == "setter"
                       for d in stmt.decorator_list):
                    declared.add(stmt.name)
        for node in ast.walk(cls):
            for target in _targets_of(node):
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in OWN_NAMES):
                    declared.add(target.attr)
    return declared


def _owned(obj: ast.expr, attr: str | None, ours: set[str]) -> bool:
    """THE RULE. May a function write attribute `attr` of `obj` (attr None: unknown, from a
    computed setattr)? Yes for `self`/`cls`; for another plain name only when `attr` is one of
    `ours` (declared by a class of this module, by none of another module, and not a torch
    attribute: the module's own records); never through anything longer (`a.b.x`, `a[i].x`,
    `f().x`)."""
    if not isinstance(obj, ast.Name):
        return False
    return obj.id in OWN_NAMES or (attr is not None and attr in ours)


def _is_write_allowed(target: ast.expr, ours: set[str]) -> bool:
    """An attribute target `obj.attr`, or an item target `obj.attr[k]...` (an item of a plain
    name's container, `d[k]`, is a local write)."""
    if isinstance(target, ast.Subscript):
        while isinstance(target, ast.Subscript):
            target = target.value
        if not isinstance(target, ast.Attribute):
            return True
    return _owned(target.value, target.attr, ours)


def cross_object_writes(source: str, declared_elsewhere: set[str] = frozenset()) -> list[
        tuple[int, str]]:
    """(line, written expression) of every write, inside a function of `source`, into an object
    the module does not own (see `_owned`), sorted by line. `declared_elsewhere`: the attributes
    other modules' classes declare (an attribute both declare may be either's: `bucket.x = ...`
    in a module whose own class also has an `x`)."""
    tree = ast.parse(source)
    ours = declared_attributes(tree) - set(declared_elsewhere) - TORCH_ATTRIBUTES
    in_functions = {id(node) for fn in ast.walk(tree)
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                    for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if id(node) not in in_functions:
            continue
        for target in _targets_of(node):
            if not _is_write_allowed(target, ours):
                found.append((node.lineno, ast.unparse(target)))
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in SETATTR_CALLS
                and len(node.args) >= 2):
            obj, name = node.args[0], node.args[1]
            attr = name.value if isinstance(name, ast.Constant) else None
            if not _owned(obj, attr, ours):
                found.append((node.lineno, f"{ast.unparse(node.func)}({ast.unparse(obj)}, "
                                           f"{ast.unparse(name)})"))
    return sorted(found)


def package_files(root: str = PACKAGE_DIR) -> dict[str, str]:
    """Path relative to the package folder `root` ("runtime/unit/unit.py") -> source."""
    sources = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    sources[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return sources


def package_cross_object_writes(root: str = PACKAGE_DIR) -> dict[tuple[str, str], list[int]]:
    """(path relative to the package, expression) -> lines, over CROSS_OBJECT_PARTS."""
    sources = package_files(root)
    declared = {rel: declared_attributes(ast.parse(source)) for rel, source in sources.items()}
    writes: dict[tuple[str, str], list[int]] = {}
    for rel, source in sorted(sources.items()):
        if rel.split("/")[0] in CROSS_OBJECT_PARTS:
            elsewhere = set().union(*(d for other, d in declared.items() if other != rel))
            for line, expr in cross_object_writes(source, elsewhere):
                writes.setdefault((rel, expr), []).append(line)
    return writes


# The writes into other objects that remain: (path under fsdp_ext/, written expression) -> why.
# A new one fails test_no_new_cross_object_writes; an entry whose write is gone fails it too
# (delete the entry).
ALLOWED_TO_REMOVE = {
    # (none: every cross-object write the check first found has gone to its owner's method)
}
ALLOWED_KEPT = {
    ("state/summon.py", "param.grad"): "the full nn.Parameter summon_full_params just made",
    ("runtime/comm/peer_watch.py", "self.watch._waiting_at"):
        "PeerWatch.waiting's context object, in the watch's own module",
    # Records of this module under a name another module's class also declares.
    ("runtime/bucket/gather.py", "record.pending"): "its InFlightGather (grads.PendingReduce has one too)",
    ("runtime/bucket/layout.py", "layout.groups"):
        "the BucketLayout it just built (Unit has `groups` too)",
    ("runtime/core/trace.py", "RECORDER.enabled"): "its Recorder (CollectiveChecker has `enabled` too)",
    ("diagnostics/launch_trace.py", "record.site"): "its record (host_syncs.HostSync has one too)",
    ("diagnostics/launch_trace.py", "event.trace_id"): "labels the event its seam override returns",
    ("diagnostics/gpu_projection.py", "out[-1].end"): "the spans list _merged is building",
    ("diagnostics/stream_check.py",
     "self._new_block(tensor, HOST, 'host_empty', _stack(), host=True).pinned"): "its new Block",
    ("diagnostics/stream_check.py",
     "self._new_block(tensor, HOST, 'host_tensor', _stack(), host=True).pinned"): "its new Block",
    ("api/fsdp_module.py", "wrapped.__wrapped__"):
        "the function it just defined (as functools.wraps)",
    ("api/fsdp_module.py", "wrapped.__name__"): "the function it just defined (as functools.wraps)",
    ("api/fsdp_module.py", "wrapped.__doc__"): "the function it just defined (as functools.wraps)",
    # The owners' own writes into torch objects.
    ("runtime/bucket/bucket.py", "slot.param.data"): "the bucket points its parameters at its shard",
    ("runtime/bucket/bucket.py", "slot.param.grad"): "the bucket sets its parameters' full gradients",
    ("runtime/bucket/bucket.py", "module._parameters[attr]"): "set_module_param: PARAMETERS_WRITER",
    ("runtime/bucket/bucket.py", "setattr(param, OWNER_ATTR)"): "mark_owner tags a sharded parameter",
    ("runtime/bucket/bucket.py", "self.slots[index].param.grad"):
        "the bucket publishes its gradient shard",
    ("runtime/unit/params.py", "tensor._is_param"):
        "marks the gathered view it installs as a parameter (nn.Parameter's own mark)",
    ("runtime/unit/params.py", "ctx.unit"):
        "autograd's ctx: how a Function hands state to backward",
    ("runtime/unit/params.py", "ctx.params"):
        "autograd's ctx: how a Function hands state to backward",
    ("runtime/placement/model_parallel.py", "ctx.groups"):
        "autograd's ctx: how a Function hands state to backward",
    ("runtime/placement/dtensor_params.py", "dtensor._local_tensor"): "DTensor has no setter (as FSDP2 does)",
    ("runtime/placement/dtensor_params.py", "param._local_tensor"): "DTensor has no setter (as FSDP2 does)",
    ("runtime/unit/states.py", "setattr(owner, attr)"): "`move`, the checked transition owners call",
    # What the public API does to the user's objects, as torch's own does.
    ("api/fully_shard.py", "member.__class__"): "fully_shard makes the module an FSDPModule",
    ("api/replicate.py", "member.__class__"): "replicate makes the module a ReplicateModule",
    ("api/fully_shard.py", "member.__dict__[UNIT_ATTR]"): "fully_shard gives the module its unit",
    ("api/fully_shard.py", "sub._buffers[name]"):
        "offload moves buffers, not parameters, to the device",
    ("api/fsdp_module.py", "setattr(module, method_name)"): "register_fsdp_forward_method's effect",
    ("api/fsdp1.py", "buf.data"): "FSDP1's buffer_dtype casts the user's buffers in place",
    ("diagnostics/stream_check.py", "torch.cuda.synchronize"):
        "patched for the check, restored after",
    ("diagnostics/stream_check.py", "torch.accelerator.synchronize"):
        "patched for the check, restored",
    # The state-dict settings ride on the unit under private names only state/ and api/ read
    # (torch's FSDP1 keeps them on its module).
    ("state/state_dict.py", "setattr(unit, SETTINGS_ATTR)"): "state_dict_type's settings",
    ("state/state_dict.py", "setattr(unit, OPTIM_SETTINGS_ATTR)"): "state_dict_type's settings",
    ("api/fsdp1_state.py", "setattr(unit, TORCH_SETTINGS_ATTR)"): "state_dict_type's settings",
}
ALLOWED = {**ALLOWED_TO_REMOVE, **ALLOWED_KEPT}


def test_no_new_cross_object_writes():
    """Runtime, state, diagnostics and api functions write their own objects only (the rule:
    `_owned`); what remains is listed in ALLOWED."""
    writes = package_cross_object_writes()
    new = [f"fsdp_ext/{path}:{line}: {expr}" for (path, expr), lines in writes.items()
           if (path, expr) not in ALLOWED for line in lines]
    new.sort(key=lambda at: (at.split(":")[0], int(at.split(":")[1])))
    assert new == [], (
        "writes into another module's objects (or through a chain, or into torch's):\n  "
        + "\n  ".join(new) + "\nGive the object's owner a method (or move the write into the "
        "module whose class declares the attribute); a write that must stay goes into ALLOWED in "
        "tests/project/test_layering.py with its reason.")
    gone = [f"{path}: {expr}" for path, expr in ALLOWED if (path, expr) not in writes]
    assert gone == [], "no longer written; delete from ALLOWED:\n  " + "\n  ".join(gone)


PLANTED = '''
from dataclasses import dataclass

@dataclass
class Record:
    pending: object = None

class Owner:
    def __init__(self):
        self.x = 1

    def act(self, unit, record, i, x):
        self.x += 1                                     # its own
        self.cache[i] = x                               # its own container
        record.pending = x                              # a record of this module
        table = {}
        table[i] = x                                    # a local container
        unit.params.states[i].grads.partial_reduce = x  # planted: through a chain
        unit.name = x                                   # planted: no class here has `name`
        record.data = x                                 # planted: a torch attribute
        module._parameters["w"] = x                     # planted: torch's dict
        unit.buckets[i] = x                             # planted: another object's list
        f().x = x                                       # planted: a call's result
        setattr(unit, "name", x)                        # planted: not self
        del unit.cache[i]                               # planted: del
'''


def test_the_cross_object_check_reports_planted_writes():
    """The check can fail: each planted write is reported, the allowed ones are not."""
    assert cross_object_writes(PLANTED) == [
        (18, "unit.params.states[i].grads.partial_reduce"), (19, "unit.name"),
        (20, "record.data"), (21, "module._parameters['w']"), (22, "unit.buckets[i]"),
        (23, "f().x"), (24, "setattr(unit, 'name')"), (25, "unit.cache[i]")]
    # `pending` declared by another module's class too: the plain-name write needs an entry
    assert cross_object_writes(PLANTED, declared_elsewhere={"pending"})[0] == (
        15, "record.pending")


def test_the_package_check_fails_on_a_write_planted_in_a_module(tmp_path):
    copy = os.path.join(tmp_path, "fsdp_ext")
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(os.path.join(copy, "runtime", "unit", "schedule.py"), "a") as f:
        f.write("\n\ndef _planted(unit, i, x):\n"
                "    unit.params.states[i].grads.partial_reduce = x\n")
    writes = package_cross_object_writes(copy)
    assert [k for k in writes if k not in ALLOWED] == [
        ("runtime/unit/schedule.py", "unit.params.states[i].grads.partial_reduce")]


# module._parameters is written by one file: bucket.set_module_param, which the buckets'
# transitions (construction, adoption), the unit's installs and meta init all call.
PARAMETERS_WRITER = {"runtime/bucket/bucket.py"}
_DICT_MUTATORS = {"pop", "popitem", "update", "setdefault", "clear", "__setitem__", "__delitem__"}


def parameters_writes(source: str) -> list[int]:
    """Lines of `source` that write a module's `_parameters` (item assignment or `del`, a
    mutating method of the dict, or `register_parameter`)."""
    lines = [line for line, target in _written_targets(source) if "_parameters" in _chain(target)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr == "register_parameter" or (
                    node.func.attr in _DICT_MUTATORS and isinstance(owner, ast.Attribute)
                    and owner.attr == "_parameters"):
                lines.append(node.lineno)
    return sorted(lines)


def test_only_the_parameter_owner_writes_module_parameters():
    writers = {path: lines for path, source in sorted(package_files().items())
               if (lines := parameters_writes(source))}
    outside = [f"fsdp_ext/{p}:{line}" for p, lines in writers.items()
               if p not in PARAMETERS_WRITER for line in lines]
    assert outside == [], ("module._parameters written outside its owner:\n  "
                           + "\n  ".join(outside) + "\nAsk the parameter owner's transitions.")
    assert set(writers) == PARAMETERS_WRITER, "no longer a writer; drop from PARAMETERS_WRITER: " \
        f"{sorted(PARAMETERS_WRITER - set(writers))}"
    assert parameters_writes("m._parameters['w'] = p\nm.w = p\ndel m._parameters['b']\n"
                             "m._parameters.pop('c')\nm.register_parameter('d', p)\n") == [
        1, 3, 4, 5]  # the check sees each way of writing it


# A bucket's kind (exact, quantized, tensor subclass) is its wire format's business (runtime/wire/):
# the runtime, state and diagnostics code calls the format's methods, never asks which it is.
# param_buckets.py chooses the format once, at construction (the one place that looks at what a
# parameter is); comm_policy.py defines the policy's fields.
KIND_TESTS = ("is_extension_tensor(", ".param_gather", ".grad_reduce", "Wire)", ".kind ==",
              ".extension", "QuantizedWire", "SubclassWire")
KIND_CHOOSERS = {"runtime/bucket/param_buckets.py", "runtime/wire/comm_policy.py"}


def kind_tests(root: str = PACKAGE_DIR) -> list[str]:
    found = []
    for rel, source in package_files(root).items():
        if (rel.split("/")[0] not in ("runtime", "state", "diagnostics")
                or rel.startswith("runtime/wire/") or rel in KIND_CHOOSERS):
            continue
        for line_no, line in enumerate(source.splitlines(), 1):
            code = line.split("#")[0]
            # (a layout's own kind, rows or flat, and a trace event's, are not a bucket's)
            code = re.sub(r"\b(layout|self|e)\.kind\b", "", code)
            found += [f"{rel}:{line_no}: {t}" for t in KIND_TESTS if t in code]
    return found


def test_no_caller_tests_a_bucket_kind(tmp_path):
    found = kind_tests()
    assert found == [], "a bucket's kind tested outside its wire format:\n" + "\n".join(found)
    copy = tmp_path / "fsdp_ext"
    shutil.copytree(PACKAGE_DIR, copy)
    with open(copy / "runtime" / "bucket" / "gather.py", "a") as f:
        f.write("\n\ndef planted(bucket):\n    return bucket.wire.kind == 'quantized'\n")
    assert [f.split(": ", 1)[1] for f in kind_tests(str(copy))] == [".kind =="]


# A parameter's placement (plain, tensor parallel, annotated, on the storage mesh; its own mesh) is
# the placement object's business (runtime/placement/): callers ask it, never which it is. These are
# the ways a caller could ask: a placement class named, the old `slot.parallel` / capability
# flag, a placement's or a bucket's mesh compared with something (a mesh of its own).
PLACEMENT_CLASSES = {"TensorParallel", "Annotated", "OnStorageMesh", "ModelParallel"}
PLACEMENT_ATTRS = {"parallel", "hybrid_own_mesh"}


def placement_kind_tests(root: str = PACKAGE_DIR) -> list[str]:
    found = []
    for rel, source in package_files(root).items():
        if rel.startswith("runtime/placement/"):
            continue
        for node in ast.walk(ast.parse(source)):
            what = None
            if isinstance(node, ast.Attribute) and node.attr in PLACEMENT_ATTRS:
                what = "." + node.attr
            elif isinstance(node, ast.Name) and node.id in PLACEMENT_CLASSES:
                what = node.id
            elif isinstance(node, ast.alias) and node.name in PLACEMENT_CLASSES:
                what = "import " + node.name
            elif isinstance(node, ast.Compare):
                sides = [ast.unparse(n) for n in (node.left, *node.comparators)]
                if (any(t.endswith("placement.mesh") for t in sides)
                        or all(t.endswith(".groups") for t in sides)):
                    what = ast.unparse(node)
            if what is not None:
                found.append(f"{rel}:{node.lineno}: {what}")
    return sorted(found)


# Each branch on a placement's kind that callers held before the placement object (the first ten,
# planted back into the file each was in; placements.py's is fully_shard's here), and two new
# spellings of the same question: each must be found.
OLD_PLACEMENT_BRANCHES = {
    "runtime/unit/params.py": "t = v if slot.parallel is None else slot.parallel.compute_view(v)",
    "runtime/bucket/param_buckets.py": "ok = slot.parallel is not None",
    "api/clip.py": "g = g if slot.parallel is None else g + slot.parallel.norm_groups()",
    "state/state_dict.py": "t = slot.parallel.full_tensor(t) if slot.parallel else t",
    "state/summon.py": "bad = any(slot.parallel is not None for slot in bucket.slots)",
    "state/pretrained.py": "bad = slot.parallel is not None",
    "state/load_state_dict.py": "bad = slot.parallel is not None",
    "state/load_checks.py": "keep = [s for s in slots if s.parallel is None]",
    "diagnostics/describe.py": "own = bucket.groups is not unit.groups",
    "api/fully_shard.py": "hybrid = split is not None and not split.hybrid_own_mesh",
    "state/optim_state_dict.py": "tp = isinstance(slot.placement, TensorParallel)",
    "runtime/unit/unit.py": "own = slot.placement.mesh is not None",
}


def test_no_caller_tests_a_placement_kind(tmp_path):
    found = placement_kind_tests()
    assert found == [], "a placement's kind tested outside runtime/placement/:\n" + "\n".join(found)
    copy = tmp_path / "fsdp_ext"
    shutil.copytree(PACKAGE_DIR, copy)
    for rel, line in OLD_PLACEMENT_BRANCHES.items():
        with open(copy / rel, "a") as f:
            f.write(f"\n\ndef _planted(slot, slots, bucket, unit, split, v, g, t):\n    {line}\n")
    planted = {f.split(":")[0] for f in placement_kind_tests(str(copy))}
    assert planted == set(OLD_PLACEMENT_BRANCHES), sorted(set(OLD_PLACEMENT_BRANCHES) - planted)


# Every environment variable is read in fsdp_ext/env.py (its docstring lists them, with whether a
# call or the process reads it): nowhere else reads os.environ or os.getenv.
def environment_reads(root: str = PACKAGE_DIR) -> list[str]:
    found = []
    for rel, source in package_files(root).items():
        if rel == "env.py":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_every_environment_variable_is_read_in_env_py(tmp_path):
    assert environment_reads() == []
    copy = tmp_path / "fsdp_ext"
    shutil.copytree(PACKAGE_DIR, copy)
    with open(copy / "ops" / "__init__.py", "a") as f:
        f.write("\n\ndef _planted():\n    import os\n    return os.environ.get('X')\n")
    assert [f.split(": ", 1)[1] for f in environment_reads(str(copy))] == ["os.environ"]


MAX_RUNTIME_FILE_LINES = 350  # small single-purpose files: one that grows past this splits


def test_runtime_files_stay_small():
    long = [f"runtime/{rel}: {source.count(chr(10))} lines"
            for rel, source in package_files(os.path.join(PACKAGE_DIR, "runtime")).items()
            if source.count("\n") > MAX_RUNTIME_FILE_LINES]
    assert long == [], f"over {MAX_RUNTIME_FILE_LINES} lines:\n" + "\n".join(long)


def test_each_layer_docstring_names_every_file():
    """A layer's opening docstring is its file map: every module of the folder is named in it
    (runtime/__init__.py left out 11 of 40 once)."""
    missing = []
    folders = ["api", "state", "diagnostics",
               *(os.path.relpath(f, PACKAGE_DIR) for f, _, names in
                 os.walk(os.path.join(PACKAGE_DIR, "runtime")) if "__init__.py" in names)]
    for layer in folders:
        folder = os.path.join(PACKAGE_DIR, layer)
        doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read())) or ""
        missing += [f"{layer}/{name}" for name in sorted(os.listdir(folder))
                    if (name.endswith(".py") and name != "__init__.py" and name not in doc)
                    or (os.path.isfile(os.path.join(folder, name, "__init__.py"))
                        and f"{name}/" not in doc)]
    assert missing == [], "not named in their layer's __init__ docstring:\n" + "\n".join(missing)

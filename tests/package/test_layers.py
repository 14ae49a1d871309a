"""The package's layering: no import cycles (lazy imports inside functions included), storage
below decoding, and every module importable on its own."""

import ast
import subprocess
import sys
from pathlib import Path

from support import REPO

PACKAGE = REPO / "sparsecache"
# What the storage package may import from sparsecache: nothing that decodes, searches or
# loads a model (`kvstore` adds those above it).
STORAGE_MAY_IMPORT = {"sparsecache", "sparsecache.errors", "sparsecache.durable", "sparsecache.failpoints",
                      "sparsecache.paths", "sparsecache.codec.codes", "sparsecache.codec.bitpack", "sparsecache.model.fingerprint",
                      "sparsecache.codec.config"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from … import` in `package` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (for annotations: never executed)."""
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and isinstance(block.test, ast.Name)
            and block.test.id == "TYPE_CHECKING" for stmt in block.body for n in ast.walk(stmt)}


def _imports(name: str, path: Path, modules: dict[str, Path], runtime: bool = False) -> set[str]:
    """sparsecache modules `name` imports anywhere in its source (top level or in functions);
    with `runtime`, not those imported for annotations only (under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    tree = ast.parse(path.read_text())
    skip = _type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def import_graph(runtime: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, runtime) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), iteratively."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_even_through_lazy_imports():
    """Imports for annotations only (`if TYPE_CHECKING:`) aside: `query.methods.base` names
    `QueryConfig` in its signatures, and `query.config` validates against the methods' registry."""
    graph = import_graph(runtime=True)
    assert "sparsecache.kvstore.view" in graph and graph["sparsecache.kvstore.view"]  # the graph is really read
    # a package's __init__ importing its own modules is how packages work, not a cycle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    assert _cycles(graph) == []


def test_storage_is_below_decoding():
    graph = import_graph()
    storage = {m: deps for m, deps in graph.items() if m == "sparsecache.store" or m.startswith("sparsecache.store.")}
    assert len(storage) >= 7
    upward = {m: sorted(d for d in deps if not d.startswith("sparsecache.store") and d not in STORAGE_MAY_IMPORT)
              for m, deps in storage.items()}
    assert {m: d for m, d in upward.items() if d} == {}


# The pipeline's subpackages, lowest first: each may import those before it, never one after it.
# A document is read and chunked (text); what fidelity is measured with stands beside it (measure);
# the model gives its K/V (model: loading, capture, the cache and the recomputation the gate
# checks); the codec codes K/V (learning a dictionary runs the model); the store keeps codes and
# imports the codec's format modules; kvstore searches and decodes a store version; the wrapper is
# applied when chunks are encoded (ingest) and learned against the model alone; ingest writes
# stores; the query runtime reads them; vLLM serves its methods; the benchmarks only consume the
# product, and the CLI parses and prints above everything.
PIPELINE = ("sparsecache.text", "sparsecache.measure", "sparsecache.model", "sparsecache.codec", "sparsecache.store",
            "sparsecache.kvstore", "sparsecache.wrapper", "sparsecache.ingest", "sparsecache.query", "sparsecache.vllm",
            "sparsecache.bench", "sparsecache.cli")
# What may stay at the package's root: cross-cutting modules every stage may use.
ROOT_MODULES = {"sparsecache", "sparsecache.errors", "sparsecache.paths", "sparsecache.durable", "sparsecache.failpoints",
                "sparsecache.stopwatch", "sparsecache.dtypes", "sparsecache.testing"}


def test_no_subpackage_imports_one_above_it_in_the_pipeline():
    graph = import_graph()

    def layer(m: str) -> int | None:
        return next((i for i, p in enumerate(PIPELINE) if m == p or m.startswith(p + ".")), None)

    assert all(any(layer(m) == i for m in graph) for i in range(len(PIPELINE)))  # every subpackage is there
    upward = sorted((m, d) for m, deps in graph.items() if layer(m) is not None
                    for d in deps if layer(d) is not None and layer(d) > layer(m))
    assert upward == []


def test_every_module_belongs_to_a_stage_or_is_cross_cutting():
    graph = import_graph()
    loose = sorted(m for m in graph if m not in ROOT_MODULES and not any(m == p or m.startswith(p + ".") for p in PIPELINE))
    assert loose == []
    assert len(ROOT_MODULES - {"sparsecache"}) <= 8


def test_the_root_modules_import_no_stage():
    """errors, paths, durability, failpoints, timing and dtypes stand below every stage (the
    package's __init__ and the tests' helpers aside)."""
    graph = import_graph()
    reaches = {m: sorted(d for d in graph[m] if d not in ROOT_MODULES)
               for m in ROOT_MODULES - {"sparsecache", "sparsecache.testing"} if m in graph}
    assert {m: d for m, d in reaches.items() if d} == {}


def test_every_module_imports_on_its_own():
    """Each module imported first, in one interpreter with sparsecache's modules dropped between
    imports (third-party libraries stay loaded: what is checked is our import order)."""
    names = sorted(import_graph())
    script = f"""
import importlib, sys
failed = []
for name in {names!r}:
    for m in [m for m in sys.modules if m == "sparsecache" or m.startswith("sparsecache.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("sparsecache"):
            continue  # an optional dependency (vllm, ray) this machine does not have
        failed.append(f"{{name}}: {{e!r}}")
    except Exception as e:
        failed.append(f"{{name}}: {{e!r}}")
print("\\n".join(failed))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ""


def _private_reaches(name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """`from X import _y` and `X._y` (X a sparsecache module bound by an import) in `name`'s
    source, where X is another module. A package's private modules (`codec._omp_cpu`) may be
    imported by that package's own modules."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            if not (module == "sparsecache" or module.startswith("sparsecache.")):
                continue
            for a in node.names:
                full = f"{module}.{a.name}"
                if full in modules:  # a module imported by name
                    bound[a.asname or a.name] = full
                    own_package = full.rsplit(".", 1)[0] == package
                    if a.name.startswith("_") and not own_package:
                        found.append(f"{name} imports {full}")
                elif a.name.startswith("_") and not a.name.startswith("__") and module != name:
                    found.append(f"{name} imports {module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{name} reaches {bound[node.value.id]}.{node.attr}")
    return found


def test_the_private_reach_finder_finds_one(tmp_path):
    mod = tmp_path / "sparsecache" / "a.py"
    mod.parent.mkdir()
    mod.write_text("from .b import _x\nfrom . import b\nb._y()\n")
    modules = {"sparsecache.a": mod, "sparsecache.b": mod}
    assert _private_reaches("sparsecache.a", mod, modules) == ["sparsecache.a imports sparsecache.b._x",
                                                               "sparsecache.a reaches sparsecache.b._y"]


def test_no_module_reaches_into_anothers_private_names():
    """Nor do the scripts or the tests: where a test needs an internal, it is public under a name
    that says what it is (a kernel module such as `codec._omp_cpu` may be imported to test it
    against its reference, but not its private names)."""
    modules = _modules()
    root = PACKAGE.parent
    others = {".".join(p.relative_to(root).with_suffix("").parts): p for d in ("scripts", "tests") for p in (root / d).rglob("*.py")}
    found = [r for name, path in {**modules, **others}.items() for r in _private_reaches(name, path, modules)]
    assert found == []


def test_former_module_names_are_gone():
    """The alias finder that kept #81's former module names importable is removed (#96; the CHANGELOG
    names the moves): a former name is an ImportError, not a second way to the same module."""
    r = subprocess.run([sys.executable, "-c", "import sparsecache.serving"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and "No module named 'sparsecache.serving'" in r.stderr


def test_a_command_module_imports_no_other_command_module():
    """The CLI's command modules share only `cli.options`; what two commands both need is a library
    call (`encode-corpus --calibrate` calls `query.calibrate.recalibrate`, not `calibrate`'s command).
    `cli.main` assembles them."""
    graph = import_graph()
    reaches = {m: sorted(d for d in deps if d.startswith("sparsecache.cli.") and d != "sparsecache.cli.options")
               for m, deps in graph.items() if m.startswith("sparsecache.cli.") and m != "sparsecache.cli.main"}
    assert {m: d for m, d in reaches.items() if d} == {}

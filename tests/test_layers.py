"""The package's floors (README "Layout of the package"): no import circle, no import up a floor.

Every ``import`` of the package's own modules is read from the source (function-level ones
too), so a lazy import that runs back up counts as much as a top-level one.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_replay"

# Rooms (a top-level module or folder of the package) from the ground floor up.
FLOORS = [
    {"distributed"},  # process groups and torch.distributed's names: no other room of the package
    {"support"},
    {"layout", "rollout"},
    {"batch", "scoring", "objectives", "diagnostics", "capture"},  # capture: the sampler's short name, re-exporting rollout's
    {"strategies"},
    {"roles"},
    {"integrations", "trainer"},
    {"cli", "__init__"},
    {"__main__"},
]
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (``from a import b``: ``a.b`` when it is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nemo_replay":
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "nemo_replay")
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {d for d in _imports(p) if d in files and d != m} for m, p in files.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in _graph()}
    assert rooms <= set(FLOOR), f"rooms without a floor in FLOORS: {sorted(rooms - set(FLOOR))}"


def test_no_import_runs_up_a_floor():
    up = sorted(
        f"{m} -> {d}" for m, deps in _graph().items() for d in deps
        if _room(m) != _room(d) and FLOOR[_room(d)] >= FLOOR[_room(m)]
    )
    assert not up, "imports that run up (or across) a floor:\n" + "\n".join(up)


def test_no_import_circle():
    graph = _graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"

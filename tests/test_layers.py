"""tfscale's house: every import runs down, folder by folder, and no module outgrows its room.

FLOORS is the rule, one line per floor, bottom first (docs/architecture.md draws the same house). A room
is a sub-package (`config`, `cluster`, ...), one of data's three wings (`data.convert`, `data.input`,
`data.stage`), or a top-level module (`errors`, `cli`, `export`, the entry shims `train` and
`benchmark`). A module may import the modules of its own room and of rooms on lower floors, never a
room on its own floor or above it; inside a room the imports must not go round in a circle. Imports
inside functions count too (a lazy import is still a dependency). A new module needs no entry here:
its folder places it. A new folder or top-level module does, and the test names one that has none.
"""

import ast
import os

import pytest
from conftest import REPO

FLOORS = [
    # the entry shims (`python -m tfscale.train`, `.benchmark`, `.doctor`): nothing but an import
    ["train", "benchmark", "doctor"],
    # commands over the whole run: benchmarks and planning, studies, export for serving
    ["perf", "study", "export"],
    # the run: its loop, step, schedule controller, callbacks and checkpoints
    ["training"],
    # the scaling planner's model: the run sizes distribute.pack_bytes=auto with it, tfscale-plan prints it
    ["planning"],
    # data, three wings each importing only the wings below it: staging reads input's shard lists,
    # input reads the converter's index files; none reads upward
    ["data.stage"],
    ["data.input"],
    ["data.convert", "data"],
    # what the run is built from: models and optimisers, the launcher, the cluster
    ["model", "launch"],
    ["cluster"],
    # the command lines and the workdir's files
    ["cli", "workdir"],
    # every key, its accepted values and its checks (config.names imports nothing of tfscale)
    ["config"],
    ["io"],
    ["errors", "logs", "compat", "tfscale"],
]


def modules() -> dict[str, str]:
    """{dotted name under tfscale (the package itself: "tfscale"): path}, recipes (configs/) aside."""
    root = os.path.join(REPO, "tfscale")
    found = {}
    for directory, _, files in os.walk(root):
        if os.path.relpath(directory, root).split(os.sep)[0] == "configs":
            continue
        for name in files:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(directory, name), root)[:-3].replace(os.sep, ".")
                found[relative.removesuffix("__init__").rstrip(".") or "tfscale"] = os.path.join(directory, name)
    return found


def room_of(module: str) -> str:
    """The room a module lives in: its sub-package (data: its wing), or itself at the top."""
    parts = module.split(".")
    if parts[0] == "data" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def floor_of() -> dict[str, int]:
    """{room: its floor}, 1 at the bottom (as docs/architecture.md numbers them)."""
    return {room: height for height, rooms in enumerate(reversed(FLOORS), start=1) for room in rooms}


def dotted(target: str) -> str:
    """`tfscale.data.input.pipeline` -> `data.input.pipeline`, the names rooms use (`tfscale` itself stays)."""
    return target.removeprefix("tfscale.") if target.startswith("tfscale.") else target


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The tfscale modules `path` imports, anywhere in it."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tfscale.data.input import pipeline` imports the module pipeline; `from tfscale.io import x`, io
            targets = [f"{node.module}.{alias.name}" if dotted(f"{node.module}.{alias.name}") in known
                       else node.module for alias in node.names]
        else:
            continue
        found |= {dotted(target) for target in targets
                  if (target == "tfscale" or target.startswith("tfscale.")) and dotted(target) in known}
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def test_every_room_is_on_exactly_one_floor():
    listed = [room for rooms in FLOORS for room in rooms]
    assert sorted(set(listed)) == sorted(listed), "a room is listed twice"
    rooms = {room_of(module) for module in modules()}
    assert rooms == set(listed), (f"rooms on no floor: {sorted(rooms - set(listed))}; "
                                  f"floors naming rooms that are gone: {sorted(set(listed) - rooms)}")


def test_every_import_runs_down_or_stays_in_its_room():
    height = floor_of()
    upward = [f"{name} ({room_of(name)}, floor {height[room_of(name)]}) imports {target} "
              f"({room_of(target)}, floor {height[room_of(target)]})"
              for name, targets in sorted(import_graph().items()) for target in sorted(targets)
              if room_of(target) != room_of(name) and height[room_of(target)] >= height[room_of(name)]]
    assert not upward, "imports that do not run down:\n" + "\n".join(upward)


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as the list of its modules (first repeated at the end), or []."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_imports_go_round_in_a_circle():
    assert cycle_in(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) == []


MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    """A module past 400 lines splits along its own lines (DESIGN.md); recipes (configs/) aside."""
    long = {}
    for name, path in modules().items():
        with open(path) as f:
            lines = sum(1 for _ in f)
        if lines > MAX_MODULE_LINES:
            long[name] = lines
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


@pytest.mark.parametrize("source, expected", [
    ("from tfscale.data.input import pipeline\n", {"data.input.pipeline"}),
    ("def f():\n    from tfscale.training import engine\n", {"training.engine"}),
    ("import tfscale.io\n", {"io"}),
    ("from tfscale.errors import ConfigError\n", {"errors"}),
    ("from tfscale.config.names import BACKENDS\n", {"config.names"}),
    ("import os\nfrom absl import logging\n", set()),
])
def test_the_import_reader_sees_every_form(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of("x", str(path), set(modules())) == expected


@pytest.mark.parametrize("module, room", [
    ("data.input.pipeline", "data.input"), ("data", "data"), ("training.engine", "training"),
    ("config", "config"), ("errors", "errors"), ("tfscale", "tfscale"),
])
def test_rooms_are_folders_and_data_wings(module, room):
    assert room_of(module) == room

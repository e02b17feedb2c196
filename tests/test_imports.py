"""The house rules of ARCHITECTURE.md, read from the source: no import cycle among the modules
of our packages (counting imports under TYPE_CHECKING and inside functions: a cycle there
still ties the modules together), and imports that go one way only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).parents[1]
PACKAGES = ("trainer", "observatory", "web", "spikewatch")  # folders at the checkout's root


def _import_name(path: Path) -> str:
    """spikewatch/hf.py -> spikewatch.hf; trainer/watch.py -> spikewatch.trainer.watch (every
    import name is spikewatch's own; spikewatch/trainer is a link to trainer/, not walked)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    prefix = () if parts[0] == "spikewatch" else ("spikewatch",)
    return ".".join((*prefix, *parts)).removesuffix(".__init__")


def _package(module: str) -> str:
    """spikewatch.trainer.watch -> trainer; spikewatch.hf -> spikewatch."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else parts[0]


def _imports() -> dict[str, set[str]]:
    """module -> the modules of our packages it imports (anywhere in its file)."""
    modules: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = _import_name(path)
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            modules[name] = deps
    return {m: {d for d in deps if d in modules and d != m} for m, deps in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle() -> None:
    graph = _imports()
    assert (
        "spikewatch.trainer.builtin.loop" in graph
        and "spikewatch.trainer.core.step_core" in graph["spikewatch.trainer.builtin.loop"]
    )
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_imports_go_one_way() -> None:
    """observatory imports neither trainer nor web; trainer never imports web; nothing imports
    web but web itself."""
    for module, deps in _imports().items():
        pkg = _package(module)
        used = {_package(d) for d in deps}
        if pkg == "observatory":
            assert not used & {"trainer", "web", "spikewatch"}, module
        if pkg != "web":
            assert "web" not in used, module


METRIC_NAME = re.compile(r"^(train|optim|perf|val)/\w+$|^layer/(\*|\d+)/(\S+/)?\w+$")


def test_metric_names_are_spelled_in_one_module() -> None:
    """No string literal in our packages is a metric name or template, except in
    observatory/metric_names.py, which every package imports (tests aside)."""
    home = REPO / "observatory" / "metric_names.py"
    found = []
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            if path == home:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if METRIC_NAME.match(node.value):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "\n".join(found)
    assert METRIC_NAME.match("layer/*/self_attn/grad_norm") and METRIC_NAME.match("val/loss")


def test_product_code_carries_no_issue_numbers() -> None:
    """History is git's: a comment says why, not which issue asked (CONVENTIONS.md)."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in PACKAGES
        for path in sorted((REPO / folder).rglob("*"))
        if path.suffix in (".py", ".toml", ".html", ".js", ".css")
        and "spikewatch/trainer" not in str(path)
        and not path.is_symlink()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []

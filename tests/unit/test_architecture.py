"""The import rules between the parts (README, "Layout"; issue 16), read from the source with `ast`:
nothing of the project is imported here.

Counted: every `import` and `from ... import` (absolute or relative, at module level or inside a
function, since a lazy import is still a dependency), except those under `if TYPE_CHECKING:`.
`from pkg import name` counts as an import of `pkg` and, when `pkg.name` is a module, of that module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("batchgate", "shared", "gateway", "gpu_worker")

SCHEDULER = ("gpu_worker.scheduler", "gpu_worker.service_model", "gpu_worker.lane_queue", "gpu_worker.job",
             "gpu_worker.dynamic_stage", "gpu_worker.prefill_budget",
             "shared.deadlines")  # pure decisions: admit, expire, evict, and what they decide over
# worker modules that must stay as pure as the scheduler (no torch, no engine); rename here when they move
# the compute side above the engine imports no torch either: the loop, its thread and commands, the runner port
PURE_WORKER = (*SCHEDULER, "gpu_worker.stop_strings", "gpu_worker.outcomes", "gpu_worker.runner", "gpu_worker.commands",
               "gpu_worker.compute_thread", "gpu_worker.model_loop", "gpu_worker.load_report", "gpu_worker.engines",
               "gpu_worker.turns", "gpu_worker.sequences", "gpu_worker.echo_runner", "gpu_worker.generation_result")
# torch: rows, KV cache, masks, forward
ENGINE = ("gpu_worker.engine", "gpu_worker.kv_cache", "gpu_worker.sampling", "gpu_worker.attention",
          "gpu_worker.exactness", "gpu_worker.chunked_prefill", "gpu_worker.fused_step")
TORCH = ("torch", "transformers")  # transformers loads torch
MAX_WORKER_MODULE_LINES = 250  # non-blank lines; the largest worker module must stay below


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the project root
    line: int
    names: tuple[str, ...]  # the dotted names the statement imports
    text: str  # the statement as written

    def where(self) -> str:
        return f"{self.path}:{self.line} `{self.text}`"


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


@cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)[0]] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the `else:` of a TYPE_CHECKING block does run
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    parts = package.split(".")
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for module, path in modules().items():
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(ROOT))
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            if isinstance(node, ast.Import):
                names = tuple(a.name for a in node.names)
            else:
                base = _base(module, is_package, node)
                names = (base, *(f"{base}.{a.name}" for a in node.names if a.name != "*"))
            found.append(Import(module, rel, node.lineno, names, ast.unparse(node)))
    return tuple(sorted(found, key=lambda i: (i.path, i.line)))


def internal(name: str) -> str | None:
    """The project module a dotted name lives in (the longest prefix that is one), or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules():
            return candidate
    return None


@cache
def edges() -> dict[str, dict[str, Import]]:
    """module -> {project module it imports: the first statement that does}."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules()}
    for imp in imports():
        for name in imp.names:
            target = internal(name)
            if target and target != imp.module:
                graph[imp.module].setdefault(target, imp)
    return graph


def _in(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def forbidden(source_part: str, target_parts: tuple[str, ...], *, exempt: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for module, targets in edges().items():
        if not _in(module, source_part) or any(_in(module, e) for e in exempt):
            continue
        for target, imp in targets.items():
            if any(_in(target, t) for t in target_parts):
                bad.append(f"{module} -> {target}: {imp.where()}")
    return bad


def _message(rule: str, bad: list[str], what: str = "import(s)") -> str:
    return f"{rule}; {len(bad)} {what} break it:\n  " + "\n  ".join(bad)


def test_the_project_is_where_the_rules_look():
    for module in ("batchgate.cli", "shared.config", "gateway.dispatcher", *SCHEDULER, *ENGINE):
        assert module in modules(), f"{module} not found under {ROOT}: the rules below would check nothing"
    assert imports(), "no import statements found"


def test_the_reader_counts_relative_and_lazy_imports_but_not_type_checking_ones():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nelse:\n    import os\n"
                     "def f():\n    from .kv_cache import Slot\n    from .. import config\n")
    nodes = list(_import_nodes(tree))
    assert sorted(ast.unparse(n) for n in nodes) == [
        "from .. import config", "from .kv_cache import Slot", "from typing import TYPE_CHECKING", "import os"]
    relative = {ast.unparse(n): n for n in nodes if isinstance(n, ast.ImportFrom) and n.level}
    assert _base("gpu_worker.engine", False, relative["from .kv_cache import Slot"]) == "gpu_worker.kv_cache"
    assert _base("shared.sdk.client", False, relative["from .. import config"]) == "shared"
    assert _base("shared.sdk", True, relative["from .kv_cache import Slot"]) == "shared.sdk.kv_cache"


def test_shared_knows_no_caller():
    bad = forbidden("shared", ("gateway", "gpu_worker", "batchgate"), exempt=("shared.sdk",))
    assert not bad, _message("shared/ imports nothing from gateway/, gpu_worker/ or the entry points (batchgate/)",
                             bad)


def test_the_sdk_is_a_client_without_server_code():
    bad = forbidden("shared.sdk", ("gateway", "gpu_worker", "batchgate"))
    assert not bad, _message("shared/sdk/ imports no gateway module (nor gpu_worker/ or batchgate/): "
                             "its direct mode reaches Redis through shared/ only", bad)


def test_the_gateway_never_loads_the_worker():
    bad = forbidden("gateway", ("gpu_worker", "batchgate"))
    assert not bad, _message("gateway/ imports nothing from gpu_worker/ (handlers never load torch) or batchgate/",
                             bad)


def test_the_worker_talks_to_gateways_only_through_redis():
    bad = forbidden("gpu_worker", ("gateway", "batchgate"))
    assert not bad, _message("gpu_worker/ imports nothing from gateway/ or batchgate/", bad)


def _torch_chain(start: str) -> list[str] | None:
    """The import chain by which `start` loads torch (through project modules), or None."""
    seen = {start}
    paths: list[tuple[str, list[str]]] = [(start, [])]
    while paths:
        module, chain = paths.pop(0)
        for imp in imports():
            if imp.module != module:
                continue
            heavy = next((n for n in imp.names if n.split(".")[0] in TORCH), None)
            if heavy:
                return [*chain, f"{module} -> {heavy}: {imp.where()}"]
        for target, imp in edges()[module].items():
            if target not in seen:
                seen.add(target)
                paths.append((target, [*chain, f"{module} -> {target}: {imp.where()}"]))
    return None


def test_the_scheduler_is_pure():
    missing = [m for m in PURE_WORKER if m not in modules()]
    assert not missing, f"listed as pure in {Path(__file__).name} but not found (moved? update PURE_WORKER): {missing}"
    bad = []
    for module in PURE_WORKER:
        chain = _torch_chain(module)
        if chain:
            bad.append(f"{module} loads torch:\n    " + "\n    ".join(chain))
    bad += [b for module in PURE_WORKER for b in forbidden(module, ENGINE)]
    assert not bad, _message(f"the scheduler and the pure worker modules {list(PURE_WORKER)} import no torch "
                             f"(not even through another module) and nothing from the engine {list(ENGINE)}", bad)


def test_the_engine_does_not_decide():
    bad = [b for module in ENGINE for b in forbidden(module, SCHEDULER)]
    assert not bad, _message(f"the engine modules {list(ENGINE)} import nothing from the scheduler {list(SCHEDULER)}",
                             bad)


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan; the depth is at most the module count)."""
    graph = {m: sorted(t) for m, t in edges().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _a_cycle(component: list[str]) -> list[str]:
    """One concrete cycle through the component's first module, each step with the import that makes it."""
    members, start = set(component), component[0]
    paths: list[tuple[str, list[str]]] = [(start, [])]
    seen = {start}
    while paths:
        module, chain = paths.pop(0)
        for target, imp in sorted(edges()[module].items()):
            step = f"{module} -> {target}: {imp.where()}"
            if target == start:
                return [*chain, step]
            if target in members and target not in seen:
                seen.add(target)
                paths.append((target, [*chain, step]))
    return []


def test_no_import_cycles():
    bad = [f"{' <-> '.join(c)}:\n    " + "\n    ".join(_a_cycle(c)) for c in _cycles()]
    assert not bad, _message("no import cycle among the project's modules", bad)


def test_the_largest_worker_module_is_small():
    sizes = {m: sum(1 for line in p.read_text(encoding="utf-8").splitlines() if line.strip())
             for m, p in modules().items() if _in(m, "gpu_worker")}
    big = [f"{modules()[m].relative_to(ROOT)}: {n} non-blank lines"
           for m, n in sorted(sizes.items(), key=lambda item: -item[1]) if n >= MAX_WORKER_MODULE_LINES]
    assert not big, _message(f"every gpu_worker module has fewer than {MAX_WORKER_MODULE_LINES} non-blank lines",
                             big, "module(s)")

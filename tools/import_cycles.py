"""Import cycles between fedgpu's modules, file to file, on the layout fedgpu installs as.

import-linter's contracts (pyproject.toml) keep the packages in order; two files of one
package that import each other pass them all. This finds every such loop in the whole
package. The graph is grimp's (what import-linter builds on), which counts imports under
`if TYPE_CHECKING:` and inside functions too: a loop only a type checker follows still means
neither file can be read, moved or tested without the other.

    python tools/import_cycles.py [--root DIR]

Prints each cycle (its modules, sorted) and exits 1 when there is one not listed in KNOWN.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lint_layers import stage  # noqa: E402  (a sibling script, not a package)

# Cycles tolerated while a fix is under way elsewhere (each while its files exist): none now.
KNOWN: list[frozenset[str]] = []

# Run in a fresh interpreter whose path starts at the staged layout: the caller may have
# imported fedgpu from the repository already (the tests do).
_GRAPH = """
import json, grimp
g = grimp.build_graph("fedgpu", include_external_packages=False,
                      exclude_type_checking_imports=False, cache_dir=None)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def import_graph(root: Path) -> dict[str, list[str]]:
    """Module -> the fedgpu modules it imports (anywhere in the file)."""
    with tempfile.TemporaryDirectory(prefix="fedgpu-cycles-") as tmp:
        stage(root.resolve(), Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        out = subprocess.run([sys.executable, "-c", _GRAPH], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=300, check=True)
    graph: dict[str, list[str]] = json.loads(out.stdout)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    graph = import_graph(args.root)
    bad = 0
    found = cycles(graph)
    for cycle in found:
        known = frozenset(cycle) in KNOWN
        bad += not known
        print(f"{'known cycle' if known else 'CYCLE'} among: {', '.join(cycle)}")
    for gone in set(KNOWN) - {frozenset(c) for c in found}:
        print(f"known cycle gone (delete it from KNOWN): {', '.join(sorted(gone))}")
    print(f"{len(graph)} modules, {bad} import cycle(s) not known")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

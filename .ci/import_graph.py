#!/usr/bin/env python3
"""Print the import graph of the titanmac_c package's modules, and fail (exit 1) on a cycle or on
an edge that runs up the layers docs/architecture.md describes:

    _C (the extension) < _internal < functional < optim < deep_nested < titanmac_c (__init__)
    testing: the references, above everything; nothing imports them

Read from the sources with ast (nothing is imported, no build is needed). Usage:
    python .ci/import_graph.py [path/to/titanmac_c]
"""

import ast
import sys
import textwrap
from pathlib import Path

LAYERS = ["_C", "_internal", "functional", "optim", "deep_nested", "__init__", "testing"]


def module_name(path, root):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer(module):
    """The layer of a module: its first part below the package ('__init__' for the package)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports_of(path, module, is_package, known):
    """The package's modules that the module at path imports (relative or absolute)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from pkg import mod" names a module; "from mod import name" names the module
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                     for a in node.names]
        else:
            continue
        for name in names:
            if name == "titanmac_c" or name.startswith("titanmac_c."):
                while name not in known and "." in name:
                    name = name.rpartition(".")[0]
                if name != module:
                    found.add(name)
    return found


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "titanmac_c")
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files) | {"titanmac_c._C"}
    graph = {m: sorted(imports_of(p, m, p.name == "__init__.py", known))
             for m, p in files.items()}
    problems = []
    for m, targets in graph.items():
        shown = []
        for t in targets:
            up = LAYERS.index(layer(t)) > LAYERS.index(layer(m))
            if up:
                problems.append(f"upward edge: {m} -> {t}")
            shown.append(t.removeprefix("titanmac_c.") + (" (UP)" if up else ""))
        line = f"{m.removeprefix('titanmac_c.') or 'titanmac_c'} -> {', '.join(shown) or '-'}"
        print(textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False))
    # cycles, by depth-first search
    state = {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for t in graph.get(m, ()):
            if state.get(t) == "open":
                problems.append("cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} edges, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

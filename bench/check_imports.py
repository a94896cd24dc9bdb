"""Static import check: every project import in the tree resolves with jedi (the analyser behind many
editors' go-to-definition), with nothing installed that it would need to know about.

A project import is a relative one (`from ..formats.config import ModelArgs`), an absolute one into the
project (`streamoe.*`, `bench.*`, `tests.*`), or a sibling module next to a script (`import common`). For
each, every component of the module path and every imported name is resolved with
`jedi.Script.goto(..., follow_imports=True)`; it counts as resolved when jedi lands on a definition in a
file of this repository (so an installed copy elsewhere cannot make it pass). Exit status 1 if any does not.

    python -m bench.check_imports            # from the repository root; writes bench/results/imports.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jedi

from .common import write_result

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("convert", "runtime", "formats", "schemas", "streamoe", "tests", "bench", "examples")
PACKAGES = ("streamoe", "bench", "tests")  # absolute imports of these are project imports


def project_files(root: Path) -> list[Path]:
    """Every .py file under the project folders, each once: the streamoe/ links to the top-level folders
    are not followed (those files are checked where they live)."""
    out: list[Path] = []
    for folder in FOLDERS:
        base = root / folder
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(root)
            if any((root / Path(*rel.parts[:i])).is_symlink() for i in range(1, len(rel.parts))):
                continue
            if any(part in (".venv", "__pycache__", "build") or part.startswith(".") for part in rel.parts):
                continue
            out.append(p)
    return out


def import_nodes(node):
    """Every import statement of a parso tree, nested ones (inside functions) included."""
    for child in getattr(node, "children", ()):
        if child.type in ("import_name", "import_from"):
            yield child
        else:
            yield from import_nodes(child)


def project_names(imp, siblings: set[str]) -> list:
    """The parso Names of one import statement to resolve, or [] when it is not a project import."""
    if imp.type == "import_from":
        path = imp.get_from_names()
        if imp.level == 0 and (not path or (path[0].value not in PACKAGES and path[0].value not in siblings)):
            return []
        return list(path) + [name for name, _alias in imp._as_name_tuples()]
    names = []
    for path, _alias in imp._dotted_as_names():
        if path[0].value in PACKAGES or path[0].value in siblings:
            names += path
    return names


def resolved(defs, file: Path, name, root: Path) -> str | None:
    """Where a goto landed (a repo-relative path), or None if nowhere in this repository."""
    for d in defs:
        if d.module_path is None:
            continue
        target = Path(d.module_path).resolve()
        if target == file.resolve() and d.line == name.start_pos[0]:
            continue  # stopped at the import itself: not followed
        try:
            return str(target.relative_to(root))
        except ValueError:
            continue
    return None


def check(root: Path) -> dict:
    project = jedi.Project(root)
    files = project_files(root)
    per_folder: dict[str, dict[str, int]] = {}
    unresolved: list[dict] = []
    n_statements = 0
    for f in files:
        code = f.read_text()
        script = jedi.Script(code, path=f, project=project)
        tree = script._module_node  # the parso tree jedi itself parsed
        siblings = {p.stem for p in f.parent.glob("*.py")} - {f.stem}
        folder = f.relative_to(root).parts[0]
        counts = per_folder.setdefault(folder, {"files": 0, "import_statements": 0, "names": 0, "unresolved": 0})
        counts["files"] += 1
        for imp in import_nodes(tree):
            names = project_names(imp, siblings)
            if not names:
                continue
            n_statements += 1
            counts["import_statements"] += 1
            for name in names:
                counts["names"] += 1
                line, col = name.start_pos
                where = resolved(script.goto(line, col, follow_imports=True), f, name, root)
                if where is None:
                    counts["unresolved"] += 1
                    unresolved.append({"file": str(f.relative_to(root)), "line": line, "name": name.value,
                                       "statement": imp.get_code().strip()})
    return {"files": len(files), "import_statements": n_statements,
            "names": sum(c["names"] for c in per_folder.values()), "unresolved": len(unresolved),
            "per_folder": per_folder, "unresolved_names": unresolved, "jedi": jedi.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="repository to check (default: this one)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not write bench/results/imports.json")
    a = ap.parse_args()
    t = time.perf_counter()
    res = check(a.root.resolve())
    res["seconds"] = round(time.perf_counter() - t, 1)
    for folder, c in res["per_folder"].items():
        print(f"{folder:<10} {c['files']:4d} files {c['import_statements']:5d} project imports "
              f"{c['names']:5d} names {c['unresolved']:3d} unresolved", file=sys.stderr)
    for u in res["unresolved_names"]:
        print(f"UNRESOLVED {u['file']}:{u['line']}: {u['name']!r} in `{u['statement']}`", file=sys.stderr)
    print(f"{res['files']} files, {res['import_statements']} project import statements, {res['names']} names: "
          f"{res['unresolved']} unresolved (jedi {res['jedi']}, {res['seconds']} s)", file=sys.stderr)
    if not a.no_write:
        write_result("imports", "imports", [res])
    sys.exit(1 if res["unresolved"] else 0)


if __name__ == "__main__":
    main()

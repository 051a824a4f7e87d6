"""Promise 10's audit kept honest: every function of the modules a root process runs that calls a file API by
path (open, os.*, shutil.*, a Path's methods) is listed in docs/ARCHITECTURE.md's "Root and paths" table, with
how many such calls it makes and the rule each follows. A new call, or a function that gains one, fails here
until someone has checked it against the rule and listed it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from docs_pages import DOCS, REPO

AUDITED = ("server", "scheduler", "artifacts", "monitor", "gpu", "security")
"""The sub-packages whose code a root process may run (with the client's and the job's own, which the table
says are never root's)."""

RULES = {"tree", "fds", "handed", "given", "proc", "cgroup", "ns", "user", "simulated", "none"}
"""The table's rules (docs/ARCHITECTURE.md, Root and paths, says what each means)."""

_OS = {"open", "stat", "lstat", "listdir", "scandir", "walk", "mkdir", "makedirs", "rmdir", "unlink", "remove",
       "rename", "replace", "chmod", "chown", "lchown", "symlink", "link", "mkfifo", "utime", "access", "readlink",
       "truncate", "removedirs", "renames"}
_OS_PATH = {"exists", "isdir", "isfile", "islink", "getsize", "realpath", "lexists", "getmtime"}
_SHUTIL = {"rmtree", "copy", "copy2", "copyfile", "copytree", "move", "chown", "copymode", "copystat"}
_PATH = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "unlink", "rmdir", "rename",
         "chmod", "iterdir", "glob", "rglob", "exists", "is_dir", "is_file", "stat", "lstat", "touch", "symlink_to",
         "resolve", "samefile", "is_symlink", "hardlink_to", "readlink"}
"""Path methods that name a file (not `replace` nor `group`, which strings and matches share)."""


def _path_call(node: ast.Call) -> bool:
    """Whether `node` calls a file API by path (one given a directory descriptor does not count)."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "open"
    if not isinstance(func, ast.Attribute):
        return False
    owner = func.value
    if isinstance(owner, ast.Name) and owner.id in ("os", "shutil"):
        relative = {keyword.arg for keyword in node.keywords} & {"dir_fd", "src_dir_fd"}
        return func.attr in (_OS if owner.id == "os" else _SHUTIL) and not relative
    if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and (owner.value.id, owner.attr) == (
            "os", "path"):
        return func.attr in _OS_PATH
    return func.attr in _PATH and not (isinstance(owner, ast.Name) and owner.id in ("os", "shutil", "self"))


def found() -> dict[str, int]:
    """`module:function` -> its calls of a file API by path, over the AUDITED packages."""
    counts: dict[str, int] = {}
    for package in AUDITED:
        for path in sorted((REPO / "rpycdl" / package).glob("*.py")):
            module = path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")

            def visit(node: ast.AST, where: tuple[str, ...], module: str = module) -> None:
                for child in ast.iter_child_nodes(node):
                    inner = (*where, child.name) if isinstance(
                        child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else where
                    if isinstance(child, ast.Call) and _path_call(child):
                        key = f"{module}:{'.'.join(where) or '<module>'}"
                        counts[key] = counts.get(key, 0) + 1
                    visit(child, inner)

            visit(ast.parse(path.read_text()), ())
    return counts


def listed() -> dict[str, tuple[int, str]]:
    """docs/ARCHITECTURE.md's table: `module:function` -> (calls, rule)."""
    text = (DOCS / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Root and paths\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for match in re.finditer(r"^\| `([\w.]+:[\w.<>]+)` \| (\d+) \| (\w+) \|", section, re.MULTILINE):
        rows[match.group(1)] = (int(match.group(2)), match.group(3))
    return rows


def test_every_path_call_a_root_process_may_make_is_audited():
    table, calls = listed(), found()
    assert len(calls) > 50, "the scan found too few calls: it no longer sees them"
    unknown = sorted(f"{where} ({count} call(s))" for where, count in calls.items() if where not in table)
    assert not unknown, ("file calls by path not in docs/ARCHITECTURE.md's Root and paths table: check each against "
                         "the rule and list it: " + "; ".join(unknown))
    changed = sorted(f"{where}: {table[where][0]} listed, {count} now" for where, count in calls.items()
                     if table[where][0] != count)
    assert not changed, "functions whose file calls changed since they were audited: " + "; ".join(changed)
    stale = sorted(set(table) - set(calls))
    assert not stale, "listed in the Root and paths table, but no longer there: " + "; ".join(stale)
    assert {rule for _, rule in table.values()} <= RULES, {rule for _, rule in table.values()} - RULES


def test_the_scan_sees_each_kind_of_call(tmp_path):
    samples = ["open(p)", "os.open(p, 0)", "os.chown(p, 0, 0)", "shutil.rmtree(p)", "os.path.realpath(p)",
               "p.read_text()", "p.iterdir()"]
    relative = ["os.open(p, 0, dir_fd=fd)", "os.chown(n, 0, 0, dir_fd=fd)", "text.replace('a', 'b')",
                "os.getpid()"]
    for code, expected in [*((code, True) for code in samples), *((code, False) for code in relative)]:
        call = ast.parse(code).body[0].value
        assert _path_call(call) is expected, code
    assert Path(DOCS / "ARCHITECTURE.md").exists()

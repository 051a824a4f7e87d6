"""The docs site builds with --strict and offline, and every code example of the user guide and of the README
runs, as a reader would run it, against a real registry and server on simulated GPUs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import docs_pages
import pytest
from docs_pages import README, REPO

from rpycdl.site.local import LocalCluster

BIN = str(Path(sys.executable).parent)
OFFLINE = {variable: "http://127.0.0.1:9" for variable in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                                                          "ALL_PROXY", "all_proxy")}
"""A proxy nobody listens on, for every HTTP client that honours one: a build that fetches anything fails."""


def test_the_site_builds_strict_and_offline(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(REPO / "mkdocs.yml"), "--site-dir", str(site)], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env={**os.environ, **OFFLINE, "no_proxy": "", "NO_PROXY": "",
                                                        "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    reference = (site / "api" / "index.html").read_text()
    for name in ("rpycdl.connect", "rpycdl.client.RemoteRoot.run_code", "rpycdl.Job.download", "rpycdl.RpycdlError"):
        assert f'id="{name}"' in reference, f"the API reference has no entry for {name}"
    assert "Floods of connections" in (site / "benchmarks" / "index.html").read_text()  # BENCHMARKS.md, included
    pages = [path.read_text() for path in site.rglob("*.html")]
    assert not [page for page in pages if "fonts.googleapis.com" in page], "a page loads fonts from the internet"


FILES = {
    "train.py": '''"""The docs' training: prints its progress, leaves model.pt in its output directory."""
import argparse
import os


def main(lr):
    print(f"training with lr {lr}", flush=True)
    out = os.environ.get("RPYCDL_OUTPUT_DIR")
    if out:
        with open(os.path.join(out, "model.pt"), "w") as model:
            model.write(f"weights trained with lr {lr}")
    return {"lr": lr, "loss": 0.1}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.01)
    main(parser.parse_args().lr)
''',
    "train.sh": '#!/bin/sh\nexec python train.py "$@"\n',
}
"""What the examples' directory holds, as a project's: train.py (also in src/, for --working-dir ./src), train.sh."""

SITE = {"gpu01": "127.0.0.1"}
"""The site the examples name, as the test's: a host name they dial (the port is the server's, below)."""

PRELUDE = '''import subprocess as _subprocess


def _bash(script, where):
    """A bash block of the page, as a reader types it; stops the page at the first command that fails."""
    print(f"$ ({where})", flush=True)
    if _subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script]).returncode:
        raise SystemExit(f"{where}: a command failed")

'''

PAGES = [*docs_pages.section("User guide"), README]


def _project(directory: Path) -> None:
    (directory / "src").mkdir()
    for name, text in FILES.items():
        (directory / name).write_text(text)
    (directory / "src" / "train.py").write_text(FILES["train.py"])
    (directory / "train.sh").chmod(0o755)


def _script(page: Path, port: int) -> tuple[str, list[docs_pages.Block]]:
    """The page's runnable blocks as one Python script (bash blocks through _bash), in the page's order; and
    the blocks only checked for syntax."""
    parts, skipped = [PRELUDE], []
    for block in docs_pages.blocks(page):
        if block.language not in ("python", "bash"):
            continue
        if block.syntax_only:
            skipped.append(block)
            continue
        code = block.code.replace("18861", str(port))
        for name, test_value in SITE.items():
            code = code.replace(name, test_value)
        parts += [f"# --- {block.where}\n", code if block.language == "python" else
                  f"_bash({code!r}, {block.where!r})\n"]
    return "\n".join(parts), skipped


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_the_pages_examples_run(page, lock_dir, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    _project(project)
    with LocalCluster(lock_dir) as cluster, pytest.MonkeyPatch.context() as patch:
        patch.chdir(project)  # the server's directory, where `rpycdl run -- python train.py` runs
        port = cluster.add_server("pytorch", "fake:2x16GiB", "--framework-version", "2.5",
                                  env={"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"})[1]
        patch.chdir(REPO)
        script, skipped = _script(page, port)
        ran = subprocess.run([sys.executable, "-c", script], cwd=project, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "RPYCDL_REGISTRY": cluster.registry_address,
                                               "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                                               "PYTHONUNBUFFERED": "1"})
    numbered = "\n".join(f"{number:4} {line}" for number, line in enumerate(script.splitlines(), 1))
    assert ran.returncode == 0, f"{numbered}\n--- its output:\n{ran.stdout}\n{ran.stderr}"
    for block in skipped:
        _check_syntax(block)


def _check_syntax(block: docs_pages.Block) -> None:
    """A block marked syntax only: Python that parses, or bash that `bash -n` takes."""
    if block.language == "python":
        ast.parse(block.code, block.where)
    else:
        checked = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        assert checked.returncode == 0, f"{block.where}: {checked.stderr}"


def test_every_example_runs_or_says_why_not():
    """The pages' code blocks are Python or bash (each runs, or is marked syntax only with a reason), or output
    shown as text: no example goes unchecked because of its fence's language."""
    for page in PAGES:
        for block in docs_pages.blocks(page):
            assert block.language in ("python", "bash", "text"), \
                f"{block.where}: a ```{block.language} block, which the docs' tests neither run nor check"

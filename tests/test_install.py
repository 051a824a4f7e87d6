"""Installing rpycdl the way scripts/quickstart.sh and scripts/test.sh do (scripts/common.sh's install_editable)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_a_script_next_to_the_clone_imports_the_installed_rpycdl(tmp_path):
    """~/work/rpycdl is the clone, ~/work/myscript.py does `import rpycdl`: the clone's root, a directory named
    rpycdl on sys.path (the script's own directory), must not shadow the editable install as an empty
    namespace package ("module 'rpycdl' has no attribute 'connect'")."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "rpycdl").symlink_to(REPO, target_is_directory=True)
    (work / "myscript.py").write_text("import rpycdl\nprint(rpycdl.__file__, rpycdl.connect.__name__)\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # pip and rpycdl's dependencies come from this environment (a path in a .pth file, whose own .pth files
    # Python does not read): --no-deps is the only difference from the scripts' install. The build backend
    # (setuptools) comes from the package index, in pip's isolated build environment, as it does for them.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(["bash", "-c", '. scripts/common.sh && install_editable "$0" . --no-deps', str(python)],
                             cwd=work / "rpycdl", capture_output=True, text=True, timeout=300)
    if install.returncode and "satisfies the requirement setuptools" in install.stderr:
        pytest.skip(f"no package index to build the install from: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr
    ran = subprocess.run([str(python), "myscript.py"], cwd=work, capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert ran.returncode == 0, ran.stderr
    where, connect = ran.stdout.split()
    assert Path(where).resolve() == REPO / "rpycdl" / "__init__.py" and connect == "connect", ran.stdout

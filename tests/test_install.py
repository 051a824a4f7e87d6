"""Installing rpycdl the way scripts/quickstart.sh and scripts/test.sh do (scripts/common.sh's install_editable)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def beside_clone(tmp_path_factory) -> tuple[Path, Path]:
    """~/work/rpycdl is the clone, installed the quick start's way (scripts/common.sh's install_editable, in
    a venv of its own); scripts go in ~/work. Returns that directory and the venv's python."""
    tmp_path = tmp_path_factory.mktemp("beside-clone")
    work = tmp_path / "work"
    work.mkdir()
    (work / "rpycdl").symlink_to(REPO, target_is_directory=True)
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
    return work, python


def run_beside(beside_clone: tuple[Path, Path], script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `script` as ~/work/myscript.py with the editable install's python."""
    work, python = beside_clone
    (work / "myscript.py").write_text(script)
    return subprocess.run([str(python), "myscript.py", *args], cwd=work, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_a_script_next_to_the_clone_imports_the_installed_rpycdl(beside_clone):
    """A directory named rpycdl on sys.path (the clone's root, beside the script) must not shadow the editable
    install as an empty namespace package ("module 'rpycdl' has no attribute 'connect'")."""
    ran = run_beside(beside_clone, "import rpycdl\nprint(rpycdl.__file__, rpycdl.connect.__name__)\n")
    assert ran.returncode == 0, ran.stderr
    where, connect = ran.stdout.split()
    assert Path(where).resolve() == REPO / "rpycdl" / "__init__.py" and connect == "connect", ran.stdout


CHECKPOINTING = """
import sys
import rpycdl

def train(steps):
    out = rpycdl.output_dir()
    with open(f"{out}/ckpt.txt", "w") as ckpt:
        ckpt.write(f"{steps} steps")
    return rpycdl.save_artifact(f"{out}/ckpt.txt"), steps

with rpycdl.connect(host="127.0.0.1", port=int(sys.argv[1])) as conn:
    print(*conn.root.run_code(train, 3))
    job = conn.root.submit(train, 4)
    print(*job.result(timeout=60))
    job.download(sys.argv[2])
"""


def test_a_function_using_the_scripts_top_level_import_of_an_editable_rpycdl_runs(beside_clone, server, tmp_path):
    """The checkpoint example's shape (docs/data.md), from a script beside the clone: `train` uses the module `rpycdl`
    of the script's globals. dill copies a module whose file is outside the interpreter's prefix (an editable
    install's) by value, ctypes and all, and failed; rpycdl.wire.codec names every imported module."""
    ran = run_beside(beside_clone, CHECKPOINTING, str(server("pytorch", "fake:1")), str(tmp_path / "got"))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["ckpt.txt 3", "ckpt.txt 4"], ran.stdout
    assert (tmp_path / "got" / "ckpt.txt").read_text() == "4 steps"


CLIENT_DEPENDENCIES = ("rpyc", "plumbum", "dill", "pathspec", "tqdm", "blake3", "tomli")
"""What `pip install rpycdl` brings: the client's dependencies and theirs (packages and their metadata)."""

CLIENT = """
import sys
import rpycdl

with rpycdl.connect(host="127.0.0.1", port=int(sys.argv[1])) as conn:
    print(conn.root.run_code(lambda x: x * 2, 21))
for module in ("docker", "cryptography", "pynvml", "fasteners"):
    try:
        __import__(module)
    except ImportError:
        print("no", module)
"""


def test_a_client_only_install_runs_jobs_without_the_server_and_site_packages(tmp_path, server):
    """`pip install rpycdl` is the client: it needs neither docker, cryptography, NVML nor fasteners, which
    `rpycdl[server]` and `rpycdl[site]` add; a command that needs them says which extra to install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    deps = tmp_path / "client-dependencies"  # only the client's dependencies, taken from this environment
    deps.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        name = entry.name.split("-")[0].lower()
        if name in CLIENT_DEPENDENCIES and (entry.is_dir() or entry.suffix == ".py"):
            (deps / entry.name).symlink_to(entry)
    (purelib / "client-dependencies.pth").write_text(f"{deps}\n")
    # --ignore-installed: pip would otherwise uninstall this environment's rpycdl first
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed",
                              "--prefix", str(venv), str(REPO)], capture_output=True, text=True, timeout=300)
    if install.returncode and "satisfies the requirement setuptools" in install.stderr:
        pytest.skip(f"no package index to build the install from: {install.stderr.strip().splitlines()[-1]}")
    assert install.returncode == 0, install.stderr
    requires = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(*m.requires('rpycdl'), "
                               "sep='\\n')"], capture_output=True, text=True, timeout=60).stdout.splitlines()
    plain = sorted(re.split(r"[<>=;\s]", r)[0] for r in requires if "extra ==" not in r)
    assert plain == ["blake3", "dill", "pathspec", "rpyc", "tomli", "tqdm"], requires  # tomli only before Python 3.11
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    port = str(server("pytorch", "fake:1"))
    ran = subprocess.run([str(python), "-c", CLIENT, port], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:5] == ["42", "no docker", "no cryptography", "no pynvml", "no fasteners"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "job.sh").write_text("exit 3\n")
    command = subprocess.run([str(python), "-m", "rpycdl", "run", "pytorch", "--host", "127.0.0.1", "--port", port,
                              "--working-dir", "src", "--", "sh", "job.sh"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60, env=env)
    assert command.returncode == 3, command.stderr  # rpycdl run is the client's too, with a working directory
    flags = ["--host", "127.0.0.1", "--port", port]
    submitted = subprocess.run([str(python), "-m", "rpycdl", "submit", "pytorch", "-q", *flags, "--", "sh", "-c",
                                "exit 4"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert submitted.returncode == 0, submitted.stderr  # and so are detached jobs
    waited = subprocess.run([str(python), "-m", "rpycdl", "wait", submitted.stdout.strip(), *flags], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env=env)
    assert waited.returncode == 4, waited.stderr
    serve = subprocess.run([str(python), "-m", "rpycdl", "serve", "--service", "pytorch", "--gpus", "fake:1"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert serve.returncode == 1 and "pip install 'rpycdl[server]'" in serve.stderr, serve.stderr

"""`rpycdl demo`: a registry, a PyTorch server and its monitor on loopback (the real GPUs through NVML,
else a simulated inventory), an example client run against them or the cluster kept running, and what
to try next."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rpycdl.defaults import ENV_REGISTRY
from rpycdl.errors import NoInventoryError, RpycdlError
from rpycdl.site.local import LocalCluster

CLIENTS = Path(__file__).resolve().parent.parent.parent / "clients"
"""The example clients of a checkout."""
EXAMPLE = CLIENTS / "three_jobs.py"
"""What the demo runs by default: three one-GPU jobs at once, so that the third waits its turn."""
FIRST_JOB = CLIENTS / "first_job.py"
"""A function of the user's own, torch-free: the first next step."""


def run(gpus: str | None, client: str | None, keep: bool) -> int:
    """Start the demo's registry, server and monitor; run `client` (default: EXAMPLE, none with `keep`)
    against them with its output shown; with `keep`, then wait for Ctrl-C. Returns the client's exit code
    (0 without one)."""
    gpus = gpus or _inventory()
    client = client or (None if keep else str(EXAMPLE))
    if client is not None and not Path(client).is_file():
        raise RpycdlError(f"no client script at {client}: run the demo from a checkout, or pass --client")
    code = 0
    with tempfile.TemporaryDirectory(prefix="rpycdl-demo-") as locks, LocalCluster(locks) as cluster:
        try:
            print(f"rpycdl demo: registry on udp {cluster.registry_address}")
            _, port = cluster.add_server("pytorch", gpus)
            print(f"rpycdl demo: server PYTORCH on 127.0.0.1:{port} with {gpus} (lock directory {locks})")
            print(f"rpycdl demo: monitor on {cluster.add_monitor(gpus)[1]} (/metrics, /healthz)", flush=True)
            if client is not None:
                print(f"rpycdl demo: running {client}\n", flush=True)
                env = {**os.environ, ENV_REGISTRY: cluster.registry_address}
                # In a session of its own, so that Ctrl-C reaches the demo, which stops it without its traceback.
                code = subprocess.call([sys.executable, client], env=env, start_new_session=True)
                print(f"\nrpycdl demo: client exited with {code}", flush=True)
            if keep:
                print(kept_text(cluster.registry_address), flush=True)
                while True:  # until Ctrl-C, SIGTERM or SIGHUP (rpycdl.cli: KeyboardInterrupt). Not one wait for
                    time.sleep(0.5)  # ever: a signal the kernel hands to another thread interrupts none of it
        finally:  # the cluster and its directory go whatever ended the demo; then an interrupt goes on (exit 130)
            print("rpycdl demo: stopping the server and the registry", flush=True)
    if not keep:
        print(next_steps())
    return code


def _inventory() -> str:
    """NVML's real GPUs if there are any, else a simulated fake:2 (saying which)."""
    from rpycdl.gpu.inventory import load_inventory

    try:
        found = len(load_inventory("nvml").gpus())
    except NoInventoryError as exc:
        print(f"rpycdl demo: no real GPU here ({str(exc).split(' (')[0]}); using a SIMULATED inventory, fake:2")
        return "fake:2"
    print(f"rpycdl demo: NVML found {found} real GPU(s)")
    return "nvml"


def kept_text(registry_address: str) -> str:
    """What a kept demo prints: how another terminal, script or notebook reaches its server."""
    commands = [*_activate(), f"export {ENV_REGISTRY}={registry_address}", f"python {_shown(FIRST_JOB)}"]
    return "\n".join(["\nrpycdl demo: running until Ctrl-C. From another terminal:",
                      *(f"  {command}" for command in commands),
                      f"or in a notebook or a script of yours: rpycdl.connect(\"pytorch\", "
                      f"registry_address={registry_address!r})\n"])


def next_steps() -> str:
    """What to try after the demo, as commands to copy (a test runs them as they are printed)."""
    steps = [(command, "puts the rpycdl command on your PATH") for command in _activate()]
    steps += [(f"rpycdl demo --client {_shown(FIRST_JOB)}", "a function of your own, no PyTorch needed: copy the "
               "file and make it yours"),
              ("rpycdl demo --keep", "a server kept running for your own scripts and notebooks, until Ctrl-C")]
    width = max(len(command) for command, _ in steps)
    return "\n".join(["\nNext steps:", *(f"  {command:<{width}}  # {why}" for command, why in steps),
                      "Read on: docs/getting-started.md and the user guide beside it (or the site: mkdocs serve); "
                      "operators: docs/servers.md"])


def _activate() -> list[str]:
    """The command that puts this rpycdl on a shell's PATH, when it runs in a virtual environment."""
    activate = Path(sys.prefix, "bin", "activate")
    return [f"source {_shown(activate)}"] if sys.prefix != sys.base_prefix and activate.is_file() else []


def _shown(path: Path) -> str:
    """`path` as short as it is exact from here: relative below the current directory, else absolute."""
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))

"""Your first job: a function of your own, run on a GPU of a server (no PyTorch needed). Copy this
file, change `hello`, and run your copy the same way.

Against the demo's server, in one command (it starts a registry and a server, runs this, stops them):

    rpycdl demo --client clients/first_job.py

Against any server the registry knows (`rpycdl demo --keep` keeps one running and prints the line):

    RPYCDL_REGISTRY=127.0.0.1:PORT python clients/first_job.py
"""

from __future__ import annotations

import rpycdl


def hello(name: str) -> dict:
    """The job: runs on the server, with only its GPU visible; what it prints comes back live."""
    import os
    import socket

    gpus = os.environ["CUDA_VISIBLE_DEVICES"]
    print(f"hello {name}, from {socket.gethostname()}, on GPU {gpus}")
    return {"gpus": gpus, "job": os.environ["RPYCDL_JOB_ID"]}


def main() -> None:
    with rpycdl.connect("pytorch") as conn:  # the server of that service with the most free GPUs
        print("attached, the value comes back:", conn.root.run_code(hello, "attached", ngpus=1))
        job = conn.root.submit(hello, "detached", ngpus=1)  # runs on even if this script stops
        print(f"detached, job {job.id}: {job.wait()}; it printed:", "".join(job.logs()).strip())
        print("and returned:", job.result())


if __name__ == "__main__":
    main()

"""Three jobs asking for one GPU each, sent at once: on a two-GPU server the third waits its turn.

Run it against any PyTorch server the registry knows (`rpycdl demo` starts one for you):

    RPYCDL_REGISTRY=127.0.0.1 python clients/three_jobs.py
"""

from __future__ import annotations

import threading
import time

import rpycdl


def train(seconds: float) -> dict:
    """The job: runs on the server, sees only its GPU, prints as it goes."""
    import os
    import socket
    import subprocess

    gpus = os.environ["CUDA_VISIBLE_DEVICES"]
    print(f"started on {socket.gethostname()} with CUDA_VISIBLE_DEVICES={gpus}")
    for step in range(3):
        time.sleep(seconds / 3)
        print(f"step {step + 1}/3 done")
    subprocess.run(["echo", "a child process prints too"], check=True)
    return {"gpus": gpus, "job": os.environ["RPYCDL_JOB_ID"]}


def submit(name: str, results: dict) -> None:
    def on_state(state: str, info: dict) -> None:
        if state == "pending":  # behind the jobs holding the GPUs, and the requests before it in line
            running = {holder["job_id"] for holder in info.get("holders", [])}
            print(f"[{name}] waiting for a free GPU, behind {len(running)} running job(s) and {info['ahead']} "
                  "queued request(s)")
        elif state == "running":
            print(f"[{name}] running on GPU {info['gpus']}")

    class Prefixed:
        def write(self, text: str) -> None:
            for line in text.splitlines():
                print(f"[{name}] {line}")

        def flush(self) -> None:
            pass

    with rpycdl.connect("pytorch") as conn:
        results[name] = conn.root.run_code(train, 1.5, ngpus=1, stdout=Prefixed(), on_state=on_state)


def main() -> None:
    results: dict = {}
    threads = [threading.Thread(target=submit, args=(f"job{i}", results)) for i in (1, 2, 3)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # a fixed arrival order makes the output easy to follow
    for thread in threads:
        thread.join()
    for name in sorted(results):
        print(f"{name} returned {results[name]}")
    if len(results) != 3:
        raise SystemExit("not every job returned")


if __name__ == "__main__":
    main()

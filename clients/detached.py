"""A detached training: submit it, walk away (the connection closes), come back by its name from a
new connection, follow its log live and fetch its result.

Run it against any PyTorch server the registry knows (`rpycdl demo --client clients/detached.py`
starts one for you, on simulated GPUs when there is no real one):

    RPYCDL_REGISTRY=127.0.0.1 python clients/detached.py

The same from a shell: rpycdl submit pytorch --name NAME -- python train.py, then rpycdl logs -f
NAME, rpycdl result NAME, rpycdl jobs.
"""

from __future__ import annotations

import os
import time

import rpycdl


def train(config: dict) -> dict:
    """The job: prints its progress and returns its final loss."""
    import os
    import time

    loss = 1.0
    for epoch in range(1, config["epochs"] + 1):
        time.sleep(0.3)
        loss *= 1 - config["lr"]
        print(f"epoch {epoch}/{config['epochs']}: loss {loss:.4f} on GPU {os.environ['CUDA_VISIBLE_DEVICES']}",
              flush=True)
    return {"loss": loss, "job": os.environ["RPYCDL_JOB_ID"]}


def main() -> None:
    name = f"lr-0.3-{os.getpid()}"  # unique among your unfinished jobs
    with rpycdl.connect("pytorch") as conn:
        job = conn.root.submit(train, {"lr": 0.3, "epochs": 5}, ngpus=1, name=name)
        print(f"submitted job {job.id} ({job.name}): {job.status()}")
    print("the connection is closed; the job runs on without it")
    time.sleep(0.5)

    job = rpycdl.job(name)  # from any process, later: by id, or by one of your names
    print(f"found it again: {job.status()}; its log from the first line:")
    for line in job.logs(follow=True):
        print(f"  | {line}", end="")
    print(f"{job.wait()}; it returned {job.result()}")


if __name__ == "__main__":
    main()

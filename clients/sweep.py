"""A hyperparameter sweep on shares of one GPU: four trainings with different memory needs,
started at once, run side by side on the same GPU, each held to its own grant.

Run it against any PyTorch server the registry knows (`rpycdl demo --client clients/sweep.py`
starts one for you, on simulated GPUs when there is no real one):

    RPYCDL_REGISTRY=127.0.0.1 python clients/sweep.py
"""

from __future__ import annotations

import threading

import rpycdl

GiB = 1024**3
SWEEP = [  # learning rate, and the GPU memory the training needs
    {"lr": 0.1, "memory": "3GiB"},
    {"lr": 0.03, "memory": "2GiB"},
    {"lr": 0.01, "memory": "4GiB"},
    {"lr": 0.003, "memory": "2GiB"},
]


def train(config: dict) -> dict:
    """The job: takes most of its grant, on a real GPU with PyTorch or on a simulated one."""
    import os
    import time

    granted = int(os.environ["RPYCDL_GPU_MEMORY"])
    if os.environ.get("RPYCDL_SIMULATED_GPUS"):
        from rpycdl import simulate_memory

        simulate_memory(granted * 3 // 4)
        weights = None
    else:
        import torch

        weights = torch.empty(granted * 3 // 4, dtype=torch.uint8, device="cuda")
    loss = 1.0
    for epoch in range(3):
        time.sleep(0.5)
        loss *= 1 - config["lr"]
        print(f"lr={config['lr']}: epoch {epoch + 1}, loss {loss:.4f}")
    del weights
    return {"lr": config["lr"], "loss": loss, "gpu": os.environ["RPYCDL_GPU_UUIDS"], "granted_gib": granted / GiB}


def main() -> None:
    results: list[dict] = []

    def run(config: dict) -> None:
        with rpycdl.connect("pytorch") as conn:
            results.append(conn.root.run_code(train, config, gpu_memory=config["memory"]))

    threads = [threading.Thread(target=run, args=(config,)) for config in SWEEP]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in sorted(results, key=lambda r: r["loss"]):
        print(f"lr={result['lr']:<6} loss {result['loss']:.4f}  on {result['gpu']} with {result['granted_gib']:g} GiB")
    if len(results) != len(SWEEP):
        raise SystemExit(f"only {len(results)} of {len(SWEEP)} trainings finished")
    if len({result["gpu"] for result in results}) == 1:
        print(f"all {len(results)} trainings shared one GPU")


if __name__ == "__main__":
    main()

"""The host's monitor: Prometheus metrics of its GPUs, grants, queue and jobs, served over HTTP."""

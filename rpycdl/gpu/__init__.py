"""GPUs: the inventory (NVML, or simulated), the memory caps a job on a share runs under (caps),
and the watchdog that holds it to its grant from outside (watchdog)."""

"""The hardware: the catalog of GPUs and models, NVML, and the memory model of what a config holds (its
factors fitted to launches, the runtime headroom crashes showed)."""

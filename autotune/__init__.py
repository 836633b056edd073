"""autotune: find the best `vllm serve` flags for a model, a GPU and a traffic pattern."""

__version__ = "0.1.0"

"""The names of the output formats and pick policies the CLI offers (data only: light to import)."""

from __future__ import annotations

import enum


class Format(enum.StrEnum):
    """``autotune export`` formats."""

    VLLM_YAML = "vllm-yaml"
    """A file for ``vllm serve --config`` (dashed keys)."""
    ARGS = "args"
    """A ready ``vllm serve`` command line."""
    JSON = "json"
    """Flags, command line, measurements, workload and SLOs."""
    HELM = "helm"
    """Values for the vLLM production stack's Helm chart (``vllm-stack``)."""


class Policy(enum.StrEnum):
    """How to pick one config from the Pareto front."""

    MAX_THROUGHPUT = "max-throughput"
    MIN_LATENCY = "min-latency"


class BestFormat(enum.StrEnum):
    """``autotune best`` formats."""

    TABLE = "table"
    JSON = "json"
    CSV = "csv"

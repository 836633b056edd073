"""Load generation: workloads and arrivals, the streaming client, metrics, SLOs, /metrics, rate search.

Import from the submodules (``autotune.load.client`` ...): this package imports nothing eagerly, because
``autotune.spec`` imports ``autotune.load.slo`` and the other submodules import ``autotune.spec``.
"""

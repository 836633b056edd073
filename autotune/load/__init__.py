"""Load generation: workloads and arrivals, the streaming client, metrics, SLO verdicts, /metrics, probes
and the SLO-constrained rate search. Import from the submodules (``autotune.load.client`` ...)."""

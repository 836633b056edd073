"""The calibrated surrogate: a closed-form model of a config's SLO rate (``fluid``), calibrated to the
study's measured probes (``model``), that proposes the next launch and hands over to the sampler when it
predicts badly (``propose``), and its account for ``simulate --calibrated`` (``report``).
See docs/surrogate.md."""

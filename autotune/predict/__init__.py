"""Prediction before a launch: feasibility (the memory model, the crash boundary), the flags vLLM would
refuse, the dry run on the simulator, the KV table, and the surrogate that proposes the next config."""

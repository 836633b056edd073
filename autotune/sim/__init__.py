"""The simulated vLLM server: a GPU-free twin of ``vllm serve`` for demos, dry runs and tests.

``python -m autotune.sim MODEL [vllm serve flags] [--sim-* options]`` runs it as a process over HTTP
(:mod:`autotune.sim.cli`, :mod:`autotune.sim.server`); :func:`simulate` runs the same startup checks,
scheduler and cost model in process, in virtual time (:mod:`autotune.sim.model`).

Assumptions (what is modelled, and how):

* Memory (:mod:`autotune.memory`): KV = utilization x device memory - weights - activation peak -
  CUDA graphs - non-torch memory, per GPU of a TP group; KV bytes per token = 2 x layers x KV heads x
  head_dim x element bytes (fp8: 1). Close to the device edge, CUDA-graph capture and allocator slack
  push total use over the device with seeded randomness (``torch.OutOfMemoryError``).
* Scheduling (:mod:`autotune.sim.engine`): vLLM v1 continuous batching, token budget
  ``max_num_batched_tokens`` per step, ``max_num_seqs`` running, paged KV blocks of ``block_size``,
  recompute preemption of the newest request, chunked prefill on/off. No prefix caching, no
  speculative decoding, no swapping, no priorities, FCFS only.
* Step time: roofline ``max(FLOPs / (peak x 0.65), bytes / (bandwidth x efficiency)) + overhead``;
  decode reads all weights plus every scheduled sequence's KV; prefill is compute-bound; block size sets
  the paged-attention bandwidth efficiency; fp8 KV halves KV bytes with a 15 % dequant cost; TP adds
  all-reduce time. Tokens of a step are delivered when the step ends; the wall clock runs at
  simulated time / ``--sim-speedup``.
* Tokens: a prompt string has one token per whitespace-separated word; a list of ints is taken as token
  ids; a chat request counts each message's words + 4, plus 3. Without ``ignore_eos`` the output length
  is drawn uniformly from [max(1, min_tokens), max_tokens] (seeded). Token texts are common words.
* Startup: validation and failure texts are vLLM 0.34's (capacity facts on one line); start delay is
  2 s + weight GiB / 8 + 0.03 s per CUDA graph (+3 s for TP > 1), divided by ``--sim-speedup``.
"""

from autotune.sim.model import SimResult, WorkloadRequest, simulate, synthetic_workload

__all__ = ["SimResult", "WorkloadRequest", "simulate", "synthetic_workload"]

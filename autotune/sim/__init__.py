"""The simulated vLLM server: a GPU-free twin of ``vllm serve`` (vLLM 0.34.0) for demos, dry runs and tests.

``python -m autotune.sim MODEL [vllm serve flags] [--sim-* options]`` runs it as a process over HTTP
(:mod:`autotune.sim.cli`, :mod:`autotune.sim.server`); :func:`simulate` runs the same startup checks,
scheduler and cost model in process, in virtual time (:mod:`autotune.sim.model`).

Assumptions (what is modelled, and how):

* Command line (:mod:`autotune.sim.flags`): every option of vLLM 0.34's ``vllm serve`` is accepted with
  vLLM's spellings (``--x``/``--no-x``/``--disable-x``, ``-tp``, ``-dp``, ``-O3``, ``--json-flag.key v``,
  ``--config FILE.yaml``); an unknown one is vLLM's ``vllm: error: unrecognized arguments: ...``, exit 2.
  vLLM 0.34 has no ``--max-num-partial-prefills`` / ``--max-long-partial-prefills`` (removed with the V0
  engine): they are unrecognized arguments too. Flags without a modelled effect are accepted and logged
  as "not simulated" (e.g. ``--seed``, ``--pipeline-parallel-size``, ``--performance-mode``,
  ``--max-num-active-seqs``, ``--scheduling-policy``, ``--disable-log-stats``). ``--max-model-len auto``
  (or -1) reduces max_model_len to what the KV cache holds, with vLLM's log line.
* Defaults: the simulator keeps the pre-0.34 defaults of its scheduler and cache flags (block size 16,
  ``--gpu-memory-utilization`` 0.9, ``--max-num-seqs`` 256, ``--max-num-batched-tokens`` 2048 with
  chunked prefill, else max(max_model_len, 2048)); vLLM 0.34 defaults to block size 64 (then the
  attention backend's choice), utilization 1.0 with the extensible KV cache (on CUDA; else 0.92) and
  hardware tiers for the batch (docs/vllm.md).
  Prefix caching and async scheduling are on and ``-O2`` applies unless set, as in vLLM 0.34.
  The start-up log reports every value used (:mod:`autotune.sim.report`).
* Memory (:mod:`autotune.hardware.memory`): KV = utilization x device memory - weights - activation peak -
  CUDA graphs - non-torch memory, per GPU of a TP group; KV bytes per token = 2 x layers x KV heads/TP x
  head_dim x element bytes (fp8: 1). CUDA-graph memory grows with the number of captured sizes (none in
  eager mode). A speculative draft model adds its weights and KV per GPU; an EAGLE/MTP head adds one
  decoder layer. Close to the device edge, CUDA-graph capture and allocator slack push total use over
  the device with seeded randomness (``torch.OutOfMemoryError``).
* Scheduling (:mod:`autotune.sim.engine`): vLLM v1 continuous batching, token budget
  ``max_num_batched_tokens`` per step, ``max_num_seqs`` running, paged KV blocks of ``block_size``,
  recompute preemption of the newest request, chunked prefill on/off, ``--long-prefill-token-threshold``
  (per-step cap of a prompt's chunk when more than one request is running or waiting; ``-adaptive``
  floors it at the budget's fair share). No swapping, no priorities, FCFS only; a request is admitted
  when its first chunk's blocks fit (not its whole prompt).
* Prefix caching (:mod:`autotune.sim.prefix_cache`): full blocks are hashed with chained hashes of their
  token ids; a request admitted with nothing computed reuses the longest run of cached blocks (at most
  ``tokens - 1``), so only the rest is prefilled: hits come in whole blocks, and a bigger block size
  makes them coarser. Freed blocks keep their contents until reallocated (LRU over free blocks, a
  request's tail blocks first). The HTTP server derives token ids from the prompt it receives, so
  requests that share a text prefix (or token ids, or chat messages) share blocks; output tokens have
  fixed ids, so a multi-turn conversation that sends a reply back hits on it. ``simulate()`` needs
  ``WorkloadRequest.prompt_token_ids`` or ``prefix_group``/``prefix_len``.
  ``vllm:prefix_cache_queries_total`` counts the prompt tokens of requests looked up (first admission
  only, as vLLM), ``vllm:prefix_cache_hits_total`` the tokens found cached.
* Tensor parallelism: weights and KV heads split across the GPUs of the group, compute summed over
  them, two all-reduces per layer (12 us + activation bytes over the profile's interconnect). TP must
  divide the attention heads (vLLM's text). ``--sim-gpus N`` GPUs on the node (default TP x DP):
  TP above it is vLLM's "World size (..) is larger than the number of available GPUs" error; TP x DP
  above it fails the data-parallel rank without a GPU (torch's "invalid device ordinal").
* Data parallelism (:mod:`autotune.sim.router`): one engine per DP rank with its own scheduler, KV cache
  and step clock; each request goes to the engine vLLM 0.34's load balancer picks (least waiting +
  running, a penalty for a queue on a KV-bound engine, rotating ties: round-robin when idle).
* Speculative decoding (:mod:`autotune.sim.speculative`): ``--speculative-config`` is validated with
  vLLM 0.34's texts. Each decode step verifies ``k = num_speculative_tokens`` drafts (they take ``k``
  extra tokens of budget and KV slots, and the verification computes 1 + k tokens); drafts are accepted
  left to right, each with probability ``--sim-acceptance-rate`` P (default 0.7: a property of the
  traffic, not of the flags), so a step emits 1 + accepted tokens, ``(1 - P^(k+1)) / (1 - P)`` on
  average. Drafting costs nothing for ``ngram``/``suffix`` (CPU) and ``k`` forward passes of the drafter
  (a draft model's own roofline; an EAGLE/MTP head as one decoder layer plus the LM head) otherwise.
  At low load verification is nearly free (memory-bound) and TPOT falls; at saturation it costs compute
  and a low acceptance rate loses throughput. Exported as ``vllm:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_accepted_tokens_per_pos_total{position}``.
* Step time (:mod:`autotune.sim.cost`): roofline ``max(FLOPs / (peak x 0.65), bytes / (bandwidth x
  efficiency)) + overhead``; decode reads all weights plus every scheduled sequence's KV; prefill is
  compute-bound; block size sets the paged-attention bandwidth efficiency; fp8 KV halves KV bytes with a
  15 % dequant cost. The overhead (1.5 ms + 15 us per sequence) is what async scheduling leaves;
  ``--no-async-scheduling`` adds the scheduler's 1 ms + 10 us per sequence in series. A pure decode
  step whose batch no CUDA graph covers (``--enforce-eager``, ``-O0``, ``cudagraph_mode: NONE``, or
  more tokens than the largest captured size) pays 30 us per layer of kernel launches; ``-O1``
  (piecewise graphs) 8 us per layer. Compilation itself has no modelled effect on step time. Tokens
  of a step are delivered when the step ends; the wall clock runs at simulated time / ``--sim-speedup``.
  ``--sim-events-per-write K`` holds each stream's chunks until K are ready and writes them in one
  network write, as vLLM's API server does under load.
* Tokens (:mod:`autotune.sim.tokens`): a prompt string has one token per whitespace-separated word; a
  list of ints is taken as token ids; a chat request counts each message's words + 4, plus 3. Without
  ``ignore_eos`` the output length is drawn uniformly from [max(1, min_tokens), max_tokens] (seeded).
  Token texts are common words.
* HTTP: ``--api-key`` / ``VLLM_API_KEY`` protect ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` paths
  (401 ``{"error":"Unauthorized"}``), as vLLM's middleware; an incoming ``X-Request-Id`` becomes the
  response id, and ``--enable-request-id-headers`` echoes it (or a uuid4) in a response header.
* Startup (:mod:`autotune.sim.startup`): validation and failure texts are vLLM 0.34's (capacity facts on
  one line; one capacity line per DP engine); the log carries vLLM's ``non-default args`` and
  engine-config lines with the resolved values, plus the simulator's own ``autotune.sim effective
  config`` line, and the ``VLLM_*`` environment variables it was given (``autotune.sim environment
  (not simulated): {...}``: none is modelled); start delay is 2 s + weight GiB / 8 + 0.03 s per
  captured CUDA graph (+3 s for TP > 1), divided by ``--sim-speedup``.
"""

from autotune.sim.model import SimResult, WorkloadRequest, simulate, synthetic_workload

__all__ = ["SimResult", "WorkloadRequest", "simulate", "synthetic_workload"]

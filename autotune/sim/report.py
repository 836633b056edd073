"""The effective configuration as vLLM 0.34 reports it: start-up log lines and ``vllm:cache_config_info``.

* ``non-default args: {...}`` (vLLM's ``log_non_default_args``): the command line's vLLM arguments that
  differ from the parser's defaults, as a Python dict in the parser's order (``model_tag`` and ``model``
  first among them; ``api_key`` shown as ``'***'``).
* ``Initializing a V1 LLM engine (v0.34.0) with config: model='...', speculative_config=..., ...``
  (``VllmConfig.__str__``): the resolved ``dtype``, ``max_seq_len``, ``tensor_parallel_size``,
  ``data_parallel_size``, ``enforce_eager``, ``kv_cache_dtype``, ``enable_prefix_caching``,
  ``enable_chunked_prefill`` and ``compilation_config`` (its ``mode``, ``cudagraph_mode``,
  ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``), in vLLM's field order.
* vLLM logs no line with the resolved block size, max_num_seqs or memory utilization (the cache ones are
  in ``vllm:cache_config_info``), so the simulator adds its own line, which real vLLM does not print:
  ``autotune.sim effective config: {'block_size': 16, 'max_num_seqs': 256, ...}``.
* ``vllm:cache_config_info``: one series per engine whose labels are every field of vLLM 0.34's
  ``CacheConfig`` (``str()`` of the value) plus ``engine``, sorted by name as a scrape shows them. As in
  vLLM's front end, ``num_gpu_blocks`` is summed over the data-parallel engines while
  ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency`` are one engine's. Unlike vLLM 0.34, which
  shows ``gpu_memory_utilization="None"`` when the flag is unset, the label carries the value used.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from autotune.hardware.memory import MemoryPlan
from autotune.sim.flags import ServeFlags
from autotune.sim.resolve import ResolvedConfig
from autotune.sim.vllm_options import DEST_ORDER

VLLM_VERSION = "0.34.0"


class _Raw(str):
    """A string that is shown as itself inside a dict's repr (for enum reprs)."""

    def __repr__(self) -> str:
        return str(self)


_COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")
_CUDAGRAPH_VALUES = {"NONE": "0", "PIECEWISE": "1", "FULL": "2", "FULL_DECODE_ONLY": "(2, 0)",
                     "FULL_AND_PIECEWISE": "(2, 1)"}  # fmt: skip
_SIM_ONLY = frozenset({"hardware", "gpus", "acceptance_rate", "speedup", "start_delay", "seed",
                       "hang_at_start", "die_after_requests", "ignore_sigterm", "orphan_child",
                       "slow_start", "ignored", "cli_args"})  # fmt: skip


def _redact(args: dict[str, Any]) -> dict[str, Any]:
    return {k: ("***" if k in ("api_key", "hf_token", "watermark_config") else v) for k, v in args.items()}


def non_default_args(flags: ServeFlags) -> dict[str, Any]:
    """vLLM's ``non-default args`` dict: the parsed command line's, else the fields that differ from
    the simulator's defaults (flags built in code)."""
    if flags.cli_args:
        return _redact(dict(flags.cli_args))
    defaults = ServeFlags(model=flags.model)
    out: dict[str, Any] = {"model_tag": flags.model, "model": flags.model}
    for f in fields(ServeFlags):
        if f.name in _SIM_ONLY or f.name not in DEST_ORDER:
            continue
        value = getattr(flags, f.name)
        if value != getattr(defaults, f.name):
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return _redact(dict(sorted(out.items(), key=lambda item: DEST_ORDER[item[0]])))


def compilation_config(cfg: ResolvedConfig) -> dict[str, Any]:
    """The ``compilation_config`` dict of vLLM's engine-config line, with the resolved values."""
    eager = cfg.compilation_mode == 0
    sizes = list(cfg.cudagraph_capture_sizes)
    graph = cfg.cudagraph_mode
    return {
        "mode": _Raw(f"<CompilationMode.{_COMPILATION_MODES[cfg.compilation_mode]}: {cfg.compilation_mode}>"),
        "debug_dump_path": None, "cache_dir": "", "compile_cache_save_format": "binary",
        "backend": "inductor", "custom_ops": ["all"] if eager else ["none"],
        "ir_enable_torch_wrap": not eager,
        "splitting_ops": [] if eager else ["vllm::unified_attention_with_output"],
        "compile_mm_encoder": False, "cudagraph_mm_encoder": False, "encoder_cudagraph_token_budgets": [],
        "encoder_cudagraph_max_token_budget": 5120, "encoder_cudagraph_max_vision_items_per_batch": 0,
        "encoder_cudagraph_max_frames_per_batch": None, "cudagraph_decoder_replay": True,
        "decoder_replay_cudagraph_capture_sizes": [], "decoder_replay_trim_threshold": 768,
        "compile_sizes": [], "compile_ranges_endpoints": [cfg.max_num_batched_tokens],
        "inductor_compile_config": {"enable_auto_functionalized_v2": False}, "inductor_passes": {},
        "cudagraph_mode": _Raw(f"<CUDAGraphMode.{graph}: {_CUDAGRAPH_VALUES[graph]}>"),
        "use_breakable_cudagraph": False, "cudagraph_num_of_warmups": 0 if eager else 1,
        "cudagraph_capture_sizes": sizes, "cudagraph_copy_inputs": False,
        "cudagraph_specialize_lora": True, "use_inductor_graph_partition": False, "pass_config": {},
        "max_cudagraph_capture_size": cfg.max_cudagraph_capture_size,
        "dynamic_shapes_config": {"type": _Raw("<DynamicShapesType.BACKED: 'backed'>"),
                                  "evaluate_guards": False, "assume_32_bit_indexing": False},
        "local_cache_dir": None, "fast_moe_cold_start": False, "static_all_moe_layers": [],
    }  # fmt: skip


def engine_config_line(flags: ServeFlags, cfg: ResolvedConfig) -> str:
    """vLLM's ``Initializing a V1 LLM engine (v...) with config: ...`` line, resolved values."""
    eager = cfg.enforce_eager
    return (
        f"Initializing a V1 LLM engine (v{VLLM_VERSION}) with config: model={flags.model!r}, "
        f"speculative_config={cfg.speculative!r}, tokenizer={flags.model!r}, skip_tokenizer_init=False, "
        "tokenizer_mode=auto, revision=None, tokenizer_revision=None, trust_remote_code=False, "
        f"dtype=torch.{cfg.dtype}, max_seq_len={cfg.max_model_len}, download_dir=None, load_format=auto, "
        f"tensor_parallel_size={cfg.tensor_parallel_size}, pipeline_parallel_size=1, "
        f"data_parallel_size={cfg.data_parallel_size}, decode_context_parallel_size=1, "
        "dcp_comm_backend=ag_rs, disable_custom_all_reduce=False, quantization=None, "
        f"quantization_config=None, enforce_eager={eager}, "
        "aux_output_config=AuxOutputConfig(enable_return_routed_experts=False, max_bytes=None), "
        f"kv_cache_dtype={cfg.kv_cache_dtype}, device_config=cuda, "
        "structured_outputs_config=StructuredOutputsConfig(backend='auto', disable_any_whitespace=False, "
        "disable_additional_properties=False, reasoning_parser='', reasoning_parser_plugin='', "
        "enable_in_reasoning=False), observability_config=ObservabilityConfig("
        "show_hidden_metrics_for_version=None, otlp_traces_endpoint=None, collect_detailed_traces=None, "
        "per_request_spec_decode_metrics='none', kv_cache_metrics=False, kv_cache_metrics_sample=0.01, "
        "custom_histogram_buckets=None, cudagraph_metrics=False, enable_layerwise_nvtx_tracing=False, "
        "enable_mfu_metrics=False, enable_mm_processor_stats=False, enable_logging_iteration_details=False, "
        "jit_monitor_mode='warn', jit_monitor_verbose=False), seed=0, "
        f"served_model_name={flags.name}, enable_prefix_caching={cfg.enable_prefix_caching}, "
        f"enable_chunked_prefill={cfg.enable_chunked_prefill}, pooler_config=None, "
        f"compilation_config={compilation_config(cfg)!r}, "
        "kernel_config=KernelConfig(ir_op_priority=IrOpPriorityConfig(rms_norm=['native'], "
        "fused_add_rms_norm=['native'], gelu_and_mul_sparse=['native']), enable_flashinfer_autotune=True, "
        "enable_rocm_segmented_attn_autotune=False, enable_rocm_aiter_gemm_warmup=False, "
        f"enable_cutedsl_warmup=True, enable_jit_warmup={not eager}, monokernel=False, moe_backend='auto', "
        "sparse_indexer_topk_backend='auto', linear_backend='auto', linear_backend_per_quant=None, "
        "rdna_hybrid_w4a16_prefill_dequant='disable')"
    )


def effective_config(cfg: ResolvedConfig) -> dict[str, Any]:
    """The simulator's own summary of the values it runs with (not a vLLM line)."""
    spec = cfg.speculative
    return {
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "data_parallel_size": cfg.data_parallel_size,
        "gpus": cfg.gpus,
        "async_scheduling": cfg.async_scheduling,
        "enforce_eager": cfg.enforce_eager,
        "optimization_level": cfg.optimization_level,
        "cudagraph_mode": cfg.cudagraph_mode,
        "max_cudagraph_capture_size": cfg.max_cudagraph_capture_size,
        "num_cudagraph_capture_sizes": len(cfg.cudagraph_capture_sizes),
        "speculative_method": spec.method if spec else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec else 0,
        "acceptance_rate": cfg.acceptance_rate if spec else None,
    }


def cache_config_labels(cfg: ResolvedConfig, memory: MemoryPlan, engine: int) -> str:
    """The labels of ``vllm:cache_config_info`` for one engine (vLLM 0.34's CacheConfig fields)."""
    values: dict[str, object] = {
        "block_size": cfg.block_size,
        "user_specified_block_size": cfg.user_specified_block_size,
        "kv_cache_layout": None,
        "prefix_match_unit": None,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "cache_dtype": cfg.kv_cache_dtype,
        "is_attention_free": False,
        "num_gpu_blocks_override": None,
        "sliding_window": None,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": 0,
        "kv_cache_dtype_skip_layers": [],
        "mamba_page_size_padded": None,
        "skip_page_size_padded": None,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "float32",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": False,
        "replayssm_buffer_len": 16,
        "use_replayssm": False,
        "use_kda_recoverssm": False,
        "num_gpu_blocks": memory.num_blocks * cfg.data_parallel_size,  # the front end sums DP engines
        "num_cpu_blocks": None,
        "simple_cpu_offload_num_blocks": None,
        "effective_attention_block_size": cfg.block_size,
        "kv_cache_size_tokens": memory.kv_tokens,
        "kv_cache_max_concurrency": memory.max_concurrency,
        "hash_block_size": None,
        "cache_hit_alignment_tokens": None,
        "kv_sharing_fast_prefill": False,
        "swa_bounded_replay": True,
        "kv_cache_memory_bytes": None,
        "enable_extensible_kv_cache": False,
        "kv_offloading_size": None,
        "kv_offloading_backend": "native",
        "_block_size_resolved": True,
        "_extensible_kv_cache_resolved": True,
        "engine": engine,
    }
    return ",".join(f'{name}="{values[name]}"' for name in sorted(values))

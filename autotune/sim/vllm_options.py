"""Every option of vLLM 0.34's ``vllm serve`` command line: names, spellings and arity (data only).

Taken from vLLM 0.34.0's own parser (``make_arg_parser`` in ``vllm/entrypoints/common/cli_args.py``,
its ``FlexibleArgumentParser`` with ``EnableDisableAction``), in the parser's order: that order is the
order of vLLM's ``non-default args: {...}`` log line. The simulated server registers the options it
models with their types (:mod:`autotune.sim.flags`) and accepts every other one here with no modelled
effect; anything else is vLLM's "unrecognized arguments" error.

Table format, one option per line (indented lines continue the previous one): ``dest arity spellings``.
Arity is ``0`` (a switch), ``1`` (one value), ``+`` (one or more values) or ``?`` (an optional value). A
spelling ending in ``!`` sets the switch to False (``--no-x``, ``--disable-x``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmOption:
    """One ``vllm serve`` option: its destination name, its spellings and how many values it takes."""

    dest: str
    spellings: tuple[str, ...]
    arity: str
    """``0`` (a switch), ``1``, ``+`` or ``?``."""
    negative: tuple[str, ...] = ()
    """The spellings that set a switch to False."""


_TABLE = """
headless 0 --headless
headless_client_handshake_address 1 --headless-client-handshake-address
api_server_count 1 --api-server-count -asc
config 1 --config
grpc 0 --grpc
lora_modules + --lora-modules
chat_template 1 --chat-template
chat_template_content_format 1 --chat-template-content-format
trust_request_chat_template 0 --no-trust-request-chat-template! --trust-request-chat-template
trust_request_mm_kwargs 0 --no-trust-request-mm-kwargs! --trust-request-mm-kwargs
default_chat_template_kwargs 1 --default-chat-template-kwargs
reasoning_effort_map 1 --reasoning-effort-map
response_role 1 --response-role
return_tokens_as_token_ids 0 --no-return-tokens-as-token-ids! --return-tokens-as-token-ids
enable_auto_tool_choice 0 --disable-auto-tool-choice! --enable-auto-tool-choice
    --no-enable-auto-tool-choice!
exclude_tools_when_tool_choice_none 0 --exclude-tools-when-tool-choice-none
    --no-exclude-tools-when-tool-choice-none!
tool_call_parser 1 --tool-call-parser
tool_parser_plugin 1 --tool-parser-plugin
tool_strict_level 1 --tool-strict-level
tool_server 1 --tool-server
max_log_len 1 --max-log-len
enable_prompt_tokens_details 0 --disable-prompt-tokens-details! --enable-prompt-tokens-details
    --no-enable-prompt-tokens-details!
enable_per_request_metrics 0 --disable-per-request-metrics! --enable-per-request-metrics
    --no-enable-per-request-metrics!
enable_server_load_tracking 0 --disable-server-load-tracking! --enable-server-load-tracking
    --no-enable-server-load-tracking!
enable_force_include_usage 0 --disable-force-include-usage! --enable-force-include-usage
    --no-enable-force-include-usage!
sse_keep_alive_interval 1 --sse-keep-alive-interval
enable_tokenizer_info_endpoint 0 --disable-tokenizer-info-endpoint! --enable-tokenizer-info-endpoint
    --no-enable-tokenizer-info-endpoint!
enable_log_outputs 0 --disable-log-outputs! --enable-log-outputs --no-enable-log-outputs!
enable_log_deltas 0 --disable-log-deltas! --enable-log-deltas --no-enable-log-deltas!
cohere_is_reasoning_model 0 --cohere-is-reasoning-model --no-cohere-is-reasoning-model!
cohere_format 1 --cohere-format
anthropic_disabled_thinking_effort 1 --anthropic-disabled-thinking-effort
log_error_stack 0 --log-error-stack --no-log-error-stack!
tokens_only 0 --no-tokens-only! --tokens-only
enable_scale_out 0 --disable-scale-out! --enable-scale-out --no-enable-scale-out!
fingerprint_mode 1 --fingerprint-mode
fingerprint_value 1 --fingerprint-value
host 1 --host
port 1 --port
grpc_port 1 --grpc-port
data_parallel_supervisor_port 1 --data-parallel-supervisor-port
dp_supervisor_probe_interval_s 1 --dp-supervisor-probe-interval-s
dp_supervisor_probe_timeout_s 1 --dp-supervisor-probe-timeout-s
dp_supervisor_probe_failure_threshold 1 --dp-supervisor-probe-failure-threshold
uds 1 --uds
uvicorn_log_level 1 --uvicorn-log-level
disable_uvicorn_access_log 0 --disable-uvicorn-access-log --enable-uvicorn-access-log!
    --no-disable-uvicorn-access-log!
disable_access_log_for_endpoints 1 --disable-access-log-for-endpoints
allow_credentials 0 --allow-credentials --no-allow-credentials!
allowed_origins 1 --allowed-origins
allowed_methods 1 --allowed-methods
allowed_headers 1 --allowed-headers
api_key + --api-key
ssl_keyfile 1 --ssl-keyfile
ssl_certfile 1 --ssl-certfile
ssl_ca_certs 1 --ssl-ca-certs
enable_ssl_refresh 0 --disable-ssl-refresh! --enable-ssl-refresh --no-enable-ssl-refresh!
ssl_cert_reqs 1 --ssl-cert-reqs
ssl_ciphers 1 --ssl-ciphers
root_path 1 --root-path
middleware 1 --middleware
enable_request_id_headers 0 --disable-request-id-headers! --enable-request-id-headers
    --no-enable-request-id-headers!
disable_fastapi_docs 0 --disable-fastapi-docs --enable-fastapi-docs! --no-disable-fastapi-docs!
h11_max_incomplete_event_size 1 --h11-max-incomplete-event-size
h11_max_header_count 1 --h11-max-header-count
enable_offline_docs 0 --disable-offline-docs! --enable-offline-docs --no-enable-offline-docs!
enable_flash_late_interaction 0 --disable-flash-late-interaction! --enable-flash-late-interaction
    --no-enable-flash-late-interaction!
model 1 --model
runner 1 --runner
convert 1 --convert
tokenizer 1 --tokenizer
tokenizer_mode 1 --tokenizer-mode
trust_remote_code 0 --no-trust-remote-code! --trust-remote-code
dtype 1 --dtype
seed 1 --seed
hf_config_path 1 --hf-config-path
allowed_local_media_path 1 --allowed-local-media-path
allowed_media_domains + --allowed-media-domains
revision 1 --revision
code_revision 1 --code-revision
tokenizer_revision 1 --tokenizer-revision
max_model_len 1 --max-model-len
quantization 1 --quantization -q
quantization_config 1 --quantization-config
allow_deprecated_quantization 0 --allow-deprecated-quantization --no-allow-deprecated-quantization!
enforce_eager 0 --enforce-eager --no-enforce-eager!
enable_return_routed_experts 0 --disable-return-routed-experts! --enable-return-routed-experts
    --no-enable-return-routed-experts!
return_sampling_mask 0 --no-return-sampling-mask! --return-sampling-mask
max_logprobs 1 --max-logprobs
logprobs_mode 1 --logprobs-mode
use_fp64_gumbel 0 --no-use-fp64-gumbel! --use-fp64-gumbel
enable_trace_replay 0 --disable-trace-replay! --enable-trace-replay --no-enable-trace-replay!
disable_sliding_window 0 --disable-sliding-window --enable-sliding-window! --no-disable-sliding-window!
disable_cascade_attn 0 --disable-cascade-attn --enable-cascade-attn! --no-disable-cascade-attn!
skip_tokenizer_init 0 --no-skip-tokenizer-init! --skip-tokenizer-init
enable_prompt_embeds 0 --disable-prompt-embeds! --enable-prompt-embeds --no-enable-prompt-embeds!
served_model_name + --served-model-name
config_format 1 --config-format
hf_token ? --hf-token
hf_overrides 1 --hf-overrides
model_class_overrides 1 --model-class-overrides
pooler_config 1 --pooler-config
generation_config 1 --generation-config
override_generation_config 1 --override-generation-config
enable_sleep_mode 0 --disable-sleep-mode! --enable-sleep-mode --no-enable-sleep-mode!
sleep_mode_backend 1 --sleep-mode-backend
sleep_mode_offload_cudagraph 0 --no-sleep-mode-offload-cudagraph! --sleep-mode-offload-cudagraph
sleep_preserve_parameter_names + --sleep-preserve-parameter-names
enable_cumem_allocator 0 --disable-cumem-allocator! --enable-cumem-allocator
    --no-enable-cumem-allocator!
enable_nccl_comm_suspend 0 --disable-nccl-comm-suspend! --enable-nccl-comm-suspend
    --no-enable-nccl-comm-suspend!
checkpoint_prepare_on_startup 0 --checkpoint-prepare-on-startup --no-checkpoint-prepare-on-startup!
model_impl 1 --model-impl
logits_processors + --logits-processors
io_processor_plugin 1 --io-processor-plugin
renderer_num_workers 1 --renderer-num-workers
load_format 1 --load-format
download_dir 1 --download-dir
safetensors_load_strategy 1 --safetensors-load-strategy
safetensors_prefetch_num_threads 1 --safetensors-prefetch-num-threads
safetensors_prefetch_block_size 1 --safetensors-prefetch-block-size
model_loader_extra_config 1 --model-loader-extra-config
ignore_patterns + --ignore-patterns
use_tqdm_on_load 0 --no-use-tqdm-on-load! --use-tqdm-on-load
pt_load_map_location 1 --pt-load-map-location
shuffle_safetensors_files 0 --no-shuffle-safetensors-files! --shuffle-safetensors-files
attention_backend 1 --attention-backend
mamba_backend 1 --mamba-backend
mamba_ssu_algorithm 1 --mamba-ssu-algorithm
enable_mamba_cache_stochastic_rounding 0 --disable-mamba-cache-stochastic-rounding!
    --enable-mamba-cache-stochastic-rounding --no-enable-mamba-cache-stochastic-rounding!
mamba_cache_philox_rounds 1 --mamba-cache-philox-rounds
reasoning_parser 1 --reasoning-parser
reasoning_parser_plugin 1 --reasoning-parser-plugin
distributed_executor_backend 1 --distributed-executor-backend
pipeline_parallel_size 1 --pipeline-parallel-size -pp
master_addr 1 --master-addr
master_port 1 --master-port
nnodes 1 --nnodes -n
node_rank 1 --node-rank -r
distributed_timeout_seconds 1 --distributed-timeout-seconds
cpu_distributed_timeout_seconds 1 --cpu-distributed-timeout-seconds
numa_bind 0 --no-numa-bind! --numa-bind
numa_bind_nodes + --numa-bind-nodes
numa_bind_cpus + --numa-bind-cpus
device_ids 1 --device-ids
tensor_parallel_size 1 --tensor-parallel-size -tp
decode_context_parallel_size 1 --decode-context-parallel-size -dcp
dcp_comm_backend 1 --dcp-comm-backend
dcp_q_replicate 0 --dcp-q-replicate --no-dcp-q-replicate!
dcp_kv_cache_interleave_size 1 --dcp-kv-cache-interleave-size
cp_kv_cache_interleave_size 1 --cp-kv-cache-interleave-size
prefill_context_parallel_size 1 --prefill-context-parallel-size -pcp
data_parallel_size 1 --data-parallel-size -dp
data_parallel_rank 1 --data-parallel-rank -dpn
data_parallel_start_rank 1 --data-parallel-start-rank -dpr
data_parallel_size_local 1 --data-parallel-size-local -dpl
data_parallel_address 1 --data-parallel-address -dpa
data_parallel_rpc_port 1 --data-parallel-rpc-port -dpp
data_parallel_backend 1 --data-parallel-backend -dpb
data_parallel_hybrid_lb 0 --data-parallel-hybrid-lb --no-data-parallel-hybrid-lb! -dph
data_parallel_external_lb 0 --data-parallel-external-lb --no-data-parallel-external-lb! -dpe
data_parallel_multi_port_external_lb 0 --data-parallel-multi-port-external-lb -dpm
enable_hc_sp 0 --disable-hc-sp! --enable-hc-sp --no-enable-hc-sp!
enable_expert_parallel 0 --disable-expert-parallel! --enable-expert-parallel
    --no-enable-expert-parallel! -ep
enable_batch_sharded_sampling 0 --disable-batch-sharded-sampling! --enable-batch-sharded-sampling
    --no-enable-batch-sharded-sampling!
enable_ep_weight_filter 0 --disable-ep-weight-filter! --enable-ep-weight-filter
    --no-enable-ep-weight-filter!
all2all_backend 1 --all2all-backend
enable_dbo 0 --disable-dbo! --enable-dbo --no-enable-dbo!
enable_shm_tensor_arena 0 --disable-shm-tensor-arena! --enable-shm-tensor-arena
    --no-enable-shm-tensor-arena!
ubatch_size 1 --ubatch-size
enable_elastic_ep 0 --disable-elastic-ep! --enable-elastic-ep --no-enable-elastic-ep!
elastic_ep_max_dp_size 1 --elastic-ep-max-dp-size
dbo_decode_token_threshold 1 --dbo-decode-token-threshold
dp_sync_interval 1 --dp-sync-interval
dbo_prefill_token_threshold 1 --dbo-prefill-token-threshold
disable_nccl_for_dp_synchronization 0 --disable-nccl-for-dp-synchronization
    --enable-nccl-for-dp-synchronization! --no-disable-nccl-for-dp-synchronization!
enable_eplb 0 --disable-eplb! --enable-eplb --no-enable-eplb!
eplb_config 1 --eplb-config
expert_placement_strategy 1 --expert-placement-strategy
max_parallel_loading_workers 1 --max-parallel-loading-workers
ray_workers_use_nsight 0 --no-ray-workers-use-nsight! --ray-workers-use-nsight
disable_custom_all_reduce 0 --disable-custom-all-reduce --enable-custom-all-reduce!
    --no-disable-custom-all-reduce!
worker_cls 1 --worker-cls
worker_extension_cls 1 --worker-extension-cls
enable_fault_tolerance 0 --disable-fault-tolerance! --enable-fault-tolerance
    --no-enable-fault-tolerance!
fault_tolerance_config 1 --fault-tolerance-config
block_size 1 --block-size
gpu_memory_utilization 1 --device-memory-utilization --gpu-memory-utilization
kv_cache_memory_bytes 1 --kv-cache-memory-bytes
enable_extensible_kv_cache 0 --disable-extensible-kv-cache! --enable-extensible-kv-cache
    --no-enable-extensible-kv-cache!
kv_cache_dtype 1 --kv-cache-dtype
num_gpu_blocks_override 1 --num-gpu-blocks-override
enable_prefix_caching 0 --disable-prefix-caching! --enable-prefix-caching --no-enable-prefix-caching!
prefix_caching_hash_algo 1 --prefix-caching-hash-algo
prefix_cache_retention_interval 1 --prefix-cache-retention-interval
kv_cache_dtype_skip_layers + --kv-cache-dtype-skip-layers
kv_sharing_fast_prefill 0 --kv-sharing-fast-prefill --no-kv-sharing-fast-prefill!
swa_bounded_replay 0 --no-swa-bounded-replay! --swa-bounded-replay
mamba_cache_dtype 1 --mamba-cache-dtype
mamba_ssm_cache_dtype 1 --mamba-ssm-cache-dtype
mamba_block_size 1 --mamba-block-size
prefix_match_unit 1 --prefix-match-unit
mamba_cache_mode 1 --mamba-cache-mode
enable_mamba_shared_prefix_checkpoint 0 --disable-mamba-shared-prefix-checkpoint!
    --enable-mamba-shared-prefix-checkpoint --no-enable-mamba-shared-prefix-checkpoint!
replayssm_buffer_len 1 --replayssm-buffer-len
use_replayssm 0 --no-use-replayssm! --use-replayssm
kv_offloading_size 1 --kv-offloading-size
kv_offloading_backend 1 --kv-offloading-backend
offload_backend 1 --offload-backend
cpu_offload_gb 1 --cpu-offload-gb
cpu_offload_params + --cpu-offload-params
offload_group_size 1 --offload-group-size
offload_num_in_group 1 --offload-num-in-group
offload_prefetch_step 1 --offload-prefetch-step
offload_params + --offload-params
language_model_only 0 --language-model-only --no-language-model-only!
limit_mm_per_prompt 1 --limit-mm-per-prompt
enable_mm_embeds 0 --disable-mm-embeds! --enable-mm-embeds --no-enable-mm-embeds!
media_io_kwargs 1 --media-io-kwargs
mm_processor_kwargs 1 --mm-processor-kwargs
mm_processor_cache_gb 1 --mm-processor-cache-gb
mm_processor_cache_type 1 --mm-processor-cache-type
mm_hasher_algorithm 1 --mm-hasher-algorithm
mm_shm_cache_max_object_size_mb 1 --mm-shm-cache-max-object-size-mb
mm_encoder_only 0 --mm-encoder-only --no-mm-encoder-only!
mm_encoder_tp_mode 1 --mm-encoder-tp-mode
mm_encoder_attn_backend 1 --mm-encoder-attn-backend
mm_encoder_attn_dtype 1 --mm-encoder-attn-dtype
mm_encoder_fp8_scale_path 1 --mm-encoder-fp8-scale-path
mm_encoder_fp8_scale_save_path 1 --mm-encoder-fp8-scale-save-path
mm_encoder_fp8_scale_save_margin 1 --mm-encoder-fp8-scale-save-margin
interleave_mm_strings 0 --interleave-mm-strings --no-interleave-mm-strings!
skip_mm_profiling 0 --no-skip-mm-profiling! --skip-mm-profiling
video_pruning_rate 1 --video-pruning-rate
video_pruning_method 1 --video-pruning-method
mm_tensor_ipc 1 --mm-tensor-ipc
mm_processor_device 1 --mm-processor-device
mm_ipc_gpu_memory_gb 1 --mm-ipc-gpu-memory-gb
mm_device_do_normalize 0 --mm-device-do-normalize --no-mm-device-do-normalize!
enable_lora 0 --disable-lora! --enable-lora --no-enable-lora!
max_loras 1 --max-loras
max_lora_rank 1 --max-lora-rank
lora_dtype 1 --lora-dtype
enable_tower_connector_lora 0 --disable-tower-connector-lora! --enable-tower-connector-lora
    --no-enable-tower-connector-lora!
max_cpu_loras 1 --max-cpu-loras
fully_sharded_loras 0 --fully-sharded-loras --no-fully-sharded-loras!
lora_target_modules + --lora-target-modules
default_mm_loras 1 --default-mm-loras
specialize_active_lora 0 --no-specialize-active-lora! --specialize-active-lora
enable_mixed_moe_lora_format 0 --disable-mixed-moe-lora-format! --enable-mixed-moe-lora-format
    --no-enable-mixed-moe-lora-format!
enable_moe_shared_loras 0 --disable-moe-shared-loras! --enable-moe-shared-loras
    --no-enable-moe-shared-loras!
max_lora_cls_labels 1 --max-lora-cls-labels
logging_config 1 --logging-config
log_level 1 --log-level
log_config_file 1 --log-config-file
show_hidden_metrics_for_version 1 --show-hidden-metrics-for-version
otlp_traces_endpoint 1 --otlp-traces-endpoint
collect_detailed_traces + --collect-detailed-traces
per_request_spec_decode_metrics 1 --per-request-spec-decode-metrics
kv_cache_metrics 0 --kv-cache-metrics --no-kv-cache-metrics!
kv_cache_metrics_sample 1 --kv-cache-metrics-sample
custom_histogram_buckets 1 --custom-histogram-buckets
cudagraph_metrics 0 --cudagraph-metrics --no-cudagraph-metrics!
enable_layerwise_nvtx_tracing 0 --disable-layerwise-nvtx-tracing! --enable-layerwise-nvtx-tracing
    --no-enable-layerwise-nvtx-tracing!
enable_mfu_metrics 0 --disable-mfu-metrics! --enable-mfu-metrics --no-enable-mfu-metrics!
enable_logging_iteration_details 0 --disable-logging-iteration-details!
    --enable-logging-iteration-details --no-enable-logging-iteration-details!
jit_monitor_mode 1 --jit-monitor-mode
jit_monitor_verbose 0 --jit-monitor-verbose --no-jit-monitor-verbose!
max_num_batched_tokens 1 --max-num-batched-tokens
max_num_scheduled_tokens 1 --max-num-scheduled-tokens
max_num_seqs 1 --max-num-seqs
max_num_active_seqs 1 --max-num-active-seqs
max_num_inflight_kv_loads 1 --max-num-inflight-kv-loads
max_num_queued_reqs 1 --max-num-queued-reqs
max_num_queued_tokens 1 --max-num-queued-tokens
long_prefill_token_threshold 1 --long-prefill-token-threshold
long_prefill_token_threshold_adaptive 0 --long-prefill-token-threshold-adaptive
    --no-long-prefill-token-threshold-adaptive!
scheduling_policy 1 --scheduling-policy
enable_chunked_prefill 0 --disable-chunked-prefill! --enable-chunked-prefill
    --no-enable-chunked-prefill!
disable_chunked_mm_input 0 --disable-chunked-mm-input --enable-chunked-mm-input!
    --no-disable-chunked-mm-input!
scheduler_cls 1 --scheduler-cls
scheduler_reserve_full_isl 0 --no-scheduler-reserve-full-isl! --scheduler-reserve-full-isl
watermark 1 --watermark
prefill_schedule_interval 1 --prefill-schedule-interval
cache_aware_admission_window 1 --cache-aware-admission-window
cache_aware_admission_threshold 1 --cache-aware-admission-threshold
disable_hybrid_kv_cache_manager 0 --disable-hybrid-kv-cache-manager --enable-hybrid-kv-cache-manager!
    --no-disable-hybrid-kv-cache-manager!
async_scheduling 0 --async-scheduling --no-async-scheduling!
stream_interval 1 --stream-interval
cudagraph_capture_sizes + --cudagraph-capture-sizes
max_cudagraph_capture_size 1 --max-cudagraph-capture-size
ir_op_priority 1 --ir-op-priority
enable_flashinfer_autotune 0 --disable-flashinfer-autotune! --enable-flashinfer-autotune
    --no-enable-flashinfer-autotune!
monokernel 0 --monokernel --no-monokernel!
moe_backend 1 --moe-backend
linear_backend 1 --linear-backend
sparse_indexer_topk_backend 1 --sparse-indexer-topk-backend
speculative_config 1 --speculative-config -sc
spec_method 1 --spec-method
spec_model 1 --spec-model
spec_tokens 1 --spec-tokens
watermark_config 1 --watermark-config
diffusion_config 1 --diffusion-config -dc
kv_transfer_config 1 --kv-transfer-config
kv_events_config 1 --kv-events-config
ec_transfer_config 1 --ec-transfer-config
ec_manager_config 1 --ec-manager-config
compilation_config 1 --compilation-config -cc
attention_config 1 --attention-config -ac
engram_config 1 --engram-config
reasoning_config 1 --reasoning-config
kernel_config 1 --kernel-config
additional_config 1 --additional-config
structured_outputs_config 1 --structured-outputs-config
aux_output_config 1 --aux-output-config
profiler_config 1 --profiler-config
watchdog_config 1 --watchdog-config
optimization_level 1 --optimization-level
performance_mode 1 --performance-mode
weight_transfer_config 1 --weight-transfer-config
disable_log_stats 0 --disable-log-stats
aggregate_engine_logging 0 --aggregate-engine-logging
fail_on_environ_validation 0 --fail-on-environ-validation --no-fail-on-environ-validation!
shutdown_timeout 1 --shutdown-timeout
gdn_prefill_backend 1 --gdn-prefill-backend
kda_prefill_backend 1 --kda-prefill-backend
kda_decode_backend 1 --kda-decode-backend
enable_log_requests 0 --disable-log-requests! --enable-log-requests --no-enable-log-requests!
"""


def _parse(table: str) -> tuple[VllmOption, ...]:
    rows: list[list[str]] = []
    for line in table.splitlines():
        if not line.strip():
            continue
        if line.startswith(" "):
            rows[-1] += line.split()
        else:
            rows.append(line.split())
    out = []
    for dest, arity, *words in rows:
        spellings = tuple(w.rstrip("!") for w in words)
        negative = tuple(w.rstrip("!") for w in words if w.endswith("!"))
        out.append(VllmOption(dest, spellings, arity, negative))
    return tuple(out)


OPTIONS: tuple[VllmOption, ...] = _parse(_TABLE)
"""Every ``vllm serve`` option of vLLM 0.34.0 but ``--help``, in the parser's order."""

DEST_ORDER: dict[str, int] = {"model_tag": -1} | {o.dest: i for i, o in enumerate(OPTIONS)}
"""Position of each destination in vLLM's parser (the positional ``model_tag`` comes first)."""

"""Tensor and data parallelism in the simulator: memory split, vLLM's checks, DP routing and scaling."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

from autotune.hardware.catalog import GPUS, MODELS
from autotune.sim.flags import ServeFlags, parse_flags
from autotune.sim.model import simulate, synthetic_workload
from autotune.sim.router import LeastLoaded
from autotune.sim.startup import StartFailure, StartupPlan, plan_startup

H100 = GPUS["H100-80GB"]


def _plan(model: str = "Llama-3.1-70B", **kwargs: Any) -> StartupPlan:
    flags = replace(ServeFlags(model=model, hardware=H100, max_model_len=8192), **kwargs)
    return plan_startup(flags, MODELS[model], random.Random(0))


def _log(plan: StartupPlan) -> str:
    return "\n".join(e.text for e in plan.events)


def test_tensor_parallel_splits_weights_and_kv_heads_across_the_group() -> None:
    """Llama-3.1-70B does not fit one H100; with TP=2 each GPU holds half the weights and half the KV
    heads, and TP=4 leaves far more KV capacity per GPU."""
    assert _plan().failure is StartFailure.OOM
    tp2, tp4 = _plan(tensor_parallel_size=2), _plan(tensor_parallel_size=4)
    assert tp2.ok and tp4.ok and tp2.memory is not None and tp4.memory is not None
    assert tp4.memory.weights_bytes * 2 == tp2.memory.weights_bytes
    assert tp4.memory.kv_bytes_per_token * 2 == tp2.memory.kv_bytes_per_token
    assert tp4.memory.kv_tokens > 10 * tp2.memory.kv_tokens


def test_tensor_parallel_must_divide_the_attention_heads_with_vllms_text() -> None:
    """TP=3 on a 64-head model fails VllmConfig's validation with vLLM 0.34's exact text, exit 1."""
    plan = _plan(tensor_parallel_size=3, gpus=4)
    assert plan.failure is StartFailure.INVALID_CONFIG and plan.exit_code == 1
    log = _log(plan)
    assert "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig" in log
    assert "Value error, Total number of attention heads (64) must be divisible by tensor parallel size " \
        "(3). [type=value_error" in log  # fmt: skip


def test_more_tp_than_gpus_is_vllms_world_size_error() -> None:
    """--sim-gpus 2 with TP=4 fails ParallelConfig with vLLM's world-size text naming both numbers."""
    plan = _plan(tensor_parallel_size=4, gpus=2)
    assert plan.failure is StartFailure.INVALID_CONFIG
    log = _log(plan)
    assert "1 validation error for ParallelConfig" in log
    assert "Value error, World size (4) is larger than the number of available GPUs (2) in this node. If " \
        "this is intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n" \
        "- multiprocessing, set '--nnodes' appropriately." in log  # fmt: skip


def test_a_data_parallel_rank_without_a_gpu_fails_its_engine_core() -> None:
    """TP=2 x DP=2 on 3 GPUs: the second DP rank's engine core finds no device (torch's invalid device
    ordinal) and the start fails like an engine-core failure of that rank."""
    plan = _plan("Llama-3.1-8B", tensor_parallel_size=2, data_parallel_size=2, gpus=3)
    assert plan.failure is StartFailure.INVALID_CONFIG
    log = _log(plan)
    assert "torch.AcceleratorError: CUDA error: invalid device ordinal" in log
    assert "Process EngineCore_DP1:" in log and "Failed core proc(s): {'EngineCore_DP1': 1}" in log


def test_sim_gpus_defaults_to_tp_times_dp() -> None:
    """Without --sim-gpus the node has exactly TP x DP GPUs, so any TP/DP combination starts; the
    option parses from the command line."""
    assert _plan("Llama-3.1-8B", tensor_parallel_size=2, data_parallel_size=4).ok
    flags = parse_flags(["m", "-tp", "2", "-dp", "3", "--sim-gpus", "8"])
    assert (flags.tensor_parallel_size, flags.data_parallel_size, flags.gpus) == (2, 3, 8)


def test_data_parallel_replicas_scale_saturated_throughput() -> None:
    """At saturation DP=2 and DP=4 engines (each with its own scheduler and KV cache) give nearly 2x and
    3-4x the output throughput of one, and the log has one capacity line per engine."""
    workload = synthetic_workload(400, input_len=(128, 512), output_len=(64, 256), seed=2)
    tput = {}
    for dp in (1, 2, 4):
        flags = {"max_model_len": 4096, "data_parallel_size": dp, "max_num_seqs": 64}
        result = simulate(flags, "H100-80GB", "Llama-3.1-8B", workload, rate=math.inf)
        assert result.ok and len(result.requests) == 400
        tput[dp] = result.output_throughput
        assert _log(result.startup).count("GPU KV cache size: ") == dp
    assert 1.6 < tput[2] / tput[1] <= 2.05
    assert 2.6 < tput[4] / tput[1] <= 4.1


class _FakeEngine:
    def __init__(self, waiting: int, running: int, kv: float) -> None:
        self.waiting, self.running, self.kv_usage = waiting, running, kv

    def load(self) -> tuple[int, int]:
        return self.waiting, self.running


def test_router_rotates_ties_and_prefers_the_least_loaded_engine() -> None:
    """Idle engines get requests round-robin; otherwise the fewest waiting + running wins, and a queue
    on an engine whose KV cache is nearly full counts extra."""
    router = LeastLoaded()
    idle = [_FakeEngine(0, 0, 0.0) for _ in range(3)]
    assert [router.choose(idle) for _ in range(4)] == [0, 1, 2, 0]
    assert LeastLoaded().choose([_FakeEngine(0, 5, 0.2), _FakeEngine(0, 3, 0.2)]) == 1
    # 2 waiting + 1 running at 100 % KV scores 3 + 2 x 3 = 9 > 6
    assert LeastLoaded().choose([_FakeEngine(2, 1, 1.0), _FakeEngine(0, 6, 0.3)]) == 1

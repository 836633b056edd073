"""The simulated vLLM against published vLLM serving figures: ours vs theirs, and the relative error.

Usage: ``python -m benchmarks.sim_vs_published``. Each figure is one published ``vllm bench serve`` /
``benchmark_serving.py`` result with its setup (model, GPU, lengths, concurrency or rate). It is replayed
with :func:`autotune.sim.simulate` with vLLM's default flags on the matching GPU profile (nothing here is
tuned to the figures). A client-side ``--max-concurrency C`` with ``--request-rate inf`` is replayed as
all requests at t=0 with ``max_num_seqs = C``: the engine then runs the same batches (C in flight, the
next one joins when one finishes), so throughput and TPOT compare, TTFT does not (ours includes the
queue wait the client's semaphore hides) and is not compared. Assumptions per figure are in ``note``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from autotune.hardware.catalog import load_model_arch
from autotune.sim import WorkloadRequest, simulate
from autotune.sim.flags import parse_flags
from benchmarks import QUICK_HELP


@dataclass(frozen=True)
class Figure:
    """One published figure and how to replay it."""

    label: str
    source: str
    model: str
    hardware: tuple[str, ...]
    """``--sim-*`` options selecting the GPU profile."""
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int | None
    """``--max-concurrency`` (``None``: unbounded, rate inf)."""
    metric: str
    """``output_throughput`` (tok/s) or ``median_tpot_ms``."""
    theirs: float
    vllm: str
    note: str = ""
    extra: tuple[str, ...] = ()


MUSHFIQ = "https://mushfiqrahman.dev/?p=1668"
MUSGRAVE = "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on"
PR18566 = "https://github.com/vllm-project/vllm/pull/18566"
A100_40 = ("--sim-hardware", "A100-80GB", "--sim-memory-gib", "40", "--sim-bandwidth-gbs", "1555")

PR18566_RUN = Figure(
    "Llama-3.1-8B, ShareGPT-like 230/203, rate inf",
    PR18566,
    "Llama-3.1-8B",
    ("--sim-hardware", "H100-80GB"),
    230,
    203,
    1000,
    None,
    "output_throughput",
    6582.87,
    "main, 2025-05",
    "GPU not stated (H100-80GB assumed); ShareGPT replaced by fixed mean lengths 229,711/1000 in and "
    "203,068/1000 out; V1 defaults for >= 70 GiB GPUs assumed (max_num_seqs 1024, "
    "max_num_batched_tokens 8192)",
    ("--max-num-seqs", "1024", "--max-num-batched-tokens", "8192"),
)
"""The PR's one run, its output throughput (its median TPOT is the figure after it)."""

FIGURES: tuple[Figure, ...] = (
    *(
        Figure(
            f"Mistral-7B, RTX 4090, 256/128, C={c}",
            MUSHFIQ,
            "Mistral-7B",
            ("--sim-hardware", "RTX-4090-24GB"),
            256,
            128,
            300,
            c,
            "output_throughput",
            tok_s,
            "not stated",
            "Mistral-7B-Instruct-v0.3; fixed lengths, ignore_eos assumed (post: '256 input -> 128 output')",
        )
        for c, tok_s in ((4, 210.0), (8, 377.0), (16, 644.0), (32, 975.0), (48, 1190.0))
    ),
    Figure(
        "Llama-3.1-8B, A100 40GB, 1024/128, C=1",
        MUSGRAVE,
        "Llama-3.1-8B",
        A100_40,
        1024,
        128,
        20,
        1,
        "output_throughput",
        75.0,
        "0.23.0 (as stated)",
        "'about 75 tokens/sec' at C=1 (rounded in the post); A100 40GB = A100 profile with 40 GiB, 1555 GB/s",
    ),
    Figure(
        "Llama-3.1-8B, A100 40GB, 1024/128, C=8",
        MUSGRAVE,
        "Llama-3.1-8B",
        A100_40,
        1024,
        128,
        160,
        8,
        "output_throughput",
        6.6 * 75.0,
        "0.23.0 (as stated)",
        "derived: the post gives a '6.6x gain' at C=8 over ~75 tok/s at C=1, i.e. ~495 tok/s",
    ),
    PR18566_RUN,
    replace(
        PR18566_RUN,
        label="Llama-3.1-8B, ShareGPT-like 230/203, rate inf (median TPOT ms)",
        metric="median_tpot_ms",
        theirs=48.84,
        note="the same run's median TPOT (ms); same assumptions",
    ),
)


@dataclass(frozen=True)
class Row:
    """One figure replayed: ours, theirs and the relative error (ours / theirs - 1)."""

    figure: Figure
    ours: float
    tpot_ms: float
    kv_tokens: int

    @property
    def error(self) -> float:
        """Relative error of the simulator against the published figure."""
        return self.ours / self.figure.theirs - 1.0


def replay(fig: Figure) -> Row:
    """Run ``simulate()`` for one figure with vLLM's default flags on its GPU profile."""
    argv = [fig.model, *fig.hardware, *fig.extra]
    if fig.concurrency is not None:
        argv += ["--max-num-seqs", str(fig.concurrency)]
    flags = parse_flags(argv)
    workload = [WorkloadRequest(fig.input_len, fig.output_len, 0.0) for _ in range(fig.num_prompts)]
    sim = simulate(flags, flags.hardware, load_model_arch(fig.model), workload, seed=0)
    if not sim.ok:
        raise SystemExit(f"{fig.label}: the simulated start failed: {sim.startup.error}")
    tpot = sim.stat("tpot", 50) * 1e3
    ours = sim.output_throughput if fig.metric == "output_throughput" else tpot
    return Row(fig, ours, tpot, sim.kv_tokens)


def main() -> None:
    """Print the comparison as a Markdown table, then the mean absolute error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_HELP} (the whole run is that quick)")
    parser.parse_args()
    rows = [replay(f) for f in FIGURES]
    print("| setup | vLLM | theirs | ours | error | our median TPOT ms | source |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        f = r.figure
        print(
            f"| {f.label} | {f.vllm} | {f.theirs:,.0f} | {r.ours:,.0f} | {r.error:+.0%} | "
            f"{r.tpot_ms:.1f} | {f.source} |"
        )
    mae = sum(abs(r.error) for r in rows) / len(rows)
    print(f"\nmean absolute relative error: {mae:.0%} over {len(rows)} figures")
    for f in FIGURES:
        if f.note:
            print(f"- {f.label}: {f.note}")


if __name__ == "__main__":
    main()

"""A config's latencies at an arrival rate, in closed form: the simulator's step time in a fluid queue.

The simulator (:mod:`autotune.sim`) replays every request step by step; this model keeps its physics (the
step time of :class:`autotune.sim.cost.CostModel`, with its free constants scaled) and replaces the replay
by the steady state of vLLM's scheduler at arrival rate ``λ`` per replica, so a prediction takes
microseconds and a whole search space can be ranked before every launch.

Steady state (the mean request has ``P`` prompt and ``D`` output tokens): every step decodes one token of
each of ``b`` running sequences and prefills ``p`` prompt tokens, and takes ``t = step_time(b + p)``.
Each request decodes for ``D`` steps and brings ``P`` prompt tokens, so ``b = λ·D·t`` and ``p = λ·P·t``;
``t`` is their fixed point. Two queues can hold a request back:

* a sequence slot: at most ``c = min(max_num_seqs, KV tokens / (P + D/2))`` sequences run (beyond the KV
  capacity vLLM preempts), each for ``D·t``; the wait is M/M/c's (Sakasegawa's approximation);
* the prefill budget: ``max_num_batched_tokens - b`` prompt tokens a step, served in arrival order; the wait
  is M/G/1's (Pollaczek-Khinchine, with the prompt lengths' spread).

A wait's ``q`` quantile is read from an exponential tail (``W/ρ · ln(ρ / (1-q))``). Then TTFT = the wait
+ the prompt's steps (``max(1, P_q / (budget - b))`` steps of ``t``); TPOT = the decode-only step plus the
prefill of the prompts admitted during the request's life (a burst, below); ITL = ``t``, or the time of a
step that carries a prefill chunk when more than ``1 - q`` of the steps do; E2EL = TTFT + the other
``D_q - 1`` steps. Capacity is where a queue's load reaches 1: ``b = c`` or ``p + b = budget``.

TPOT's tail (:func:`_tpot`): a request decodes for ``D`` steps, and every prompt admitted meanwhile adds its
prefill to them, so its TPOT is ``a + (t - a) · N / N̄``, with ``a`` the decode-only step, ``N`` the prompts
admitted during its life and ``N̄ = λ·D·t`` their mean. Each admitted prompt lengthens the life by its
prefill, during which more arrive: ``N`` is a branching count (Poisson arrivals, each begetting a Poisson
number more with mean ``m = (t - a) / t``, the prefill's share of the mean step), whose variance is
``N̄ / (1 - m)²``; its quantile is a gamma's with that mean and variance (Wilson and Hilferty's cube root).
While ``max_num_seqs`` sequences run the scheduler admits no prompt, so ``N`` is capped there: a small
``max_num_seqs`` holds TPOT's tail and sends the excess to TTFT. A KV cache that holds fewer sequences caps
nothing: a prompt is admitted while blocks are free, and decodes that run out of them preempt.

What it leaves out (the fitted tail factors absorb some of it): prefix-cache hits, speculative decoding,
request-length outliers beyond the quantiles, preemption storms, the client's ramp.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autotune.load.metrics import percentile
from autotune.sim.cost import CostModel

QUANTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
"""Length quantiles (percent) a :class:`Traffic` keeps."""
MAX_QUANTILE = 0.999
"""The quantile standing for a ``max`` statistic."""


@dataclass(frozen=True)
class Bound:
    """One SLO term as the model checks it: ``metric`` at ``quantile`` (``None``: mean) times the term's
    fitted ``factor`` must stay within ``limit_s``."""

    metric: str
    quantile: float | None
    limit_s: float
    factor: float = 1.0


@dataclass(frozen=True)
class Traffic:
    """What the model needs of a workload: prompt and output lengths (tokens)."""

    prompt: float
    """Mean prompt tokens."""
    output: float
    """Mean output tokens."""
    prompt_cv2: float
    """Squared coefficient of variation of the prompt lengths (the prefill queue's service spread)."""
    prompt_quantiles: Mapping[float, float]
    """Prompt tokens at a few quantiles (percent), for TTFT quantiles."""
    output_quantiles: Mapping[float, float]

    @classmethod
    def of(cls, prompts: Sequence[int], outputs: Sequence[int]) -> Traffic:
        """From a sample of requests' prompt and output lengths (at least one)."""
        if not prompts or len(prompts) != len(outputs):
            raise ValueError("traffic needs one prompt and one output length per request")
        p = sum(prompts) / len(prompts)
        var = sum((x - p) ** 2 for x in prompts) / len(prompts)
        return cls(
            prompt=p,
            output=max(1.0, sum(outputs) / len(outputs)),
            prompt_cv2=var / (p * p) if p > 0 else 0.0,
            prompt_quantiles={q: percentile(prompts, q) for q in QUANTILES},
            output_quantiles={q: percentile(outputs, q) for q in QUANTILES},
        )

    def prompt_at(self, q: float | None) -> float:
        return self.prompt if q is None else _nearest(self.prompt_quantiles, q, self.prompt)

    def output_at(self, q: float | None) -> float:
        return self.output if q is None else _nearest(self.output_quantiles, q, self.output)


def _nearest(table: Mapping[float, float], q: float, fallback: float) -> float:
    if not table:
        return fallback
    return table[min(table, key=lambda k: abs(k - q))]


@dataclass(frozen=True)
class Engine:
    """One config as the fluid model sees it (per data-parallel replica)."""

    cost: CostModel
    max_num_seqs: int
    budget: int
    """``max_num_batched_tokens``: tokens a step may carry."""
    kv_tokens: int
    """KV-cache capacity in tokens (one replica)."""
    replicas: int = 1
    """Data-parallel replicas: the rate is split over them."""


@dataclass(frozen=True)
class State:
    """The steady state at one arrival rate (per replica)."""

    rate: float
    """Requests per second this replica gets."""
    step_s: float
    """Mean step time: ``share`` of the steps carry a prefill chunk, the others only decodes."""
    decode_step_s: float
    prefill_step_s: float
    share: float
    """Of the steps, the share that carry a prefill chunk."""
    chunk: float
    """Prompt tokens a prefill-carrying step holds."""
    running: float
    """``b``: sequences decoding in a step."""
    slot_wait_s: float
    slot_load: float
    prefill_wait_s: float
    prefill_load: float


def slots(engine: Engine, traffic: Traffic) -> float:
    """How many sequences can run at once: ``max_num_seqs``, or fewer when the KV cache holds fewer."""
    per_seq = traffic.prompt + traffic.output / 2.0
    return max(1.0, min(float(engine.max_num_seqs), engine.kv_tokens / max(per_seq, 1.0)))


def _prefill_step(engine: Engine, traffic: Traffic, running: float, chunk: float) -> float:
    """A step that decodes ``running`` sequences and prefills ``chunk`` prompt tokens."""
    context = running * (traffic.prompt + traffic.output / 2.0)
    prompts = chunk / traffic.prompt
    return engine.cost.step_time(
        running + chunk,
        running + prompts,
        context + chunk,
        context + chunk * traffic.prompt / 2.0,
        running + prompts,
        prefill=True,
    )


def _poisson_quantile(mean: float, q: float | None) -> float:
    """The ``q`` quantile (percent) of a Poisson count with ``mean`` (``None``: the mean itself)."""
    if q is None:
        return mean
    if mean <= 0:
        return 0.0
    target = q / 100.0
    k, term = 0, math.exp(-mean)
    total = term
    while total < target and k < 10_000:
        k += 1
        term *= mean / k
        total += term
    return float(k)


def _steps(
    engine: Engine, traffic: Traffic, running: float, lam: float, t: float
) -> tuple[float, float, float, float]:
    """(decode-only step, prefill-carrying step, chunk, share of prefill-carrying steps) with ``running``
    sequences decoding, ``lam`` arrivals per second and a mean step of ``t``: a prefill-carrying step
    holds the prompts that arrived during a step, within the budget the decodes leave (more steps carry
    prefill when the budget cuts them)."""
    room = max(1.0, engine.budget - running)
    arrivals = lam * t
    # Prompts arrive as a Poisson stream: a step follows one with at least one arrival with probability
    # 1 - e^-a, and then carries the prompts that came (a / (1 - e^-a) on average) within the budget.
    share = -math.expm1(-arrivals) if arrivals > 0 else 0.0
    chunk = min(room, traffic.prompt * arrivals / share) if share > 0 else min(room, traffic.prompt)
    context = running * (traffic.prompt + traffic.output / 2.0)
    decode = (
        engine.cost.step_time(running, running, context, context, running, prefill=False) if running else 0.0
    )
    prefill = _prefill_step(engine, traffic, running, chunk)
    share = min(1.0, max(share, arrivals * traffic.prompt / chunk))
    return decode, prefill, chunk, share


def state(engine: Engine, traffic: Traffic, rate: float) -> State | None:
    """The steady state at ``rate`` requests per second (all replicas); ``None`` when a queue overflows."""
    lam = rate / engine.replicas
    if lam <= 0:
        return None
    c = slots(engine, traffic)

    def excess(t: float) -> float:
        """Mean step at a mean step of ``t``, less ``t`` (zero at the steady state)."""
        decode, prefill, _, share = _steps(engine, traffic, lam * traffic.output * t, lam, t)
        return share * prefill + (1.0 - share) * decode - t

    # The mean step grows with itself (more running sequences, bigger chunks): the steady state is where
    # it meets itself, below the step at which the slots or the budget would overflow (else none).
    high = min(c / (lam * traffic.output), engine.budget / (lam * (traffic.prompt + traffic.output)))
    high *= 1.0 - 1e-9
    g_high = excess(high)
    if g_high >= 0:
        return None
    low = min(1e-7, high / 2.0)  # at 0 nothing runs and nothing arrives: a step of 0 meets itself
    g_low = excess(low)
    t = high
    for _ in range(100):  # regula falsi, Illinois variant
        t = (low * g_high - high * g_low) / (g_high - g_low)
        g = excess(t)
        if abs(g) <= 1e-4 * t:
            break
        if g > 0:
            low, g_low = t, g
            g_high /= 2.0
        else:
            high, g_high = t, g
            g_low /= 2.0
    decode, prefill, chunk, share = _steps(engine, traffic, lam * traffic.output * t, lam, t)
    running = lam * traffic.output * t
    room = engine.budget - running
    prefill_load = lam * traffic.prompt * t / room
    if running >= c or prefill_load >= 1.0:
        return None
    # Sequence slots: M/M/c, each held for D steps (Sakasegawa's approximation).
    slot_load = running / c
    held = traffic.output * t
    slot_wait = held / c * slot_load ** (math.sqrt(2.0 * (c + 1.0)) - 1.0) / (1.0 - slot_load)
    # The prefill budget: M/G/1 in arrival order, a prompt served in P / room prefill-carrying steps.
    service = traffic.prompt / room * prefill
    prefill_wait = prefill_load * service * (1.0 + traffic.prompt_cv2) / (2.0 * (1.0 - prefill_load))
    return State(
        lam, t, decode, prefill, share, chunk, running, slot_wait, slot_load, prefill_wait, prefill_load
    )


def capacity(engine: Engine, traffic: Traffic) -> float:
    """Requests per second (all replicas) at which a queue overflows (to 0.5 %)."""
    high = engine.replicas * engine.budget / (traffic.prompt + traffic.output)  # one token a step: 1 s
    low = high
    while low > 1e-9 and state(engine, traffic, low) is None:
        low /= 4.0
    if low <= 1e-9:
        return 0.0
    high = low * 4.0
    while state(engine, traffic, high) is not None:
        low, high = high, high * 4.0
    while high - low > 5e-3 * high:
        mid = (low + high) / 2.0
        if state(engine, traffic, mid) is None:
            high = mid
        else:
            low = mid
    return low


def _wait_quantile(wait: float, load: float, q: float | None) -> float:
    """The ``q`` quantile (percent) of a wait with mean ``wait`` (exponential tail of mass ``load``)."""
    if q is None or wait <= 0 or load <= 0:
        return wait
    tail = 1.0 - q / 100.0
    if load <= tail:
        return 0.0
    return wait / load * math.log(load / tail)


#: Standard normal quantiles (percent → z) for the prompts admitted during a request's life.
_Z = {50.0: 0.0, 90.0: 1.2816, 95.0: 1.6449, 99.0: 2.3263, 99.9: 3.0902}
MAX_PREFILL_SHARE = 0.98
"""The most of the mean step the branching of :func:`_tpot` gives the prefill (its variance grows as
``1 / (1 - m)²``: near 1 any tail is possible, and ``max_num_seqs`` caps it)."""


def _burst(mean: float, dispersion: float, z: float) -> float:
    """The quantile at the standard normal's ``z`` of a count with ``mean`` and variance ``dispersion ×
    mean``: a gamma's, by Wilson and Hilferty's cube root (``mean × (1 - 2/(9ν) + z·√(2/(9ν)))³`` with
    ``ν = 2 · mean / dispersion``)."""
    if mean <= 0:
        return 0.0
    nu = 2.0 * mean / dispersion
    return mean * max(0.0, 1.0 - 2.0 / (9.0 * nu) + z * math.sqrt(2.0 / (9.0 * nu))) ** 3


def _tpot(st: State, engine: Engine, z: float) -> float:
    """TPOT at the standard normal's ``z`` in state ``st``: the decode-only step plus the prefill of the
    prompts admitted during the request's life, a branching count capped by ``max_num_seqs`` (the
    module's docstring says how)."""
    t, decode = st.step_s, st.decode_step_s
    admitted = st.running  # λ·D·t: the prompts that arrive during a life of D mean steps
    if t <= decode or admitted <= 0:
        return t
    share = min(MAX_PREFILL_SHARE, 1.0 - decode / t)
    burst = min(_burst(admitted, 1.0 / (1.0 - share) ** 2, z), float(engine.max_num_seqs))
    return decode + (t - decode) * burst / admitted


def latency(st: State, engine: Engine, traffic: Traffic, metric: str, quantile: float | None) -> float:
    """The model's value (seconds) of ``metric`` (ttft, tpot, itl, e2el) at ``quantile`` (a fraction;
    ``None``: the mean) in state ``st``.

    TTFT: the queues' waits, the rest of the step under way, then the steps that prefill the prompt with
    those that arrived with it.
    TPOT: the decode-only step plus the prefill of the prompts admitted during the request's life (the
    mean step at the mean; :func:`_tpot`).
    ITL: a prefill-carrying step when more than ``1 - q`` of the steps are, else a decode-only one."""
    q = None if quantile is None else 100.0 * quantile
    t = st.step_s
    room = max(1.0, engine.budget - st.running)
    wait = _wait_quantile(st.slot_wait_s, st.slot_load, q) + _wait_quantile(
        st.prefill_wait_s, st.prefill_load, q
    )
    residual = (st.share * st.prefill_step_s**2 + (1.0 - st.share) * st.decode_step_s**2) / (2.0 * t)
    # The prompt's own prefill, in one step with the prompts that arrived with it (a Poisson count).
    tokens = traffic.prompt_at(q) + _poisson_quantile(st.rate * t, q) * traffic.prompt
    step = _prefill_step(engine, traffic, st.running, min(room, tokens))
    ttft = wait + residual + max(1.0, math.ceil(tokens / room)) * step
    if metric == "ttft":
        return ttft
    if metric == "tpot":
        return t if q is None else _tpot(st, engine, _Z[min(_Z, key=lambda k: abs(k - q))])
    if metric == "itl":
        busy = st.share > 1.0 - (quantile if quantile is not None else 0.5)
        return st.prefill_step_s if busy else st.decode_step_s
    if metric == "e2el":
        return ttft + max(0.0, traffic.output_at(q) - 1.0) * t
    raise ValueError(f"unknown latency metric {metric!r}")


def holds(engine: Engine, traffic: Traffic, bounds: Sequence[Bound], rate: float) -> bool:
    """Whether every bound holds at ``rate`` (a queue that overflows holds none)."""
    st = state(engine, traffic, rate)
    if st is None:
        return False
    return all(b.factor * latency(st, engine, traffic, b.metric, b.quantile) <= b.limit_s for b in bounds)


def ceiling(engine: Engine, traffic: Traffic) -> float:
    """A rate no steady state reaches (requests per second, all replicas): every slot, or the whole
    budget, turned over at the speed of the shortest step there is."""
    floor = engine.cost.step_time(1, 1, traffic.prompt, traffic.prompt, 1, prefill=False)
    per_step = min(slots(engine, traffic) / traffic.output, engine.budget / (traffic.prompt + traffic.output))
    return engine.replicas * per_step / floor


def slo_rate(engine: Engine, traffic: Traffic, bounds: Sequence[Bound], *, rel: float = 0.005) -> float:
    """The highest arrival rate (requests per second) at which every bound holds, to ``rel``; 0.0 when
    none holds even at a trickle. Latencies only grow with the rate, so a bisection (in log space while
    the bracket is wide) finds it."""
    high = ceiling(engine, traffic)
    low = high * 1e-4
    if not holds(engine, traffic, bounds, low):
        return 0.0
    while high - low > rel * high:
        mid = math.sqrt(low * high) if high > 2 * low else (low + high) / 2.0
        if holds(engine, traffic, bounds, mid):
            low = mid
        else:
            high = mid
    return low

"""``--speculative-config``: vLLM 0.34's validation of the JSON, and what the draft costs.

Validation follows ``SpeculativeConfig.__post_init__`` and its speculator configs (vLLM 0.34.0), with
their texts (each is one pydantic ``ValidationError`` for ``SpeculativeConfig``):

* unknown keys: ``Unexpected keyword argument``; ``num_speculative_tokens`` <= 0: ``Input should be
  greater than 0``; an unknown ``method``: ``Unknown speculative method 'x'. Built-in methods: [...]``;
* no ``method`` and no ``model``: the method is ``draft_model``, which needs a ``model``
  (``num_speculative_tokens was provided but without speculative model.``); without
  ``num_speculative_tokens``: ``num_speculative_tokens must be provided with speculative model unless the
  draft model config contains an n_predict parameter.`` (``A speculative model was provided, but
  `num_speculative_tokens` was not provided`` when a draft model was named);
* ``ngram``: ``prompt_lookup_min``/``max`` default to 5 (or to each other) and
  ``prompt_lookup_min=a must be <= prompt_lookup_max=b``;
* ``eagle``/``eagle3`` need a ``model`` (the head); ``mtp`` uses the target's own MTP layer; a draft
  ``model`` that is neither a catalog model nor a directory with a ``config.json`` is ``Invalid
  repository ID or local directory specified``.

With a ``model`` and no ``method``, vLLM detects the method from the checkpoint; the simulator detects
``eagle3``/``eagle`` from the model's name, else ``draft_model``.

Draft cost, per step, for every request that keeps decoding: ``k`` sequential forward passes of the
drafter over those requests. ``ngram`` and ``suffix`` draft on the CPU (no GPU time, no memory); an
EAGLE/MTP head is one decoder layer of the target (plus the target's LM head, which it shares) with its
own KV; a draft model is its own roofline, weights and KV (at ``draft_tensor_parallel_size``, default the
target's TP).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autotune.errors import AutotuneError, SpecError
from autotune.hardware.catalog import ModelArch, load_model_arch

BUILTIN_METHODS = (
    "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "deepseek_mtp", "dflash", "dots3_note_mtp",
    "draft_model", "dspark", "eagle", "eagle3", "ernie_mtp", "exaone4_5_mtp", "exaone_moe_mtp",
    "extract_hidden_states", "gemma4_mtp", "glm4_moe_lite_mtp", "glm4_moe_mtp", "glm5_next_mtp",
    "glm_ocr_mtp", "hy_v3_mtp", "hy_v4_mtp", "inkling_mtp", "kimi_k3_mtp", "longcat_flash_mtp",
    "mimo_mtp", "mimo_v2_mtp", "minimax_m3_mtp", "mtp", "nemotron3_5_transcribe_mtp", "nemotron_h_mtp",
    "ngram", "ngram_gpu", "pangu_ultra_moe_mtp", "qwen3_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp",
    "step3p5_mtp", "step5_mtp", "suffix",
)  # fmt: skip
"""The methods vLLM 0.34.0 lists in its unknown-method error (sorted, as it prints them)."""

FIELDS = frozenset(
    (  # noqa: SIM905 - a word list
        "enforce_eager num_speculative_tokens model method draft_tensor_parallel_size "
        "draft_decode_context_parallel_size tensor_parallel_size quantization moe_backend "
        "attention_backend kv_cache_dtype max_model_len revision code_revision "
        "index_share_for_mtp_iteration disable_eagle_block_drop disable_lookahead_block_hashes "
        "draft_lm_head_quantization use_local_argmax_reduction prompt_lookup_max prompt_lookup_min "
        "parallel_drafting target_model_config target_parallel_config "
        "num_speculative_tokens_per_batch_size draft_model_config draft_parallel_config "
        "suffix_decoding_max_tree_depth suffix_decoding_max_cached_requests "
        "suffix_decoding_corpus_tokens suffix_decoding_max_spec_factor suffix_decoding_min_token_prob "
        "draft_load_config rejection_sample_method synthetic_acceptance_rates "
        "synthetic_acceptance_length enable_adaptive_verification draft_sample_method "
        "dspark_draft_topk xpress_topc speculator_options fly_window_size fly_entropy_threshold "
        "fly_entropy_top_k"
    ).split()
)
"""The keyword arguments vLLM 0.34.0's ``SpeculativeConfig`` accepts."""

CPU_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix"})
HEAD_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark", "extract_hidden_states"})
"""Methods whose drafter is a head on the target (modelled as one decoder layer of the target)."""


@dataclass(frozen=True)
class SpecDecode:
    """A validated speculative-decoding setup."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    """The draft model or head (None for n-gram/suffix drafting)."""
    draft: ModelArch | None = None
    """What the drafter computes per pass (None: it runs on the CPU)."""
    draft_tensor_parallel_size: int = 1
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __repr__(self) -> str:
        """vLLM's repr: ``SpeculativeConfig(method='ngram', model=None, num_spec_tokens=4)``."""
        model = None if self.method in CPU_DRAFTERS else self.model
        return f"SpeculativeConfig(method={self.method!r}, model={model!r}, num_spec_tokens=" \
            f"{self.num_speculative_tokens})"  # fmt: skip


class SpecConfigError(AutotuneError):
    """The JSON does not validate: ``loc`` (a field name or "") and pydantic's message."""

    def __init__(self, loc: str, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def _value_error(text: str) -> SpecConfigError:
    return SpecConfigError(
        "",
        f"Value error, {text} [type=value_error, input_value=ArgsKwargs((), {{...}}), input_type=ArgsKwargs]",
    )


def _type_name(value: object) -> str:
    return type(value).__name__


def _check_fields(raw: Mapping[str, Any]) -> None:
    for key, value in raw.items():
        if key not in FIELDS:
            raise SpecConfigError(
                key,
                f"Unexpected keyword argument [type=unexpected_keyword_argument, input_value={value!r}, "
                f"input_type={_type_name(value)}]",
            )
    k = raw.get("num_speculative_tokens")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k <= 0):
        raise SpecConfigError(
            "num_speculative_tokens",
            f"Input should be greater than 0 [type=greater_than, input_value={k!r}, "
            f"input_type={_type_name(k)}]",
        )
    method = raw.get("method")
    if method is not None and method not in BUILTIN_METHODS:
        raise SpecConfigError(
            "method",
            f"Value error, Unknown speculative method {method!r}. Built-in methods: "
            f"{list(BUILTIN_METHODS)}; registered custom methods: []. [type=value_error, "
            f"input_value={method!r}, input_type={_type_name(method)}]",
        )


def _head(arch: ModelArch) -> ModelArch:
    """An EAGLE/MTP head: one decoder layer of the target that shares its LM head."""
    return replace(arch, name=f"{arch.name}-draft-head", num_layers=1, tie_word_embeddings=True)


def parse_speculative_config(raw: Mapping[str, Any], target: ModelArch, target_tp: int) -> SpecDecode:
    """Validate ``--speculative-config`` as vLLM 0.34 does; :class:`SpecConfigError` when it does not."""
    raw = {str(k).replace("-", "_"): v for k, v in raw.items()}
    _check_fields(raw)
    method = raw.get("method")
    model = raw.get("model")
    k = raw.get("num_speculative_tokens")
    if method is None and model in ("ngram", "[ngram]"):
        method = "ngram"
    if method is None and model is None:
        method = "draft_model"
    if method is None:
        name = str(model).lower()
        method = "eagle3" if "eagle3" in name else "eagle" if "eagle" in name else "draft_model"
    if method in ("draft_model", "eagle", "eagle3") and model is None and k is not None:
        raise _value_error("num_speculative_tokens was provided but without speculative model.")
    if k is None:
        if model is not None and method not in CPU_DRAFTERS:
            raise _value_error(
                "A speculative model was provided, but `num_speculative_tokens` was not provided"
            )
        raise _value_error(
            "num_speculative_tokens must be provided with speculative model unless the draft model "
            "config contains an n_predict parameter."
        )
    if method in CPU_DRAFTERS:
        lo: int | None = raw.get("prompt_lookup_min")
        hi: int | None = raw.get("prompt_lookup_max")
        if method != "suffix":
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            lo, hi = (5, 5) if lo is None or hi is None else (lo, hi)
            if lo > hi:
                raise _value_error(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return SpecDecode(method, k, None, None, 1, lo, hi)
    draft_tp = raw.get("draft_tensor_parallel_size") or target_tp
    if method in HEAD_DRAFTERS or method.endswith("_mtp"):
        return SpecDecode(method, k, model or target.name, _head(target), target_tp)
    try:
        draft = load_model_arch(str(model))
    except SpecError:
        raise _value_error(
            f"Invalid repository ID or local directory specified: {model!r}.\n"
            "Please verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file.\n"
            "   - For Hugging Face models: ensure the presence of a 'config.json'.\n"
            "   - For Mistral models: ensure the presence of a 'params.json'.\n"
        ) from None
    return SpecDecode(method, k, str(model), draft, int(draft_tp))

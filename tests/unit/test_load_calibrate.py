"""Prompt-length calibration: word costs, added tokens, verification, counters and where tokenizers are."""

from __future__ import annotations

import json
import math
import random
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from autotune.errors import LoadError, SpecError
from autotune.inputs.spec import WorkloadSpec
from autotune.load.calibrate import (
    LocalCounter,
    calibrate,
    calibrate_or_explain,
    calibrate_workload,
    find_tokenizer_file,
    needs_calibration,
)
from autotune.load.words import WORDS
from autotune.load.workload import build_requests

tokenizers = pytest.importorskip("tokenizers")


class PieceCounter:
    """A whitespace-splitting tokenizer: a word of n letters is ceil(n / 3) tokens; BOS and a chat
    template add tokens around the prompt."""

    source = "pieces"

    def __init__(self, bos: int = 1, template: int | None = 6) -> None:
        self.bos = bos
        self.template = template
        self.calls = 0

    def count(self, text: str, *, chat: bool) -> int | None:
        self.calls += 1
        body = sum(math.ceil(len(w) / 3) for w in text.split())
        if chat:
            return None if self.template is None else body + self.template
        return body + self.bos


class MergingCounter:
    """A tokenizer that merges across spaces (one token per 4 characters of the whole text)."""

    source = "merging"

    def count(self, text: str, *, chat: bool) -> int | None:
        return 1 + len(text) // 4


def test_word_costs_and_added_tokens_are_measured() -> None:
    """Each word's cost is what the tokenizer charges it; BOS and the chat template are the added tokens."""
    cal = calibrate(PieceCounter(bos=1), WORDS, chat=False)
    assert cal.added == 1
    assert dict(cal.words) == {w: math.ceil(len(w) / 3) for w in dict.fromkeys(WORDS)}
    chat = calibrate(PieceCounter(bos=1, template=6), WORDS, chat=True)
    assert chat.added == 6 and chat.chat_template_counted
    assert chat.as_dict()["added_tokens"] == 6


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_calibrated_prompts_count_exactly_the_intended_tokens(tmp_path: Path, endpoint: str) -> None:
    """Prompts built with a calibration (prefix included) count exactly input_len tokens, for many lengths."""
    counter = PieceCounter(bos=1, template=6)
    cal = calibrate(counter, WORDS, chat=endpoint == "chat")
    wl = WorkloadSpec.model_validate(
        {
            "endpoint": endpoint,
            "dataset": {
                "input_len": {"dist": "uniform", "low": 1, "high": 300},
                "output_len": 4,
                "prefix_len": 17,
            },
        }
    )
    reqs = build_requests(wl, 200, seed=3, base_dir=tmp_path, calibration=cal)
    for r in reqs:
        assert isinstance(r.prompt, str)
        counted = counter.count(r.prompt, chat=endpoint == "chat")
        body = r.input_len - 17
        if body > cal.added:  # a prompt cannot be shorter than the tokens added plus one word
            assert counted == r.input_len, r
    assert len({str(r.prompt).split()[0] for r in reqs}) == 1  # the shared prefix


def test_text_spends_exactly_the_tokens_asked_and_is_seeded() -> None:
    """PromptCalibration.text gives exactly n tokens for every n, the same text for the same seed."""
    counter = PieceCounter(bos=0)
    cal = calibrate(counter, WORDS, chat=False)
    for n in range(1, 120):
        assert counter.count(cal.text(random.Random(n), n), chat=False) == n
    assert cal.text(random.Random(1), 50) == cal.text(random.Random(1), 50)


def test_a_tokenizer_that_merges_across_spaces_is_refused() -> None:
    """Word costs that do not add up are refused with the reason, not used."""
    with pytest.raises(LoadError, match="merging"):
        calibrate(MergingCounter(), WORDS, chat=False)


def test_too_few_fixed_cost_words_or_no_one_token_word_is_refused() -> None:
    """A calibration needs one-token words (to hit every length) and enough words."""
    with pytest.raises(LoadError, match="one token"):
        calibrate(PieceCounter(), ("important", "children", "sometimes"), chat=False)


def test_a_counter_without_chat_templates_says_so() -> None:
    """A local tokenizer cannot count a chat template: the calibration records it and adds nothing."""
    cal = calibrate(PieceCounter(bos=1, template=None), WORDS, chat=True)
    assert not cal.chat_template_counted and cal.added == 0


def _train_tokenizer(path: Path, *, bos: bool) -> Path:
    """A small byte-level BPE tokenizer (what Llama 3 / GPT-2 / Qwen use), trained here on English words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>"], show_progress=False)
    rng = random.Random(0)
    lines = [" ".join(rng.choices(WORDS, k=30)) for _ in range(400)]
    tok.train_from_iterator(lines, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(path))
    return path


@pytest.mark.parametrize("bos", [False, True])
def test_a_real_bpe_tokenizer_counts_the_calibrated_prompts_exactly(tmp_path: Path, bos: bool) -> None:
    """Against a trained byte-level BPE (with and without BOS), calibrated prompts tokenize exactly."""
    from tokenizers import Tokenizer

    path = _train_tokenizer(tmp_path / "tokenizer.json", bos=bos)
    cal = calibrate(LocalCounter(path), WORDS, chat=False)
    assert cal.added == (1 if bos else 0)
    assert any(k > 1 for _, k in cal.words)  # a 420-token vocabulary splits longer words
    tok = Tokenizer.from_file(str(path))
    wl = WorkloadSpec.model_validate({"dataset": {"input_len": {"dist": "uniform", "low": 8, "high": 400}}})
    for r in build_requests(wl, 60, seed=1, base_dir=tmp_path, calibration=cal):
        assert len(tok.encode(str(r.prompt)).ids) == r.input_len


def test_local_counter_errors_name_the_file(tmp_path: Path) -> None:
    """A malformed tokenizer file is a LoadError naming the file."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(LoadError, match=r"tokenizer\.json"):
        LocalCounter(bad)


def test_tokenizer_file_is_found_explicitly_beside_the_model_or_in_the_hf_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit file or folder wins; else the model's folder; else the newest HF cache snapshot."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    assert find_tokenizer_file("any", model_dir) == model_dir / "tokenizer.json"
    assert find_tokenizer_file("any", tmp_path / "t.json") == tmp_path / "t.json"
    assert find_tokenizer_file(str(model_dir), None) == model_dir / "tokenizer.json"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert find_tokenizer_file("org/name", None) is None
    snap = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text("{}")
    assert find_tokenizer_file("org/name", None) == snap / "tokenizer.json"
    assert find_tokenizer_file("Llama-3.1-8B", None) is None  # a bare name is no hub id


def test_which_workloads_need_a_calibration() -> None:
    """Synthetic and trace text prompts, and any shared prefix, need one; token ids and file prompts not."""

    def wl(**kw: object) -> WorkloadSpec:
        return WorkloadSpec.model_validate(kw)

    assert needs_calibration(wl())
    assert needs_calibration(wl(dataset={"kind": "trace", "path": "t.jsonl"}))
    assert not needs_calibration(wl(prompt_format="token_ids"))
    assert not needs_calibration(wl(dataset={"kind": "jsonl", "path": "p.jsonl"}))
    assert needs_calibration(wl(dataset={"kind": "jsonl", "path": "p.jsonl", "prefix_len": 8}))


class _NoTokenize(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.dumps({"detail": "Not Found"}).encode()
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_without_tokenize() -> Iterator[str]:
    """A real HTTP server that answers 404 to /tokenize (a server or proxy without it)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenize)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=30)


def test_without_tokenize_the_models_tokenizer_file_counts(
    tmp_path: Path, server_without_tokenize: str
) -> None:
    """No /tokenize: the tokenizer.json beside the model is used; with none, the error says what to set."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    _train_tokenizer(model_dir / "tokenizer.json", bos=True)
    wl = WorkloadSpec.model_validate({})
    cal = calibrate_workload(server_without_tokenize, str(model_dir), wl, None)
    assert cal is not None and cal.source.startswith("tokenizer ") and cal.added == 1
    with pytest.raises(LoadError, match=r"workload\.tokenizer"):
        calibrate_workload(server_without_tokenize, "some-model", wl, None)
    assert (
        calibrate_workload(
            server_without_tokenize, "m", wl.model_copy(update={"prompt_format": "token_ids"}), None
        )
        is None
    )


def test_a_calibration_that_cannot_be_made_stops_with_what_to_set(server_without_tokenize: str) -> None:
    """No /tokenize and no tokenizer file: one bad-input error naming workload.prompt_format and
    workload.tokenizer (measuring on would measure another workload); token ids need no calibration."""
    wl = WorkloadSpec.model_validate({})
    with pytest.raises(SpecError) as caught:
        calibrate_or_explain(server_without_tokenize, "some-model", wl, None)
    err = caught.value
    assert err.field == "workload.prompt_format" and "no /tokenize" in err.message
    assert "workload.tokenizer" in err.message and "token_ids" in err.message
    ids = wl.model_copy(update={"prompt_format": "token_ids"})
    assert calibrate_or_explain(server_without_tokenize, "m", ids, None) == (None, None)


def test_a_passing_failure_is_recorded_not_raised() -> None:
    """A server that does not answer is recorded (retried at the next server), not raised."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    cal, record = calibrate_or_explain(f"http://127.0.0.1:{port}", "m", WorkloadSpec.model_validate({}), None)
    assert cal is None and record is not None
    assert record["source"] is None and "cannot reach" in record["error"]

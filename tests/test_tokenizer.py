"""Tokenizer loading, EOS ids, incremental detokenization, stop strings, chat templates."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from typing import Any

import pytest

from kvrelay.engine.detokenizer import IncrementalDetokenizer, OutputProcessor, StopChecker
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.tokenizer import (
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
    read_chat_template,
    tokenizer_eos_token_id,
)

TEXTS = [
    "Hello, world! The lighthouse keeper wrote in her notebook.",
    "Emoji: 🎉👍❤️😊 and flags 🇯🇵, in a row🎉🎉.",
    "東京駅 北京烤鸭 饺子 한글 こんにちは、お元気ですか\uff1f Привет, как дела?",
    "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(3))\n",
    "  leading spaces, trailing spaces   \n\n\n and π ≈ 3.14159, √2, ∞, €12.50.",
    "Rare glyphs " + "".join(map(chr, range(0x1D518, 0x1D520))) + " and 🧬🪐, not in the corpus.",
]


@pytest.fixture(scope="module")
def tok(demo_model_dir: str) -> Any:
    return load_tokenizer(demo_model_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(detok.step(ids[i:i + k]))
        i += k
    out.append(detok.flush())
    return out


# -- loading -----------------------------------------------------------------------------------
def test_load_tokenizer(tok: Any, tmp_path: Any) -> None:
    assert tok.backend_tokenizer is not None
    assert len(tok) == 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok.decode(tok.encode("a plain sentence.")) == "a plain sentence."
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_eos_token_ids(demo_model_dir: str, tok: Any, tmp_path: Any) -> None:
    assert eos_token_ids(demo_model_dir, tok) == {2}
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 4]}))
    assert eos_token_ids(str(d), tok) == {2, 4, 6}
    assert eos_token_ids(str(d)) == {2, 4, 6}
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(str(d))
    assert eos_token_ids(str(tmp_path)) == frozenset()


def _tokenizer_copy(src: str, dst: Any, config: dict[str, Any] | None,
                    special_map: dict[str, Any] | None = None) -> str:
    dst.mkdir()
    shutil.copy(os.path.join(src, "tokenizer.json"), dst / "tokenizer.json")
    shutil.copy(os.path.join(src, "config.json"), dst / "config.json")
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (dst / "special_tokens_map.json").write_text(json.dumps(special_map))
    return str(dst)


def test_tokenizer_eos_from_files_is_the_loaded_tokenizers(demo_model_dir: str,
                                                            tmp_path: Any) -> None:
    """Read from the files where they say it plainly, else from the loaded tokenizer: the same
    id as ``load_tokenizer(d).eos_token_id`` for each way checkpoints write the EOS token."""
    with open(os.path.join(demo_model_dir, "tokenizer_config.json")) as f:
        base = json.load(f)
    added = {"__type": "AddedToken", "content": "<pad>", "lstrip": False, "normalized": False,
             "rstrip": False, "single_word": False, "special": True}
    no_eos = {k: v for k, v in base.items() if k != "eos_token"}
    cases = {
        "as written": (base, None),
        "an AddedToken's fields": ({**base, "eos_token": added}, None),
        "a plain vocabulary token": ({**base, "eos_token": "the"}, None),
        "in special_tokens_map.json only": (no_eos, {"eos_token": "<pad>"}),
        "the two files disagreeing": (base, {"eos_token": "<pad>"}),
        "not in the vocabulary": ({**base, "eos_token": "<never-seen>"}, None),
        "named nowhere": (no_eos, None),
        "a model-specific class": ({**base, "tokenizer_class": "LlamaTokenizer"}, None),
    }
    seen = set()
    for i, (what, (config, special_map)) in enumerate(cases.items()):
        d = _tokenizer_copy(demo_model_dir, tmp_path / str(i), config, special_map)
        want = load_tokenizer(d).eos_token_id
        assert tokenizer_eos_token_id(d) == want, what
        seen.add(want)
    assert len(seen) >= 3  # the cases do name different tokens
    assert tokenizer_eos_token_id(str(tmp_path / "0" / "missing")) is None


def test_a_worker_reads_its_checkpoint_without_transformers(demo_model_dir: str) -> None:
    """What a worker reads at start (the architecture, the EOS ids) comes from the files: with
    torch loaded, importing transformers' config and tokenizer machinery costs seconds."""
    code = ("import sys, torch\n"
            "from kvrelay.engine.models.arch import load_model_config\n"
            "from kvrelay.engine.tokenizer import eos_token_ids\n"
            f"d = {demo_model_dir!r}\nload_model_config(d)\n"
            "print(sorted(eos_token_ids(d)), 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["[2]", "False"]


# -- incremental detokenization ----------------------------------------------------------------
def test_deltas_join_to_decode_on_random_ids(tok: Any) -> None:
    """Random ids split multi-byte characters anywhere and make invalid UTF-8 as well."""
    rng = random.Random(1234)
    vocab = len(tok)
    prompts = [[], [1], tok.encode(TEXTS[0]), tok.encode(TEXTS[2])]
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 48))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, rng.choice(prompts), skip_special_tokens=skip)
        got = "".join(stream(detok, ids, rng))
        assert got == tok.decode(ids, skip_special_tokens=skip), ids


def test_deltas_never_split_a_character(tok: Any) -> None:
    rng = random.Random(7)
    split = 0
    for text in TEXTS:
        ids = tok.encode(text)
        split += sum("\ufffd" in tok.decode([i]) for i in ids)
        detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
        deltas = stream(detok, ids, rng)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas), deltas
        one_by_one = IncrementalDetokenizer(tok, [])
        deltas = [one_by_one.step([i]) for i in ids] + [one_by_one.flush()]
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert split > 10  # the texts do split characters across tokens


def test_leading_space_and_prompt_context(tok: Any) -> None:
    prompt = tok.encode("Tell me about the")
    out = tok.encode(" lighthouse keeper")
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.step(out[:1]).startswith(" ")
    assert detok.step(out[1:]) + detok.flush() == tok.decode(out[1:])


def test_special_tokens(tok: Any) -> None:
    ids = tok.encode("<|assistant|>\nSure.</s>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.eos_token_id in ids
    for skip, want in ((True, "\nSure."), (False, "<|assistant|>\nSure.</s>")):
        detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=skip)
        assert "".join(detok.step([i]) for i in ids) + detok.flush() == want


def sentencepiece_like_tokenizer() -> Any:
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback, a decoder that strips the
    first leading space (so decoding a window alone loses a space the prefix window restores)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvrelay.engine.demo_model import demo_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(demo_corpus().split("\n\n"), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_sentencepiece_style_tokenizer() -> None:
    sp = sentencepiece_like_tokenizer()
    prompt = sp.encode("Say:")
    rng = random.Random(3)
    byte_tokens = 0
    for text in TEXTS:
        full = sp.encode("Say: " + text.strip())
        assert full[:len(prompt)] == prompt
        out = full[len(prompt):]
        byte_tokens += sum(t.startswith("<0x") for t in sp.convert_ids_to_tokens(out))
        deltas = stream(IncrementalDetokenizer(sp, prompt), out, rng)
        assert "".join(deltas) == " " + text.strip()  # the space after "Say:" is kept
        assert not any("\ufffd" in d for d in deltas)
    assert byte_tokens > 8  # characters outside the vocabulary, split into byte tokens


def test_ids_past_the_tokenizer_vocab_are_dropped(tok: Any) -> None:
    """The base demo model pads its vocabulary; those ids decode to nothing, as in decode()."""
    ids = tok.encode(" hello") + [30000] + tok.encode(" world")
    detok = IncrementalDetokenizer(tok, [1])
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == " hello world"


def test_work_per_step_is_bounded(tok: Any) -> None:
    """Each step decodes a window of recent ids, not the whole output (no O(n^2))."""

    class Counting:
        def __init__(self) -> None:
            self.decoded = 0

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            self.decoded += len(ids)
            return tok.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    class Proxy:
        backend_tokenizer = Counting()

    ids = tok.encode(" ".join(TEXTS) * 8)
    detok = IncrementalDetokenizer(Proxy(), [])
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert Proxy.backend_tokenizer.decoded < 8 * len(ids)


# -- stop strings ------------------------------------------------------------------------------
def test_stop_checker_basics() -> None:
    sc = StopChecker(["END"])
    assert sc.step("Hello E") == ("Hello ", False, None)  # "E" could start "END"
    assert sc.step("N") == ("", False, None)
    assert sc.step("D and more") == ("", True, "END")
    assert sc.step("ignored") == ("", True, "END")
    assert sc.flush() == ""

    sc = StopChecker(["END"], include_stop_str_in_output=True)
    assert [sc.step(d).text for d in ("a", "EN", "Dz")] == ["a", "", "END"]

    sc = StopChecker(["END"])
    assert sc.step("Hello EN").text == "Hello "
    assert sc.step("x").text == "ENx"  # the held tail is released once it cannot match
    assert sc.step("EE").text == "E"  # only a tail that begins a stop string is held
    assert sc.flush() == "E"

    sc = StopChecker([])
    assert sc.step("anything END") == ("anything END", False, None)
    with pytest.raises(ValueError):
        StopChecker([""])


def test_stop_checker_first_completed_stop_wins() -> None:
    sc = StopChecker(["abcd", "bc"])
    assert sc.step("xabcd") == ("xa", True, "bc")
    sc = StopChecker(["bc", "abc"])
    assert sc.step("xabc") == ("x", True, "abc")  # both end together: the longer one
    sc = StopChecker(["。", "\n\n"])
    assert sc.step("東京駅") == ("東京駅", False, None)
    assert sc.step("です。次") == ("です", True, "。")


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[:i + len(s) if include else i], s


def test_stop_checker_random_streams() -> None:
    rng = random.Random(99)
    alphabet = "ab c\n東😊"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        sc = StopChecker(stops, include)
        parts, i, stopped, stop_string = [], 0, False, None
        while i < len(text) and not stopped:
            k = rng.randint(0, 4)
            r = sc.step(text[i:i + k])
            parts.append(r.text)
            stopped, stop_string = r.stopped, r.stop_string
            i += k
        if not stopped:
            parts.append(sc.flush())
        assert ("".join(parts), stop_string) == reference_stop(text, stops, include), \
            (text, stops)


def test_stop_string_across_token_boundaries(tok: Any) -> None:
    text = "The answer is 42. STOP HERE, and then the model went on talking."
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert "STOP HERE" not in pieces and not any(p.strip() == "STOP HERE" for p in pieces)
    for include, want in ((False, "The answer is 42. "), (True, "The answer is 42. STOP HERE")):
        sp = SamplingParams(stop=["STOP HERE", "never"], include_stop_str_in_output=include)
        proc = OutputProcessor(tok, [1], sp)
        steps = [proc.add([i]) for i in ids]
        assert proc.text == want
        first = next(n for n, s in enumerate(steps) if s.stop_string)
        assert all(s == ("", "STOP HERE") for s in steps[first + 1:])  # later calls: no text
        assert len(steps) - first > 3
        # Nothing after "42." is emitted before the stop is certain (" STOP" is held back).
        emitted = ""
        for s in steps:
            emitted += s.text
            assert want.startswith(emitted)


def test_output_processor_finish_and_stop_tokens(tok: Any) -> None:
    ids = tok.encode("Sure thing 🎉")
    eos = tok.eos_token_id
    for skip in (True, False):
        sp = SamplingParams(skip_special_tokens=skip)
        proc = OutputProcessor(tok, [1], sp)
        for i in ids[:-1]:
            proc.add([i])
        last = proc.add([ids[-1], eos], finished=True, stopped_on_token=True)
        assert last.stop_string is None
        assert proc.text == "Sure thing 🎉"
    proc = OutputProcessor(tok, [1], SamplingParams(skip_special_tokens=False,
                                                    include_stop_str_in_output=True))
    proc.add(ids + [eos], finished=True, stopped_on_token=True)
    assert proc.text == "Sure thing 🎉</s>"
    # A held stop-string prefix is released at the end; an incomplete character becomes U+FFFD.
    proc = OutputProcessor(tok, [1], SamplingParams(stop=[" thing!"]))
    assert proc.add(tok.encode("Sure thing")).text == "Sure"
    assert proc.add(tok.encode(" 🎉"), finished=True).text == " thing 🎉"
    emoji = tok.encode("🎉")
    assert len(emoji) > 1
    proc = OutputProcessor(tok, [1], SamplingParams())
    assert proc.add(emoji[:1]).text == ""
    assert proc.add([], finished=True).text == "\ufffd"
    # A stop string that only appears once the held-back character is flushed still stops.
    proc = OutputProcessor(tok, [1], SamplingParams(stop=["\ufffd"]))
    assert proc.add(tok.encode("ok") + emoji[:1], finished=True) == ("ok", "\ufffd")


# -- chat template -----------------------------------------------------------------------------
def test_chat_template(tok: Any) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = apply_chat_template(tok, msgs)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 👋</s>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [1, 4] and ids.count(1) == 1
    assert tok.decode(ids) == text
    assert not apply_chat_template(tok, msgs, add_generation_prompt=False).endswith(
        "<|assistant|>\n")
    with pytest.raises(ValueError, match="roles must be"):
        apply_chat_template(tok, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="content"):
        apply_chat_template(tok, [{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="empty"):
        apply_chat_template(tok, [])


def test_chat_template_missing(demo_model_dir: str, tmp_path: Any) -> None:
    d = tmp_path / "no-template"
    d.mkdir()
    shutil.copy(os.path.join(demo_model_dir, "tokenizer.json"), d)
    with open(os.path.join(demo_model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain = load_tokenizer(str(d))
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(plain, [{"role": "user", "content": "hi"}])
    # --chat-template supplies one: a file, or the template itself; garbage is refused.
    tmpl = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert apply_chat_template(plain, [{"role": "user", "content": "hi"}],
                               chat_template=tmpl) == "[user] hi\n"
    (tmp_path / "t.jinja").write_text(tmpl)
    assert read_chat_template(str(tmp_path / "t.jinja")) == tmpl == read_chat_template(tmpl)
    with pytest.raises(ValueError, match="neither a file nor"):
        read_chat_template(str(tmp_path / "missing.jinja"))

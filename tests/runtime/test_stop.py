"""StopChecker: incremental text, stop strings over token boundaries, split UTF-8, stop reasons.

Most tests use a toy tokenizer whose tokens are explicit byte strings, so each test states exactly
where the token boundaries fall; the property test uses the demo byte-level BPE tokenizer.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tgraph.runtime.demo_tokenizer import build_demo_tokenizer
from tgraph.runtime.sampling_params import SamplingParams
from tgraph.runtime.stop import StopChecker

EOS = 0


class ByteTokenizer:
    """Token id -> bytes; decode joins the bytes and replaces invalid UTF-8 like HF does.

    ``strip_leading_space`` mimics SentencePiece, whose decode drops the space of a first token.
    """

    def __init__(self, pieces: list[bytes], strip_leading_space: bool = False) -> None:
        self.pieces = [b"<eos>"] + pieces
        self.eos_token_id = EOS
        self.strip_leading_space = strip_leading_space

    def ids(self, *pieces: bytes | str) -> list[int]:
        return [self.pieces.index(p.encode() if isinstance(p, str) else p) for p in pieces]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == EOS))
        text = data.decode("utf-8", errors="replace")
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text


EMOJI = "😀".encode()  # 4 bytes
PIECES = [b"Hello", b" Obs", b"erv", b"ation", b":", b" world", b"cure", b"abcSTOPdef",
          b"!", EMOJI[:2], EMOJI[2:3], EMOJI[3:], "é".encode()[:1], "é".encode()[1:], b" again",
          b"END"]


def _run(checker: StopChecker, ids: list[int]) -> list[str]:
    texts = []
    for i in ids:
        step = checker.step(i)
        texts.append(step.text)
        if step.finished:
            break
    return texts


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer(PIECES)


def test_stop_string_spanning_several_tokens(tok):
    checker = StopChecker(tok, SamplingParams(stop=["Observation:"], max_tokens=50))
    texts = _run(checker, tok.ids("Hello", " Obs", "erv", "ation", ":", " world"))
    # "Obs" is held back from the moment it could start the stop string.
    assert texts == ["Hello", " ", "", "", ""]
    assert checker.finished and checker.finish_reason == "stop"
    assert checker.stop_reason == "Observation:"
    assert checker.text == "Hello "


def test_held_text_is_released_when_the_stop_string_does_not_complete(tok):
    checker = StopChecker(tok, SamplingParams(stop=["Observation:"], max_tokens=50))
    texts = _run(checker, tok.ids("Hello", " Obs", "cure", "!"))
    assert texts == ["Hello", " ", "Obscure", "!"]
    assert not checker.finished


def test_stop_string_inside_one_token_and_earliest_match_wins(tok):
    checker = StopChecker(tok, SamplingParams(stop=["def", "STOP"], max_tokens=50))
    step = checker.step(tok.ids("abcSTOPdef")[0])
    assert step.finished and step.text == "abc" and step.stop_reason == "STOP"


def test_utf8_split_across_tokens(tok):
    checker = StopChecker(tok, SamplingParams(max_tokens=50))
    ids = tok.ids("Hello", EMOJI[:2], EMOJI[2:3], EMOJI[3:], "é".encode()[:1], "é".encode()[1:])
    texts = _run(checker, ids)
    assert texts == ["Hello", "", "", "😀", "", "é"]
    assert "\ufffd" not in "".join(texts)


def test_incomplete_utf8_is_flushed_at_the_end(tok):
    checker = StopChecker(tok, SamplingParams(max_tokens=2))
    texts = _run(checker, tok.ids("Hello", EMOJI[:2]))
    assert texts == ["Hello", "\ufffd"]
    assert checker.finish_reason == "length"


def test_eos_and_ignore_eos(tok):
    checker = StopChecker(tok, SamplingParams(max_tokens=50))
    texts = _run(checker, tok.ids("Hello") + [EOS] + tok.ids("!"))
    assert texts == ["Hello", ""]
    assert checker.finish_reason == "stop" and checker.stop_reason is None
    assert checker.num_tokens == 2

    checker = StopChecker(tok, SamplingParams(max_tokens=50, ignore_eos=True))
    texts = _run(checker, tok.ids("Hello") + [EOS] + tok.ids("!"))
    assert texts == ["Hello", "", "!"]
    assert not checker.finished


def test_stop_token_ids(tok):
    end = tok.ids("END")[0]
    checker = StopChecker(tok, SamplingParams(stop_token_ids=[end], max_tokens=50))
    texts = _run(checker, tok.ids("Hello", "END", "!"))
    assert texts == ["Hello", ""]
    assert checker.finish_reason == "stop" and checker.stop_reason == end
    assert checker.text == "Hello"


def test_max_tokens_flushes_held_stop_prefix(tok):
    checker = StopChecker(tok, SamplingParams(stop=["Observation:"], max_tokens=2))
    step1 = checker.step(tok.ids("Hello")[0])
    step2 = checker.step(tok.ids(" Obs")[0])
    assert (step1.text, step1.finished) == ("Hello", False)
    assert (step2.text, step2.finished, step2.finish_reason) == (" Obs", True, "length")
    assert checker.text == "Hello Obs"
    with pytest.raises(ValueError, match="finished"):
        checker.step(1)


def test_stop_string_completed_on_the_last_allowed_token_is_a_stop(tok):
    checker = StopChecker(tok, SamplingParams(stop=["!"], max_tokens=2))
    texts = _run(checker, tok.ids("Hello", "!"))
    assert texts == ["Hello", ""]
    assert checker.finish_reason == "stop"


def test_prompt_context_keeps_leading_space(tok):
    sp = ByteTokenizer(PIECES, strip_leading_space=True)
    ids = sp.ids(" world", " again")
    # With the prompt's tail as context the first output token keeps its leading space ...
    with_prompt = StopChecker(sp, SamplingParams(), prompt_token_ids=sp.ids("Hello"))
    assert "".join(_run(with_prompt, ids)) == " world again"
    # ... and without it the text equals decoding the output ids on their own.
    alone = StopChecker(sp, SamplingParams())
    assert "".join(_run(alone, ids)) == sp.decode(ids) == "world again"


def test_rejects_bad_arguments(tok):
    with pytest.raises(TypeError, match="SamplingParams"):
        StopChecker(tok, {"stop": ["x"]})
    with pytest.raises(TypeError, match="decode"):
        StopChecker(object(), SamplingParams())


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    return build_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(["a", "b", " c", "é", "€", "😀", ":", "!", "\n"])
                    | st.text(max_size=4), max_size=12).map("".join),
       stop=st.sampled_from(["", "!", "b c", "😀:", "é€"]))
@example(text="ab c!", stop="b c")
@example(text="x😀:y", stop="😀:")
@example(text="né€", stop="é€")
def test_incremental_text_equals_decoded_text(demo_tok, text, stop):
    ids = demo_tok.encode(text, add_special_tokens=False)
    # max_tokens ends the stream on its last token, which flushes any held text.
    params = SamplingParams(max_tokens=max(len(ids), 1), stop=[stop] if stop else [])
    checker = StopChecker(demo_tok, params)
    pieces = _run(checker, ids)
    expected = text.split(stop)[0] if stop else text
    assert "".join(pieces) == checker.text == expected
    if ids:
        assert checker.finish_reason == ("stop" if stop and stop in text else "length")

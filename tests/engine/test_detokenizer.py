"""Incremental detokenization with a byte-level BPE: multi-byte characters and stop strings."""

from __future__ import annotations

from engine.detokenizer import TextStream, partial_stop_len
from tests.models import build_tokenizer

TEXT = "Streaming 🚀🔥 emoji, 中文文本测试 and 日本語 mixed 👍🏽 with ASCII."


def stream(tokenizer, ids, stops=()):
    text = TextStream(tokenizer, stops)
    deltas, hit = [], False
    for token in ids:
        delta, hit = text.add_token(token)
        deltas.append(delta)
        if hit:
            break
    if not hit:
        deltas.append(text.finish())
    return deltas, hit


def test_deltas_concatenate_to_full_decode_and_never_split_characters():
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(TEXT)
    # characters span several byte-level tokens, so some steps must emit nothing
    assert len(ids) > len(TEXT.encode()) // 4
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas


def test_every_single_byte_token_sequence_round_trips():
    tokenizer = build_tokenizer()
    # force one token per byte: worst case for multi-byte characters
    byte_tokens = [tokenizer.convert_tokens_to_ids(tokenizer.backend_tokenizer.pre_tokenizer
                                                    .pre_tokenize_str(ch)[0][0]) for ch in "a"]
    assert byte_tokens
    ids = []
    for piece in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🚀中"):
        ids.extend(tokenizer.convert_tokens_to_ids(list(piece[0])))
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == "🚀中"
    assert deltas.count("") >= 5  # 4 + 3 bytes, two characters


def test_stop_string_is_never_streamed_and_not_returned():
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    deltas, hit = stream(tokenizer, ids, stops=("fox jumps",))
    assert hit
    assert "".join(deltas) == "The quick brown "
    sent = ""
    for d in deltas:
        sent += d
        assert "fox" not in sent


def test_partial_stop_suffix_is_held_back():
    assert partial_stop_len("hello wor", ("world",)) == 3
    assert partial_stop_len("hello", ("world",)) == 0
    assert partial_stop_len("ab", ("b", "abc")) == 2


def test_unfinished_character_at_the_end_is_flushed_like_decode():
    tokenizer = build_tokenizer()
    ids = []
    for piece in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ok🚀"):
        ids.extend(tokenizer.convert_tokens_to_ids(list(piece[0])))
    ids = ids[:-1]  # cut the rocket's last byte
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) and deltas[-1].startswith("\ufffd")


def test_include_stop_str_in_output_keeps_the_stop_string():
    tokenizer = build_tokenizer()
    text = TextStream(tokenizer, ("fox jumps",), include_stop=True)
    out = ""
    for token in tokenizer.encode("The quick brown fox jumps over the lazy dog."):
        delta, hit = text.add_token(token)
        out += delta
        if hit:
            break
    assert hit and out == "The quick brown fox jumps"


def test_a_stop_string_within_min_tokens_does_not_stop():
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("the cat and the dog")
    first_the = len(tokenizer.encode("the"))
    deltas, hit = [], False
    text = TextStream(tokenizer, ("the",), min_tokens=first_the)
    for token in ids:
        delta, hit = text.add_token(token)
        deltas.append(delta)
        if hit:
            break
    assert hit and "".join(deltas) == "the cat and "  # the first "the" was inside min_tokens


def test_special_tokens_are_kept_when_not_skipped():
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    kept = TextStream(tokenizer, (), skip_special_tokens=False)
    skipped = TextStream(tokenizer, ())
    assert "".join(kept.add_token(t)[0] for t in ids) + kept.finish() == "hi<|im_end|>"
    assert "".join(skipped.add_token(t)[0] for t in ids) + skipped.finish() == "hi"

"""Incremental detokenization and stop strings: token ids in, safe-to-send text out.

Text is emitted only once it is final: a token that ends inside a multi-byte UTF-8
character yields nothing until the character completes (tokenizers' DecodeStream does the
byte bookkeeping), and text that might be the start of a stop string is held back until
it is known not to be one. So the concatenation of emitted deltas is the final text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from engine.types import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # only for tokenizers without a fast backend
        self._text = ""

    def step(self, token_id: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta


def find_stop(text: str, stops: tuple[str, ...], search_from: int, min_end: int = 0) -> tuple[int, str] | None:
    """(start, stop) of the earliest stop string in text[search_from:] that ends after `min_end`, if any."""
    hits = [(i, stop) for stop in stops if (i := text.find(stop, max(search_from, min_end - len(stop) + 1))) != -1]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextStream:
    """Accumulates a request's output text and releases what is safe to send.

    A stop string counts only once it ends after the text of the first `min_tokens` tokens;
    it is cut from the text unless `include_stop`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], *, min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.stops = stops
        self.max_stop_len = max((len(s) for s in stops), default=0)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.stops_from = 0  # a stop string must end after this offset (the text of the first min_tokens)
        self.text = ""
        self.num_sent = 0

    @classmethod
    def for_params(cls, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> TextStream:
        return cls(tokenizer, params.stop, min_tokens=params.min_tokens,
                   include_stop=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens)

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Returns (text to send now, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        self.text += self.detokenizer.step(token_id)
        if not self.stops:
            return self.flush(), False
        if len(self.token_ids) <= self.min_tokens:
            self.stops_from = len(self.text)
        hit = find_stop(self.text, self.stops, max(0, self.num_sent - self.max_stop_len), self.stops_from)
        if hit is not None:
            start, stop = hit
            self.text = self.text[:start + len(stop) if self.include_stop else start]
            return self.flush(), True
        safe_end = len(self.text) - partial_stop_len(self.text, self.stops)
        delta = self.text[self.num_sent : safe_end]
        self.num_sent = max(self.num_sent, safe_end)
        return delta, False

    def finish(self, last_token_id: int | None = None) -> str:
        """The rest of the text at the end of generation (with `last_token_id`'s text, when given),
        including bytes that never formed a whole character (decoded as U+FFFD, exactly as
        `tokenizer.decode` does)."""
        if last_token_id is not None:
            self.token_ids.append(last_token_id)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.startswith(self.text):
            self.text = full
        return self.flush()

    def flush(self) -> str:
        delta = self.text[self.num_sent :]
        self.num_sent = len(self.text)
        return delta

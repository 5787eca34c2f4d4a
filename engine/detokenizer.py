"""Incremental detokenization and stop strings: token ids in, safe-to-send text out.

Text is emitted only once it is final: a token that ends inside a multi-byte UTF-8
character yields nothing until the character completes (tokenizers' DecodeStream does the
byte bookkeeping), and text that might be the start of a stop string is held back until
it is known not to be one. So the concatenation of emitted deltas is the final text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []  # only for tokenizers without a fast backend
        self._text = ""

    def step(self, token_id: int) -> str:
        if self._backend is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts in text[search_from:], if any."""
    hits = [i for stop in stops if (i := text.find(stop, search_from)) != -1]
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
    """Accumulates a request's output text and releases what is safe to send."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.stops = stops
        self.max_stop_len = max((len(s) for s in stops), default=0)
        self.text = ""
        self.num_sent = 0

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Returns (text to send now, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        self.text += self.detokenizer.step(token_id)
        if not self.stops:
            return self.flush(), False
        stop_at = find_stop(self.text, self.stops, max(0, self.num_sent - self.max_stop_len))
        if stop_at is not None:
            self.text = self.text[:stop_at]
            return self.flush(), True
        safe_end = len(self.text) - partial_stop_len(self.text, self.stops)
        delta = self.text[self.num_sent : safe_end]
        self.num_sent = max(self.num_sent, safe_end)
        return delta, False

    def finish(self) -> str:
        """The rest of the text at the end of generation, including bytes that never formed a
        whole character (decoded as U+FFFD, exactly as `tokenizer.decode` does)."""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if full.startswith(self.text):
            self.text = full
        return self.flush()

    def flush(self) -> str:
        delta = self.text[self.num_sent :]
        self.num_sent = len(self.text)
        return delta

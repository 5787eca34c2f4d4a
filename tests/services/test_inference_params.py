"""services.sampling without a server: a request's sampling options -> SamplingParams."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.errors import InvalidRequestError
from services.sampling import SamplingOptions, sampling_params

MODEL = SimpleNamespace(max_model_len=100, vocab_size=50, sampling_defaults={})


def params(max_tokens=None, prompt_len=10, cap=None, default=None, options=None, **kw):
    return sampling_params(options or SamplingOptions(), max_tokens, prompt_len, MODEL, None, cap=cap,
                           default_max_tokens=default, **kw)


def test_max_tokens_as_asked_else_the_default_else_the_rest_of_the_context():
    assert params(max_tokens=7).max_tokens == 7
    assert params(default=16).max_tokens == 16
    assert params().max_tokens == 90


def test_the_cap_bounds_defaults_and_refuses_more():
    assert params(cap=5, default=16).max_tokens == 5
    assert params(cap=20).max_tokens == 20
    with pytest.raises(InvalidRequestError, match="over this API key's cap of 5") as exc:
        params(max_tokens=6, cap=5)
    assert exc.value.param == "max_tokens"


def test_a_prompt_past_the_context_names_its_field():
    with pytest.raises(InvalidRequestError, match="maximum context length is 100") as exc:
        params(max_tokens=91, prompt_param="messages")
    assert (exc.value.param, exc.value.code) == ("messages", "context_length_exceeded")
    with pytest.raises(InvalidRequestError):
        params(prompt_len=100)


def test_options_pass_through_and_stop_token_ids_are_checked():
    got = params(options=SamplingOptions(temperature=0.5, seed=3, stop=("x",), stop_token_ids=(1, 2)))
    assert (got.temperature, got.seed, got.stop, got.stop_token_ids) == (0.5, 3, ("x",), frozenset({1, 2}))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        params(options=SamplingOptions(stop_token_ids=(50,)))

"""The packed BERT-family forward against transformers' own padded forward, on tiny random
models of each supported family, for embeddings (every pooling) and classification."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaModel,
)

from engine.encoders import POOLING_MODES, Encoder, pool
from engine.models.bert import PackedBatch, supports_packed
from tests.encoder_models import build_wordpiece

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=160, initializer_range=0.2)
FAMILIES = {
    "bert": (BertConfig, BertModel, BertForSequenceClassification, {}),
    "roberta": (RobertaConfig, RobertaModel, RobertaForSequenceClassification, {"pad_token_id": 1}),
    "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel, None, {"pad_token_id": 1, "hidden_act": "gelu_new"}),
}


def save_model(out, family: str, kind: str):
    config_cls, base_cls, clf_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    tokenizer = build_wordpiece()
    config = config_cls(vocab_size=len(tokenizer), num_labels=3, **SHAPE, **extra)
    (base_cls if kind == "embed" else clf_cls)(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def mixed_inputs(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id inputs of very different lengths (1 to 150), some holding the pad id mid-sequence."""
    rng = random.Random(seed)
    inputs = [[rng.randrange(2, vocab_size) for _ in range(n)] for n in (1, 3, 17, 150, 40, 2, 90, 9)]
    inputs[2][5] = inputs[4][0] = 1  # RoBERTa's pad id: its position must follow HF's rule
    return inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_embeddings_equal_the_padded_hf_forward_for_every_pooling(tmp_path, family):
    encoder = Encoder(save_model(tmp_path, family, "embed"), "embed")
    assert encoder.packed is not None
    ids = mixed_inputs(encoder.config.vocab_size)
    assert len(PackedBatch.of([len(x) for x in ids], torch.device("cpu")).groups) > 1  # attention by length
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [encoder.pad_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    with torch.inference_mode():
        hidden = encoder.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    for mode in POOLING_MODES:
        encoder.sentence = encoder.sentence.__class__(pooling=mode)
        reference = pool(hidden, mask, mode)
        packed = torch.tensor(encoder.forward_packed(ids))
        assert (packed - reference).abs().max() < 1e-5, mode
    run = torch.tensor([out.values for out in encoder.run(ids)])
    assert (run - reference).abs().max() < 1e-5
    near = ids[1:2] * 2 + ids[5:6]  # lengths 3, 3, 2: one attention group
    assert len(PackedBatch.of([len(x) for x in near], torch.device("cpu")).groups) == 1
    assert (torch.tensor(encoder.forward_packed(near)) - reference[[1, 1, 5]]).abs().max() < 1e-5
    same = ids[2:3] * 3  # equal lengths: attention runs on the packed rows themselves, no padded layout
    assert PackedBatch.of([len(x) for x in same], torch.device("cpu")).groups[0].slots is None
    assert (torch.tensor(encoder.forward_packed(same)) - reference[[2, 2, 2]]).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_packed_classifier_logits_equal_hf(tmp_path, family):
    encoder = Encoder(save_model(tmp_path, family, "classify"), "classify")
    assert encoder.packed is not None
    ids = mixed_inputs(encoder.config.vocab_size, seed=1)
    with torch.inference_mode():
        reference = torch.cat([encoder.model(input_ids=torch.tensor([x])).logits for x in ids])
    assert (torch.tensor(encoder.forward_packed(ids)) - reference).abs().max() < 1e-5
    assert (torch.tensor([o.values for o in encoder.run(ids)]) - reference).abs().max() < 1e-5


def test_other_families_and_activations_take_the_padded_path():
    assert supports_packed(BertConfig())
    assert not supports_packed(BertConfig(hidden_act="relu"))
    assert not supports_packed(BertConfig(position_embedding_type="relative_key"))
    assert not supports_packed(BertConfig(is_decoder=True))

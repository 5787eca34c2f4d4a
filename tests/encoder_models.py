"""Tiny random-weight BERT encoders (a classifier, an embedder) with a WordPiece tokenizer trained here (no hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    PreTrainedTokenizerFast,
)

from tests.models import CORPUS

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_wordpiece(vocab_size: int = 300, tokenizer_class: type = PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS * 20, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.decoder = decoders.WordPiece()
    return tokenizer_class(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=128)


def save_tiny_classifier(out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tokenizer = build_wordpiece()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=len(LABELS),
                        id2label=LABELS, label2id={v: k for k, v in LABELS.items()}, initializer_range=0.2)
    BertForSequenceClassification(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_embedder(out: Path, seed: int = 0) -> Path:
    """A tiny random BERT as a plain embedding folder (mean pooling, no normalisation)."""
    torch.manual_seed(seed)
    tokenizer = build_wordpiece()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, initializer_range=0.2)
    BertModel(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_cross_encoder(out: Path, seed: int = 0) -> Path:
    """A tiny random BERT cross-encoder: one relevance logit for a (query, document) pair, read as two
    segments (token type ids 0 and 1, which BERT's tokenizer class returns), as sentence-transformers'
    CrossEncoder folders are."""
    torch.manual_seed(seed)
    tokenizer = build_wordpiece(tokenizer_class=BertTokenizerFast)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1, initializer_range=0.2,
                        type_vocab_size=2)
    BertForSequenceClassification(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

"""Encoder models (embeddings, classifiers) as a service: scores from a classifier's logits and
the prediction a client sees.
"""

from __future__ import annotations

import math

from scheduling.encoders import ServedEncoder


def scores_from_logits(logits: list[float], function: str) -> list[float]:
    if function == "sigmoid":
        return [1 / (1 + math.exp(-x)) for x in logits]
    if function == "softmax":
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        return [e / total for e in exps]
    return list(logits)


def prediction(model: ServedEncoder, logits: list[float], function_to_apply: str | None = None,
               top_k: int | None = None) -> dict:
    """The best label, its confidence and the labels' scores (the `top_k` best when given);
    scores by `function_to_apply`, else softmax (sigmoid for a multi-label model)."""
    function = function_to_apply or ("sigmoid" if model.multi_label else "softmax")
    scores = scores_from_logits(logits, function)
    ranked = sorted(zip(model.labels, scores), key=lambda pair: -pair[1])
    if top_k is not None:
        ranked = ranked[:top_k]
    return {"prediction": ranked[0][0], "confidence": ranked[0][1], "scores": dict(ranked)}

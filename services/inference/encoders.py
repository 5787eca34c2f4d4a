"""Encoder models (embeddings, classifiers) as a service: inputs checked, answered from the
response cache where they can be, the rest from the model version's dynamic batcher in one
admitted submit (tenant limits apply as for generations: tokens estimated, then settled), and
mirrored to the model's shadow version once answered.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.types import TENSOR_DATATYPES
from scheduling.encoders import ServedEncoder
from services.admission import Admission
from services.cache.response_cache import ResponseCache
from services.deployments.shadow import ShadowMirror
from services.errors import InvalidRequestError
from services.inference.images import decode_images
from services.inference.tensors import to_json_data
from services.observability.metrics import Metrics
from services.tenancy import Caller


class Encoders:
    def __init__(self, cache: ResponseCache, admission: Admission, shadow: ShadowMirror, metrics: Metrics) -> None:
        self.cache = cache
        self.admission = admission
        self.shadow = shadow
        self.metrics = metrics

    async def embed(self, caller: Caller, model: ServedEncoder, items: list[str | list[int]],
                    use_cache: bool | None, dimensions: int | None = None) -> list[Any]:
        """One embedding per item (strings, or token ids checked against the model)."""
        if dimensions is not None and dimensions != model.dimensions:
            raise InvalidRequestError(f"`{model.name}` makes {model.dimensions}-dimensional embeddings; "
                                      f"dimensions={dimensions} is not supported", param="dimensions")
        check_token_ids(model, items)
        return await self.run(caller, model, items, use_cache)

    async def classify(self, caller: Caller, model: ServedEncoder, texts: list[str], use_cache: bool | None,
                       function_to_apply: str | None = None, top_k: int | None = None) -> list[Any]:
        """One prediction (`prediction`, `confidence`, `scores`) per text."""
        outputs = await self.run(caller, model, texts, use_cache)
        return [prediction(model, out.values, function_to_apply, top_k) for out in outputs]

    async def predict(self, caller: Caller, model: ServedEncoder, items: list[str | list[float]],
                      use_cache: bool | None, function_to_apply: str | None = None,
                      top_k: int | None = None) -> list[dict]:
        """One prediction (`prediction`, `confidence`, `scores`) per input: texts through a classifier, rows of
        features through a tabular model (its class label and probabilities, or a regressor's value)."""
        if model.kind == "classify":
            if not all(isinstance(item, str) for item in items):
                raise InvalidRequestError(f"`{model.name}` is a text classifier: its inputs are texts", param="inputs")
            return await self.classify(caller, model, items, use_cache, function_to_apply, top_k)
        if model.kind == "image-classify":
            if not all(isinstance(item, dict) and "image" in item for item in items):
                raise InvalidRequestError(f"`{model.name}` classifies images: its inputs are {{\"image\": base64}}",
                                          param="inputs")
            return await self.classify_images(caller, model, [item["image"] for item in items], function_to_apply,
                                              top_k)
        if model.kind != "tabular" or not all(isinstance(item, list) for item in items):
            raise InvalidRequestError(f"`{model.name}` is a `{model.kind}` model: predict takes texts for a classifier "
                                      "or `features` for a tabular model (tensor models: /v2/models/{name}/infer)",
                                      param="inputs")
        out = await self.infer(caller, model, features_request(model, items))
        return tabular_predictions(model, out, top_k)

    async def classify_images(self, caller: Caller, model: ServedEncoder, images: list[str | bytes],
                              function_to_apply: str | None = None, top_k: int | None = None) -> list[dict]:
        """One prediction per image (base64, a data: URL, or raw bytes), decoded off the event loop."""
        decoded = await decode_images(images, "inputs")
        limits, _ = caller.limits()
        outputs = await self.admission.encode(model, decoded, limits)
        return [prediction(model, out.values, function_to_apply, top_k) for out in outputs]

    async def score(self, caller: Caller, model: ServedEncoder, pairs: list[tuple[str, str]],
                    use_cache: bool | None) -> tuple[list[float], int]:
        """The relevance of each (query, document) pair, and the tokens read. A cross-encoder (a classify
        model with one label) reads each pair as one input, and its activation makes the score, as
        sentence-transformers' `CrossEncoder.predict` computes it; an embed model scores by the cosine of
        the two texts' embeddings, as vLLM does."""
        if model.kind == "classify":
            if len(model.labels) != 1:
                raise InvalidRequestError(f"`{model.name}` is a classifier of {len(model.labels)} labels; scoring "
                                          "needs a cross-encoder (one label) or an embedding model", param="model",
                                          code="not_a_cross_encoder")
            outputs = await self.run(caller, model, list(pairs), use_cache)
            function = "sigmoid" if model.score_activation == "sigmoid" else "none"
            return [scores_from_logits(out.values, function)[0] for out in outputs], sum(o.num_tokens for o in outputs)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each text embedded once
        outputs = dict(zip(texts, await self.run(caller, model, texts, use_cache)))
        scores = [cosine(outputs[a].values, outputs[b].values) for a, b in pairs]
        return scores, sum(out.num_tokens for out in outputs.values())

    async def infer(self, caller: Caller, model: ServedEncoder,
                    tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A tensor model's (onnx, tabular) outputs for one request's named input arrays, checked against its
        declared inputs first; the request shares a batch with others where the model batches."""
        check_tensors(model, tensors)
        limits, _ = caller.limits()
        [outputs] = await self.admission.encode(model, [tensors], limits)
        return outputs

    async def run(self, caller: Caller, model: ServedEncoder, items: list[str | list[int]],
                  use_cache: bool | None) -> list[Any]:
        """One output (`.values`, `.num_tokens`) per item: cached ones at once, the rest in one
        batcher submit. `use_cache` False: the caller opted out (None: it did not say). The
        lookup's outcome is noted before the model runs (so the X-Cache header is there even when
        the model then fails)."""
        if not self.cache.wants(use_cache):
            return await self._compute(caller, model, items, [None] * len(items), [])
        keys = [self.cache.key(caller, model, item, {}) for item in items]
        outputs = self.cache.lookup_many(caller, model.name, keys)
        hit = all(out is not None for out in outputs)
        if hit:
            self.metrics.encoder_requests.labels(model.name, model.kind, "cached").inc()
            return outputs
        return await self._compute(caller, model, items, outputs, keys)

    async def _compute(self, caller: Caller, model: ServedEncoder, items: list[str | list[int]],
                       outputs: list[Any], keys: list[str]) -> list[Any]:
        """Fill the missing `outputs` from the model (remembering each under its key, if any),
        then mirror the request to the shadow version."""
        missing = [i for i, out in enumerate(outputs) if out is None]
        limits, _ = caller.limits()
        computed = await self.admission.encode(model, [items[i] for i in missing], limits)
        for i, out in zip(missing, computed):
            outputs[i] = out
            if keys:
                self.cache.remember(keys[i], out)
        self.shadow.mirror_inputs(model, caller.request_id, items, outputs, self.metrics.log_prompts)
        return outputs


def check_token_ids(model: ServedEncoder, items: list[str | list[int]]) -> None:
    for item in items:
        if isinstance(item, list):
            if any(t >= model.vocab_size for t in item):
                raise InvalidRequestError(f"token ids must be in [0, {model.vocab_size})", param="input")
            if len(item) > model.max_seq_len:
                raise InvalidRequestError(f"a token id input has {len(item)} tokens; this model takes at most "
                                          f"{model.max_seq_len}", param="input", code="context_length_exceeded")




def check_tensors(model: ServedEncoder, tensors: dict[str, np.ndarray]) -> None:
    """400 naming the tensor unless `tensors` are exactly the model's inputs, each of its datatype, its rank,
    its fixed dimensions, and (where the first dimension is free) all with the same number of rows."""
    names = {spec["name"] for spec in model.inputs}
    if unknown := sorted(set(tensors) - names):
        raise InvalidRequestError(f"`{model.name}` has no input {unknown[0]!r}; its inputs: {', '.join(sorted(names))}",
                                  param="inputs")
    rows = set()
    for spec in model.inputs:
        name, shape = spec["name"], spec["shape"]
        if name not in tensors:
            raise InvalidRequestError(f"input {name!r} is missing", param="inputs")
        array = tensors[name]
        if array.dtype != TENSOR_DATATYPES[spec["datatype"]]:
            raise InvalidRequestError(f"input {name!r} must be {spec['datatype']}", param="inputs")
        if array.ndim != len(shape) or any(want not in (-1, got) for want, got in zip(shape, array.shape)):
            raise InvalidRequestError(f"input {name!r} has shape {list(array.shape)}; `{model.name}` takes {shape} "
                                      "(-1: any size)", param="inputs")
        if shape and shape[0] == -1:
            rows.add(array.shape[0])
    if len(rows) > 1:
        raise InvalidRequestError(f"the inputs have different numbers of rows: {sorted(rows)}", param="inputs")
    if 0 in rows:
        raise InvalidRequestError("the inputs have no rows", param="inputs")


def features_request(model: ServedEncoder, rows: list[list[float]]) -> dict[str, np.ndarray]:
    """A tabular model's one request for rows of features (400 unless each has the model's count)."""
    [spec] = model.inputs
    if any(len(row) != spec["shape"][1] for row in rows):
        raise InvalidRequestError(f"`{model.name}` takes {spec['shape'][1]} features per input", param="inputs")
    return {spec["name"]: np.array(rows, dtype=TENSOR_DATATYPES[spec["datatype"]])}


def tabular_predictions(model: ServedEncoder, out: dict[str, np.ndarray], top_k: int | None = None) -> list[dict]:
    """Per row: a classifier's label, its probability and the labels' (the `top_k` best), or a regressor's value."""
    if "predict_proba" not in out:
        return [{"prediction": float(value), "confidence": None, "scores": {}} for value in out["predict"]]
    results = []
    for row in out["predict_proba"]:
        ranked = sorted(zip(model.labels, row.tolist()), key=lambda pair: -pair[1])
        results.append({"prediction": ranked[0][0], "confidence": ranked[0][1], "scores": dict(ranked[:top_k])})
    return results


def tensor_outputs(model: ServedEncoder, out: dict[str, np.ndarray]) -> list[dict]:
    """A tensor model's outputs as /v2's infer answers them in JSON: name, datatype, shape and flat data."""
    return [{"name": spec["name"], "datatype": spec["datatype"], "shape": list(out[spec["name"]].shape),
             "data": to_json_data(out[spec["name"]], spec["datatype"])} for spec in model.outputs]


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


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

"""Batch jobs over tensor models of named inputs (an ONNX graph, a torch.export program), through the real
app with auth on: each item is one /v2 infer request's `inputs`, its stored `outputs` are what infer answers
for them and what the library computes; a bad item fails alone with infer's 400 message. (Tabular jobs:
`tests/api/test_oip.py`.)"""

from __future__ import annotations

import numpy as np
import onnxruntime
import torch

from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)
from tests.api.test_oip import stack, tensor_models  # noqa: F401 (fixtures)
from tests.helpers import wait_until


def item(**arrays: np.ndarray) -> dict:
    """One request's inputs as JSON tensors (nested data, as a client would write them)."""
    return {"inputs": [{"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}
                       for name, array in arrays.items()]}


async def run_job(stack, model: str, items: list[dict]) -> list[dict]:  # noqa: F811
    status, created = await stack.client.call("POST", "/api/v1/batch", stack.key, json={"model": model,
                                                                                          "inputs": items})
    assert status == 200 and created["kind"] in ("onnx", "torch"), created

    async def results() -> list[dict] | None:
        status, found = await stack.client.call("GET", f"/api/v1/batch/{created['batch_id']}/results", stack.key)
        assert status == 200, found
        return found if found["status"] in ("completed", "failed", "cancelled") else None

    done = await wait_until(results, timeout_s=60, what=f"the {model} job to end")
    assert done["status"] == "completed", done
    return done["results"]


async def infer(stack, model: str, inputs: dict) -> tuple[int, dict]:  # noqa: F811
    return await stack.client.call("POST", f"/v2/models/{model}/infer", stack.key, json=inputs)


async def test_onnx_and_torch_jobs_equal_infer_and_the_library_and_a_bad_item_fails_alone(stack, tensor_models):  # noqa: F811
    rng = np.random.default_rng(7)
    xs = [rng.normal(size=(rows, 4)).astype(np.float32) for rows in (1, 3, 2)]
    scales = [rng.uniform(0.5, 2, size=(len(x), 1)).astype(np.float32) for x in xs]
    bad = {  # model -> items infer refuses: a wrong name, shape, datatype; data that does not fit its shape
        "onnx-tiny": [item(z=xs[0]), item(x=xs[0][:, :3]), {"inputs": [{**item(x=xs[0])["inputs"][0], "datatype":
                                                                         "FP64"}]},
                      {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3]}]}],
        "torch-tiny": [item(x=xs[1]), item(x=xs[1], scale=scales[0])],  # `scale` missing; rows differ
    }
    session = onnxruntime.InferenceSession(str(tensor_models["root"] / "tiny.onnx"))
    for model, good in (("onnx-tiny", [item(x=x) for x in xs]),
                        ("torch-tiny", [item(x=x, scale=s) for x, s in zip(xs, scales)])):
        items = [*good[:2], *bad[model], good[2]]
        results = await run_job(stack, model, items)
        assert [r["status"] for r in results] == ["completed"] * 2 + ["failed"] * len(bad[model]) + ["completed"]
        for given, result in zip(items, results):
            status, direct = await infer(stack, model, given)
            if result["status"] == "failed":  # alone, with infer's own message
                assert status == 400 and result["error"] == direct["error"] and "outputs" not in result, direct
                continue
            assert status == 200 and result["outputs"] == direct["outputs"] and result["error"] is None, result
        got = [{o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in r["outputs"]}
               for r in results if r["status"] == "completed"]
        for out, x, scale in zip(got, xs, scales):
            if model == "onnx-tiny":
                want = dict(zip(("y", "best"), session.run(None, {"x": x})))
            else:
                with torch.inference_mode():
                    y, total = tensor_models["module"](torch.from_numpy(x), torch.from_numpy(scale))
                want = {"output__0": y.numpy(), "output__1": total.numpy()}
            assert out.keys() == want.keys()
            assert all(np.allclose(out[name], want[name], atol=1e-6) for name in want), (out, want)


async def test_a_tensor_job_takes_only_tensor_inputs_and_tensor_inputs_only_tensor_models(stack):  # noqa: F811
    tensors = item(x=np.zeros((1, 4), np.float32))
    for model, inputs, why in (("onnx-tiny", ["a text"], "inputs of a `onnx` model are"),
                               ("torch-tiny", [{"features": [1.0, 2.0, 3.0, 4.0]}], "inputs of a `torch` model are"),
                               ("iris-xgb", [tensors], "inputs of a `tabular` model are"),
                               ("minilm", [tensors], "inputs of a `embed` model are"),
                               ("tiny", [tensors], "inputs of a `generate` model are"),
                               ("onnx-tiny", [{"inputs": []}], "inputs.0"),  # no tensors: a schema error
                               ("onnx-tiny", [tensors], "params")):
        body = {"model": model, "inputs": inputs, **({"params": {"max_tokens": 3}} if why == "params" else {})}
        status, error = await stack.client.call("POST", "/api/v1/batch", stack.key, json=body)
        assert status == 400 and why in error["error"]["message"] + str(error["error"]["param"]), (model, error)
    status, jobs = await stack.client.call("GET", "/api/v1/batch", stack.key)
    assert status == 200 and jobs["data"] == []  # nothing stored

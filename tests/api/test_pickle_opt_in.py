"""Pickled scikit-learn models (issue 36): refused unless an admin sets `allow_pickle`, and then loaded
through the restricted unpickler (`engine/unpickle.py`), which builds scikit-learn classes and numpy
arrays and nothing else. Served predictions equal the estimator's own; hostile files never run."""

from __future__ import annotations

import io
import os
import pickle

import joblib
import numpy as np
import pytest
from sklearn.datasets import load_iris
from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from engine.loader import ModelLoadError
from engine.predictors import load_predictor, predictor_path
from engine.unpickle import restricted_load
from tests.api.test_auth import assert_error
from tests.api.test_deployments import make_stack  # noqa: F401 (fixture)


class Payload:
    """What a hostile file holds: unpickling it calls `os.system` (or whatever `__reduce__` names)."""

    def __init__(self, call, *args) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.fixture(scope="module")
def iris():
    x, y = load_iris(return_X_y=True)
    names = np.array(["setosa", "versicolor", "virginica"])[y]
    return x, names


@pytest.mark.parametrize("estimator", [
    make_pipeline(StandardScaler(), LogisticRegression(max_iter=300)),
    RandomForestClassifier(n_estimators=4, random_state=0),
    HistGradientBoostingClassifier(max_iter=4),  # Cython types rebuilt through __pyx_unpickle_*
], ids=["pipeline", "forest", "hist-gbm"])
@pytest.mark.parametrize("suffix", [".pkl", ".joblib", ".joblib-zlib"])
def test_pickled_estimators_load_only_with_the_opt_in_and_predict_as_themselves(tmp_path, iris, estimator, suffix):
    x, names = iris
    model = estimator.fit(x, names)
    path = tmp_path / f"model{suffix.split('-')[0]}"
    if suffix == ".pkl":
        path.write_bytes(pickle.dumps(model))
    else:
        joblib.dump(model, path, compress=3 if suffix.endswith("zlib") else 0)
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        predictor_path(str(path))
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        load_predictor(path, "tabular")
    predictor = load_predictor(predictor_path(str(path), allow_pickle=True), "tabular", allow_pickle=True)
    [out] = predictor.run([{"input": x[::10]}])
    assert np.allclose(out["predict_proba"], model.predict_proba(x[::10]))
    assert [predictor.labels[i] for i in out["predict"]] == list(model.predict(x[::10]))


@pytest.mark.parametrize("payload, named", [
    (Payload(os.system, "touch {marker}"), "posix.system"),
    (Payload(eval, "open({marker!r}, 'w')"), "builtins.eval"),
    (Payload(getattr, LogisticRegression, "fit"), "builtins.getattr"),  # a trusted class, an untrusted call
    (make_pipeline(FunctionTransformer(os.system)), "posix.system"),  # a function inside a trusted class
    (Payload(np.save, "{marker}", np.zeros(1)), "numpy.save"),  # a numpy function, not an array rebuilder
], ids=["system", "eval", "getattr", "function-in-estimator", "numpy-function"])
@pytest.mark.parametrize("suffix", [".pkl", ".joblib"])
def test_a_hostile_pickle_is_refused_naming_the_global_and_nothing_runs(tmp_path, payload, named, suffix):
    marker = tmp_path / "ran"
    if isinstance(payload, Payload):
        payload.args = tuple(a.format(marker=str(marker)) if isinstance(a, str) else a for a in payload.args)
    path = tmp_path / f"evil{suffix}"
    if suffix == ".pkl":
        path.write_bytes(pickle.dumps(payload))
    else:
        joblib.dump(payload, path)
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        restricted_load(path)
    assert not marker.exists() and not marker.with_suffix(".npy").exists()


def test_an_object_array_inside_a_joblib_file_goes_through_the_same_check(tmp_path):
    """joblib stores object arrays as a nested pickle; its inner unpickler must not escape ours."""
    marker = tmp_path / "ran"
    hostile = np.empty(1, dtype=object)
    hostile[0] = Payload(os.system, f"touch {marker}")
    joblib.dump({"weights": hostile}, tmp_path / "evil.joblib")
    with pytest.raises(ModelLoadError, match="posix.system"):
        restricted_load(tmp_path / "evil.joblib")
    assert not marker.exists()


def test_an_admin_trusts_a_type_of_its_own_by_name(tmp_path, iris):
    x, names = iris
    from tests.api.test_oip import Halve

    model = make_pipeline(Halve(), LogisticRegression(max_iter=300)).fit(x, names)
    (tmp_path / "custom.pkl").write_bytes(pickle.dumps(model))
    with pytest.raises(ModelLoadError, match="tests.api.test_oip.Halve"):
        restricted_load(tmp_path / "custom.pkl")
    loaded = restricted_load(tmp_path / "custom.pkl", ("tests.api.test_oip.Halve",))
    assert np.allclose(loaded.predict_proba(x[:5]), model.predict_proba(x[:5]))
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle at all")
    with pytest.raises(ModelLoadError, match="cannot be unpickled"):
        restricted_load(tmp_path / "junk.pkl")
    assert pickle.loads(io.BytesIO(pickle.dumps(1)).getvalue()) == 1  # the stdlib's own pickle is untouched


async def test_the_admin_api_serves_a_pickle_only_with_allow_pickle(make_stack, tmp_path, iris):  # noqa: F811
    """Through the admin API and the native predict endpoint: without the option the registration is
    refused, naming it; with it the predictions are the estimator's."""
    x, names = iris
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=300)).fit(x, names)
    joblib.dump(model, tmp_path / "iris.joblib")
    stack = await make_stack([])
    source = str(tmp_path / "iris.joblib")
    status, body = await stack.client.admin("POST", "/models", json={"name": "plain", "source": source,
                                                                     "kind": "tabular"})
    assert_error(status, body, 400, "invalid_request_error")
    assert "allow_pickle" in body["error"]["message"] and body["error"]["param"] == "source"
    status, body = await stack.client.admin("POST", "/models", json={
        "name": "opted", "source": source, "kind": "tabular", "options": {"allow_pickle": True}})
    assert status == 201, body
    assert (await stack.client.admin("POST", "/models/opted/versions/1/load"))[0] == 202
    await stack.wait_state("opted@1", "ready")
    status, body = await stack.client.call("POST", "/api/v1/models/plain/predict", stack.key,
                                           json={"inputs": [{"features": [1, 2, 3, 4]}]})
    assert status == 404, body
    status, body = await stack.client.call("POST", "/api/v1/models/opted/predict", stack.key,
                                           json={"inputs": [{"features": row} for row in x[::25].tolist()]})
    assert status == 200, body
    assert body["prediction"] == list(model.predict(x[::25]))
    assert np.allclose(body["confidence"], model.predict_proba(x[::25]).max(axis=1))
    status, body = await stack.client.admin("POST", "/models", json={
        "name": "bad", "source": source, "kind": "onnx", "options": {"allow_pickle": True}})
    assert_error(status, body, 400, "invalid_request_error")  # a tabular-only option

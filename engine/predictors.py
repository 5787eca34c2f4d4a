"""Models that map tensors to tensors: ONNX graphs (`onnx`), `torch.export` programs (`torch`) and
gradient-boosted trees (`tabular`: XGBoost `.json`/`.ubj`, LightGBM `.txt`), behind the same dynamic
batcher as the encoders.

A predictor declares its inputs and outputs (`TensorSpec`: name, Open Inference Protocol datatype,
shape with -1 for a free dimension) and runs a batch of requests, each a dict of named arrays
whose first dimension counts its rows: requests are concatenated along that dimension (where the
model's first dimension is free), run as one, and split back. `.pkl`/`.joblib` files are refused
unless an admin opted in (`allow_pickle`), and then go through `engine.unpickle`'s restricted loader.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.batcher import Batching
from engine.loader import ModelLoadError
from engine.types import TENSOR_DATATYPES

ONNX_TYPES = {"tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
              "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
              "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
              "tensor(string)": "BYTES"}
PICKLES = (".pkl", ".pickle", ".joblib")
PICKLE_REFUSAL = ("pickles load only where an admin set the model's `allow_pickle` option; better, save it in its "
                  "library's own format (skops .skops, XGBoost .json/.ubj, LightGBM .txt) or convert it to ONNX")
Tensors = dict[str, np.ndarray]


def datatype_of(array: np.ndarray) -> str:
    """The OIP datatype of a numpy array."""
    for name, dtype in TENSOR_DATATYPES.items():
        if array.dtype == dtype:
            return name
    raise ValueError(f"no Open Inference Protocol datatype for numpy {array.dtype}")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # one of TENSOR_DATATYPES
    shape: tuple[int, ...]  # -1: any size

    def as_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class Predictor(ABC):
    """Runs batches of requests (`run`); subclasses set `inputs`, `outputs`, `platform` and `predict`."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    platform: str  # as Triton names its backends in model metadata
    labels: list[str] = []  # a classifier's class labels, by index of its probabilities

    @property
    def batched(self) -> bool:
        """Whether requests can share one run: every input's first dimension is free."""
        return all(spec.shape and spec.shape[0] == -1 for spec in self.inputs)

    def example(self) -> Tensors:
        """One row of zeros of every input (a warm-up request)."""
        return {spec.name: np.zeros([1 if d == -1 else d for d in spec.shape] or [1], TENSOR_DATATYPES[spec.datatype])
                for spec in self.inputs}

    def run(self, requests: list[Tensors]) -> list[Tensors]:
        """Each request's outputs, in order: one `predict` over all of them where the model batches."""
        if not self.batched or len(requests) == 1:
            return [self.predict(request) for request in requests]
        rows = [len(next(iter(request.values()))) for request in requests]
        joined = {spec.name: np.concatenate([request[spec.name] for request in requests]) for spec in self.inputs}
        out = self.predict(joined)
        bounds = np.cumsum([0, *rows])
        return [{name: value[start:end] for name, value in out.items()} for start, end in zip(bounds, bounds[1:])]

    @abstractmethod
    def predict(self, tensors: Tensors) -> Tensors:
        """One run of the model over named input arrays: its named output arrays."""


class OnnxPredictor(Predictor):
    """An ONNX graph on onnxruntime's CPU provider (CUDA's where asked and present), one intra-op thread:
    it runs on the device's worker thread between engine steps and must not fight the decode for cores."""

    platform = "onnxruntime_onnx"

    def __init__(self, path: Path, device: str = "cpu") -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
            raise ModelLoadError(f"onnxruntime cannot load {path.name}: {exc}") from exc
        self.inputs = [self._spec(arg) for arg in self.session.get_inputs()]
        self.outputs = [self._spec(arg) for arg in self.session.get_outputs()]

    @staticmethod
    def _spec(arg) -> TensorSpec:
        if arg.type not in ONNX_TYPES:
            raise ModelLoadError(f"ONNX tensor {arg.name!r} is of type {arg.type}, which galley does not serve "
                                 "(sequences and maps: convert classifiers with zipmap=False)")
        return TensorSpec(arg.name, ONNX_TYPES[arg.type], tuple(d if isinstance(d, int) else -1 for d in arg.shape))

    def predict(self, tensors: Tensors) -> Tensors:
        values = self.session.run(None, {spec.name: tensors[spec.name] for spec in self.inputs})
        return {spec.name: np.asarray(value) for spec, value in zip(self.outputs, values)}


TORCH_TYPES = {"torch.bool": "BOOL", "torch.uint8": "UINT8", "torch.int8": "INT8", "torch.int16": "INT16",
               "torch.int32": "INT32", "torch.int64": "INT64", "torch.float16": "FP16", "torch.float32": "FP32",
               "torch.float64": "FP64"}


class TorchPredictor(Predictor):
    """A `torch.export` program (`.pt2`, read by `torch.export.load`): its inputs are its forward's
    arguments, named and shaped as the program recorded them (a dynamic dimension is -1), its outputs
    `output__0`, `output__1`, ... (Triton's PyTorch backend names them so). TorchScript and pickled
    modules are not loaded."""

    platform = "pytorch_torch_export"

    def __init__(self, path: Path, device: str = "cpu") -> None:
        import torch

        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # torch raises many types for a file that is not a program
            raise ModelLoadError(f"torch.export cannot load {path.name}: {exc}") from exc
        self.device = torch.device(device)
        self.module = program.module().to(self.device)
        names = [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
        values = {node.name: node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"}
        output = next(node for node in program.graph.nodes if node.op == "output")
        results = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        self.inputs = [self._spec(name, values.get(name)) for name in names]
        self.outputs = [self._spec(f"output__{i}", getattr(r, "meta", {}).get("val")) for i, r in enumerate(results)]

    @staticmethod
    def _spec(name: str, value) -> TensorSpec:
        if value is None or str(getattr(value, "dtype", "")) not in TORCH_TYPES:
            raise ModelLoadError(f"the program's {name!r} is not a tensor of a type galley serves")
        shape = tuple(d if isinstance(d, int) else -1 for d in value.shape)
        return TensorSpec(name, TORCH_TYPES[str(value.dtype)], shape)

    def predict(self, tensors: Tensors) -> Tensors:
        import torch

        with torch.inference_mode():
            args = [torch.from_numpy(np.ascontiguousarray(tensors[spec.name])).to(self.device) for spec in self.inputs]
            out = self.module(*args)
        out = out if isinstance(out, (list, tuple)) else [out]
        return {spec.name: value.cpu().numpy() for spec, value in zip(self.outputs, out)}


class TabularPredictor(Predictor):
    """A tabular model read by its own library from its own format: XGBoost, LightGBM, or a scikit-learn
    estimator in skops' format (`.skops`: types outside skops' own trusted set load only if the
    model's `trusted_types` option names them), or pickled, where an admin allowed it (`allow_pickle`,
    through `engine.unpickle`). Input `input` [rows, features]; outputs `predict` (a class index, or
    a value) and, for a classifier, `predict_proba` [rows, classes], as scikit-learn's estimators
    name them."""

    def __init__(self, path: Path, trusted_types: tuple[str, ...] = (), allow_pickle: bool = False) -> None:
        suffix = path.suffix.lower()
        if suffix in (".json", ".ubj"):
            self._load_xgboost(path)
        elif suffix == ".txt":
            self._load_lightgbm(path)
        elif suffix == ".skops":
            self._load_skops(path, trusted_types)
        elif suffix in PICKLES and allow_pickle:
            from engine.unpickle import restricted_load

            self._adopt_estimator(restricted_load(path, trusted_types), path)
        else:
            raise ModelLoadError(f"{path.name}: a tabular model is an XGBoost .json/.ubj, a LightGBM .txt or a "
                                 "scikit-learn .skops file" + (f" ({PICKLE_REFUSAL})" if suffix in PICKLES else ""))
        self.inputs = [TensorSpec("input", self.input_type, (-1, self.num_features))]
        self.outputs = [TensorSpec("predict", "INT64" if self.num_classes else "FP64", (-1,))]
        if self.num_classes:
            self.outputs.append(TensorSpec("predict_proba", "FP64", (-1, self.num_classes)))
            self.labels = getattr(self, "class_labels", None) or [str(i) for i in range(self.num_classes)]

    def _load_xgboost(self, path: Path) -> None:
        import xgboost

        try:
            self.booster = xgboost.Booster(model_file=str(path))
        except xgboost.core.XGBoostError as exc:
            raise ModelLoadError(f"XGBoost cannot load {path.name}: {exc}") from exc
        self.booster.set_param({"nthread": 1})  # one thread, as ONNX's: OpenMP teams would fight the LLM worker's
        config = json.loads(self.booster.save_config())["learner"]
        objective = config["objective"]["name"]
        classes = int(config["learner_model_param"].get("num_class", "0"))
        self.platform, self.input_type, self.num_features = "xgboost", "FP32", self.booster.num_features()
        self.objective = objective
        self.num_classes = 2 if objective.startswith("binary:") else classes if objective.startswith("multi:") else 0

    def _load_lightgbm(self, path: Path) -> None:
        import lightgbm

        try:
            self.booster = lightgbm.Booster(model_file=str(path))
        except lightgbm.basic.LightGBMError as exc:
            raise ModelLoadError(f"LightGBM cannot load {path.name}: {exc}") from exc
        header = {}  # the model file's header lines (`objective=multiclass num_class:3`, `num_class=3`, ...)
        with path.open() as lines:
            for line in lines:
                if line.startswith("Tree="):
                    break
                key, _, value = line.strip().partition("=")
                header[key] = value
        objective = header.get("objective", "regression").split()[0]
        self.platform, self.input_type, self.num_features = "lightgbm", "FP64", self.booster.num_feature()
        self.objective = objective
        self.num_classes = (2 if objective in ("binary", "cross_entropy")
                            else int(header.get("num_class", "1")) if objective in ("multiclass", "multiclassova")
                            else 0)

    def _load_skops(self, path: Path, trusted_types: tuple[str, ...]) -> None:
        import skops.io

        try:
            untrusted = [t for t in skops.io.get_untrusted_types(file=path) if t not in trusted_types]
            if untrusted:
                raise ModelLoadError(f"{path.name} holds types skops does not trust: {', '.join(untrusted)}; an admin "
                                     "who has reviewed them may list them in the model's `trusted_types` option")
            estimator = skops.io.load(path, trusted=list(trusted_types) or None)
        except ModelLoadError:
            raise
        except Exception as exc:  # skops raises many types for a file it cannot read
            raise ModelLoadError(f"skops cannot load {path.name}: {exc}") from exc
        self._adopt_estimator(estimator, path)

    def _adopt_estimator(self, estimator: object, path: Path) -> None:
        """Serve a fitted scikit-learn estimator (or pipeline): its features, and its classes if it has them."""
        self.estimator = estimator
        if not hasattr(self.estimator, "predict") or not hasattr(self.estimator, "n_features_in_"):
            raise ModelLoadError(f"{path.name} is not a fitted scikit-learn estimator")
        classes = getattr(self.estimator, "classes_", None)
        self.platform, self.input_type, self.num_features = "sklearn", "FP64", int(self.estimator.n_features_in_)
        self.objective = "skops"
        self.num_classes = len(classes) if classes is not None and hasattr(self.estimator, "predict_proba") else 0
        self.class_labels = [str(c) for c in classes] if self.num_classes else []

    def predict(self, tensors: Tensors) -> Tensors:
        x = tensors["input"]
        if self.platform == "sklearn":
            if not self.num_classes:
                return {"predict": np.asarray(self.estimator.predict(x), dtype=np.float64)}
            proba = np.asarray(self.estimator.predict_proba(x), dtype=np.float64)
            return {"predict": proba.argmax(axis=1).astype(np.int64), "predict_proba": proba}
        raw = (self.booster.inplace_predict(x) if self.platform == "xgboost"
               else self.booster.predict(x, num_threads=1))  # one thread, as ONNX's and XGBoost's
        raw = np.asarray(raw, dtype=np.float64)
        if not self.num_classes:
            return {"predict": raw}
        if self.objective == "multi:softmax":  # XGBoost gives the class itself
            return {"predict": raw.astype(np.int64), "predict_proba": np.eye(self.num_classes)[raw.astype(np.int64)]}
        proba = np.stack([1 - raw, raw], axis=1) if raw.ndim == 1 else raw
        return {"predict": proba.argmax(axis=1).astype(np.int64), "predict_proba": proba}


def load_predictor(path: Path, kind: str, device: str = "cpu", trusted_types: tuple[str, ...] = (),
                   allow_pickle: bool = False) -> Predictor:
    """An `onnx`, `torch` or `tabular` model from its file (or a folder holding exactly one)."""
    if path.is_dir():
        suffixes = {"onnx": (".onnx",), "torch": (".pt2",)}.get(
            kind, (".json", ".ubj", ".txt", ".skops") + (PICKLES if allow_pickle else ()))
        files = [f for f in path.iterdir() if f.suffix.lower() in suffixes and f.name != "config.json"]
        if len(files) != 1:
            raise ModelLoadError(f"{path} holds {len(files)} {'/'.join(suffixes)} files; point the source at one")
        path = files[0]
    if not path.is_file():
        raise ModelLoadError(f"model file {path} does not exist")
    if kind == "torch":
        if path.suffix.lower() != ".pt2":
            raise ModelLoadError(f"{path.name}: a torch model is a torch.export program (.pt2); TorchScript and "
                                 "pickled modules are not loaded")
        return TorchPredictor(path, device)
    return OnnxPredictor(path, device) if kind == "onnx" else TabularPredictor(path, trusted_types, allow_pickle)


def predictor_path(source: str, allow_pickle: bool = False) -> Path:
    """A tensor model's file or folder (`pkg:` inside a package, as encoders' sources); ModelLoadError if absent."""
    from engine.encoders import resolve_encoder_path

    path = resolve_encoder_path(source) if source.startswith("pkg:") else Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model file {source!r} does not exist")
    if path.is_file() and path.suffix.lower() in PICKLES and not allow_pickle:
        raise ModelLoadError(f"{path.name} is a pickle: {PICKLE_REFUSAL}")
    return path


def start_predictor(predictor_id: str, source: str, kind: str, worker, device: str, batching: Batching,
                    trusted_types: tuple[str, ...] = (), allow_pickle: bool = False):
    """Load a tensor model and attach its batcher to the device's worker (blocking: off the event loop)."""
    predictor = load_predictor(predictor_path(source, allow_pickle), kind, device, trusted_types, allow_pickle)
    predictor.run([predictor.example()])  # the first run is slow: pay for it before serving
    return predictor, worker.attach_encoder(predictor_id, batching.batcher(predictor_id, predictor.run))

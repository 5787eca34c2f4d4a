"""A restricted unpickler for scikit-learn models saved with `pickle` or `joblib`, loaded only where
an admin opted in (the model's `allow_pickle` option).

A pickle is a program: each global it names is imported and may be called with arguments the file
chooses, which is how a hostile file runs code (`os.system`, `builtins.eval`, ...). This loader
imports only what rebuilds a fitted estimator, as the Python docs' "Restricting Globals" recipe
does: classes defined in scikit-learn, the types skops trusts, numpy's and joblib's array
rebuilders, and the admin's own `trusted_types`. Any other global stops the load, naming it.
What it cannot stop: a trusted class whose constructor or `__setstate__` misbehaves on odd
state. Prefer `.skops`, ONNX or the booster's own format; this is the opt-in for files a team
already has.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

from engine.loader import ModelLoadError

# what numpy and joblib pickles call to rebuild arrays, scalars, dtypes and random generators
REBUILDERS = frozenset({
    "numpy.ndarray", "numpy.dtype", "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar", "numpy.core.multiarray.scalar", "numpy._core.numeric._frombuffer",
    "numpy.core.numeric._frombuffer", "numpy.random._pickle.__bit_generator_ctor",
    "numpy.random._pickle.__generator_ctor", "numpy.random._pickle.__randomstate_ctor",
    "numpy.random.bit_generator.SeedSequence", "numpy.random._mt19937.MT19937", "numpy.random._pcg64.PCG64",
    "joblib.numpy_pickle.NumpyArrayWrapper", "copyreg._reconstructor", "builtins.object", "builtins.slice",
    "builtins.frozenset", "builtins.complex", "builtins.bytearray", "collections.OrderedDict",
})


class ForbiddenGlobal(pickle.UnpicklingError):
    """The file names a global `allowed` refuses."""


@functools.cache
def skops_trusted() -> frozenset[str]:
    """The type names skops loads without asking (primitives, containers, numpy and scikit-learn types)."""
    from skops.io import _trusted_types

    return frozenset(name for attr in dir(_trusted_types) if attr.endswith("_TYPE_NAMES")
                     for name in getattr(_trusted_types, attr))


def allowed(module: str, name: str, trusted_types: tuple[str, ...]) -> bool:
    """May the pickle import `module.name`? A class defined in scikit-learn, a skops-trusted type, a
    rebuilder, an admin-trusted type, or Cython's `__pyx_unpickle_X` helper of one of those."""
    full = f"{module}.{name}"
    if full in REBUILDERS or full in trusted_types or full in skops_trusted():
        return True
    if name.startswith("__pyx_unpickle_"):
        return allowed(module, name.removeprefix("__pyx_unpickle_"), trusted_types)
    if module == "sklearn" or module.startswith("sklearn."):
        import importlib

        try:
            return isinstance(getattr(importlib.import_module(module), name), type)  # classes only, no functions
        except (ImportError, AttributeError):
            return False
    return False


def restricted(base: type, trusted_types: tuple[str, ...]) -> type:
    """`base` (pickle's Unpickler or joblib's) whose `find_class` imports only what `allowed` lets through."""

    class Restricted(base):
        def find_class(self, module: str, name: str):
            if not allowed(module, name, trusted_types):
                raise ForbiddenGlobal(f"it names {module}.{name}, which is neither a scikit-learn class nor "
                                             "a trusted type (an admin who has reviewed it may list it in the "
                                             "model's `trusted_types` option)")
            return super().find_class(module, name)

    return Restricted


def restricted_load(path: Path, trusted_types: tuple[str, ...] = ()) -> object:
    """The object pickled (`pickle.dump`) or dumped by `joblib.dump` (compressed or not) in `path`;
    ModelLoadError naming the first global it may not import."""
    try:
        with path.open("rb") as file:
            if path.suffix.lower() != ".joblib":
                return restricted(pickle.Unpickler, trusted_types)(file).load()
            from joblib import numpy_pickle

            # joblib.load's own steps (it offers no hook for find_class): unwrap a compressed file,
            # then its unpickler, which reads the arrays stored between the pickle's opcodes
            with numpy_pickle._validate_fileobject_and_memmap(file, str(path), None) as (stream, _):
                unpickler = restricted(numpy_pickle.NumpyUnpickler, trusted_types)(str(path), stream, True)
                return unpickler.load()
    except ForbiddenGlobal as exc:
        raise ModelLoadError(f"{path.name} was not loaded: {exc}") from exc
    except Exception as exc:  # a truncated or foreign file raises many types
        raise ModelLoadError(f"{path.name} cannot be unpickled: {type(exc).__name__}: {exc}") from exc

import warnings

import pytest

from onnxtrain.autodiff import UnsupportedOpError


def trainings(model):
    """Every ``Training`` (forward + backward graphs) an ORTModule has built, over all input schemas."""
    return [t for entries in model._cache.values() for graphs in entries for t in graphs.training.values()]


def run_or_skip_missing_rule(fn, *args, **kwargs):
    """Run ``fn``; a missing gradient rule (being written) skips the test, naming the op."""
    try:
        return fn(*args, **kwargs)
    except UnsupportedOpError as exc:
        ops = sorted({op for _, op, _, _ in exc.missing})
        pytest.skip(f"no gradient rule yet for {', '.join(ops)}")


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch):
    """ORTModule must raise, not fall back, in tests that do not test the fallback itself."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield

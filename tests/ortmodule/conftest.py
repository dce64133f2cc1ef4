import warnings

import pytest



def trainings(model):
    """Every ``Training`` (forward + backward graphs) an ORTModule has built, over all input schemas."""
    return [t for entries in model._cache.values() for graphs in entries for t in graphs.training.values()]


@pytest.fixture(autouse=True)
def _no_fallback(monkeypatch):
    """ORTModule must raise, not fall back, in tests that do not test the fallback itself."""
    monkeypatch.setenv("ONNXTRAIN_FALLBACK", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield

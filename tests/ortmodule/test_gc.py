"""young_objects_only(): objects from before the block are frozen during it, and only during it."""

from __future__ import annotations

import gc
import weakref

import torch

from onnxtrain import DebugOptions, ORTModule
from onnxtrain.utils import gc as gc_util


class _Cycle:
    def __init__(self):
        self.me = self


def test_objects_are_frozen_inside_and_collectable_after():
    gc.collect()
    garbage = _Cycle()
    ref = weakref.ref(garbage)
    del garbage  # unreachable, but a cycle: only the collector frees it
    with gc_util.young_objects_only():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert ref() is not None  # frozen: the collector does not look at it
        with gc_util.young_objects_only():  # nested: the outer block owns the freeze
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_leaves_a_freeze_it_did_not_make_and_a_disabled_collector_alone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_util.young_objects_only():
            pass
        # Neither unfrozen (the count would be 0) nor frozen again (it would grow). Frozen objects that die
        # during the block leave the permanent generation, so the count may fall: it is not compared equal.
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with gc_util.young_objects_only():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_ortmodule_builds_its_graphs_with_the_old_objects_frozen(monkeypatch):
    seen = []
    original = ORTModule._export

    def export(self, *args):
        seen.append(gc.get_freeze_count() > 0)
        return original(self, *args)

    monkeypatch.setattr(ORTModule, "_export", export)
    model = ORTModule(torch.nn.Linear(3, 2), DebugOptions(fallback=False))
    model(torch.randn(4, 3)).sum().backward()
    assert seen == [True] and gc.get_freeze_count() == 0

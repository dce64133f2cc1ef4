"""What several passes share: the match-and-rewrite loop over a graph's nodes, two small readings of values, and
a free name for a new value.

A pass whose work is "rewrite each node that matches" states its matcher and its rewrite and calls
:func:`rewrite_each`; the loop walks a copy of the node list, so a rewrite may insert and remove nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir


def rewrite_each(graph: ir.Graph, match: Callable[[ir.Node], object],
                 rewrite: Callable[..., object]) -> list:
    """Call ``rewrite`` on each node of ``graph`` that ``match`` accepts, in graph order; returns what each call
    returned (empty: the graph is unchanged).

    ``match(node)`` returns None or False to leave the node alone, True to call ``rewrite(graph, node)``, and
    anything else (what it found: axes, a producer, a tuple) to call ``rewrite(graph, node, found)``.
    """
    done = []
    for node in list(graph):
        found = match(node)
        if found is None or found is False:
            continue
        done.append(rewrite(graph, node) if found is True else rewrite(graph, node, found))
    return done


def static_shape(shape: ir.Shape | None, start: int = 0) -> bool:
    """Whether ``shape`` is known and every dim from ``start`` on is a number."""
    return shape is not None and all(isinstance(d, int) for d in list(shape)[start:])


def constant_ints(value: ir.Value | None) -> np.ndarray | None:
    """A constant integer tensor's values as int64 (its shape kept), else None."""
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    array = tensor.numpy()
    return array.astype(np.int64) if np.issubdtype(array.dtype, np.integer) else None


def free_name(name: str, taken: set[str]) -> str:
    """``name`` or ``name_<k>``, the first not in ``taken`` (then taken)."""
    candidate, k = name, 0
    while candidate in taken:
        k += 1
        candidate = f"{name}_{k}"
    taken.add(candidate)
    return candidate

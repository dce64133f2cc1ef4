"""Whether torch.onnx's type-promotion pass would change an exported program.

The exporter makes PyTorch's implicit type promotion explicit before translating (``x_bool.cumsum()``
gets a cast to int64, ``int_tensor * 0.5`` a cast to float). To find those places, its pass re-runs the
whole program on fake tensors: 0.35-0.6 s of BERT-small's first step, where it inserts nothing. Every
node already carries its fake output (``node.meta["val"]``), so the same decision can be read off the
graph: for each op with a promotion rule, the rule's preview on the recorded values says which dtype
each argument must have, and the pass changes the node exactly when some argument has another. When no
node needs it, the pass is skipped; otherwise it runs as usual. Any value we cannot read (no recorded
value, an argument kind the pass does not promote either) counts as "needs it".
"""

from __future__ import annotations

import functools

import torch
import torch.fx


@functools.cache
def _promotion():
    from torch.onnx._internal.fx import type_utils
    from torch.onnx._internal.fx.passes import type_promotion

    return type_promotion, type_promotion.TypePromotionTable(), type_utils


def needs_type_promotion(graph_module: torch.fx.GraphModule) -> bool:
    type_promotion, table, _ = _promotion()
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            return True
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            rule = type_promotion.get_type_promotion_rule(node, table)
            if rule is None:
                continue
            args = torch.fx.node.map_arg(node.args, _recorded)
            kwargs = torch.fx.node.map_arg(node.kwargs, _recorded)
            info = rule.preview_type_promotion(args, kwargs)
            if any(_promotes(arg, info.args_dtypes.get(i)) for i, arg in enumerate(node.args)):
                return True
            if any(_promotes(arg, info.kwargs_dtypes.get(name)) for name, arg in node.kwargs.items()):
                return True
    return False


def _recorded(node: torch.fx.Node):
    return node.meta["val"]  # KeyError when missing: the caller then runs the pass


def _promotes(arg, dtype: torch.dtype | None) -> bool:
    """Whether the pass would cast ``arg`` for an op that wants ``dtype`` there (its own decision rules)."""
    if dtype is None:
        return False
    _, _, type_utils = _promotion()
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.dtype != dtype
        if type_utils.is_torch_symbolic_type(value):
            return type_utils.from_scalar_type_to_torch_dtype(type(value)) != dtype
        return True
    scalar_dtype = type_utils.from_scalar_type_to_torch_dtype(type(arg))
    if scalar_dtype is not None:
        return scalar_dtype != dtype
    if isinstance(arg, (tuple, list)):
        return any(_promotes(item, dtype) for item in arg)
    return True

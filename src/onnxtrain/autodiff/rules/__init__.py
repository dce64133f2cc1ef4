"""Every gradient rule, one module per family; the registry is their explicit union.

To add a rule: write a function in the family's module with ``@r("OpType")`` (or use a category
helper: ``rules.elementwise``, ``rules.linear``, ``rules.no_grad``, ``rules.zero_grad``) and add a case
for it to ``tests/autodiff/test_rules.py``. A new family module must be listed here.
"""

from onnxtrain.autodiff.registry import Registry
from onnxtrain.autodiff.rules import elementwise, linalg, nn, reduce, resize, rnn, shape

TABLES = (elementwise.rules, linalg.rules, reduce.rules, shape.rules, nn.rules, nn.staged_rules, rnn.rules,
          resize.rules)
REGISTRY = Registry(*TABLES)

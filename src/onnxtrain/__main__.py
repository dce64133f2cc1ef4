"""``python -m onnxtrain``: the ``onnxtrain`` command line (:mod:`onnxtrain.cli`)."""

import sys

from onnxtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())

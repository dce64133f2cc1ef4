"""The ``onnxtrain`` command line."""

from __future__ import annotations

import argparse
import sys

from onnxtrain._version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnxtrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"onnxtrain {__version__}")
    sub = parser.add_subparsers(dest="command")
    grad = sub.add_parser("grad", help="build the gradient model of an ONNX model")
    grad.add_argument("model", help="path of the ONNX model")
    grad.add_argument("--wrt", nargs="+", required=True, help="initializer or input names to differentiate")
    grad.add_argument("--outputs", nargs="*", default=None, help="outputs to differentiate (default: all float)")
    grad.add_argument("-o", "--output", required=True, help="path of the gradient model to write")
    return parser


def _cmd_grad(args) -> int:
    from onnxtrain.autodiff import gradient_model
    from onnxtrain.utils.io import save_model_atomic

    model = gradient_model(args.model, wrt=args.wrt, outputs=args.outputs)
    save_model_atomic(model, args.output)
    print(f"wrote {args.output}")
    return 0


COMMANDS = {"grad": _cmd_grad}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:  # one clear line for the user; details with ONNXTRAIN_TRACEBACK=1
        import os

        if os.environ.get("ONNXTRAIN_TRACEBACK"):
            raise
        print(f"onnxtrain {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

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
    _add_artifacts_parser(sub)
    return parser


def _add_artifacts_parser(sub) -> None:
    art = sub.add_parser("artifacts", help="generate on-device training artifacts (models and checkpoint)")
    art.add_argument("model", help="path of the ONNX model (inference graph, e.g. logits)")
    art.add_argument("--requires-grad", nargs="+", required=True, metavar="NAME",
                     help="initializers to train")
    art.add_argument("--frozen", nargs="*", default=None, metavar="NAME",
                     help="initializers kept in the checkpoint but not trained (others stay constants)")
    art.add_argument("--loss", default=None, choices=["mse", "crossentropy", "bcewithlogits", "l1"],
                     help="loss appended to the model's first output (default: the model's output is the loss)")
    art.add_argument("--optimizer", default=None, choices=["adamw", "sgd"],
                     help="optimizer model to generate (default: none)")
    art.add_argument("--additional-outputs", nargs="*", default=None, metavar="NAME",
                     help="model values the training and eval models also return")
    art.add_argument("--loss-inputs", nargs="*", default=None, metavar="NAME",
                     help="model outputs the loss reads (default: the first)")
    art.add_argument("--prefix", default="", help="prefix of the artifact file names")
    art.add_argument("--nominal-checkpoint", action="store_true", help="write names and shapes only")
    art.add_argument("-o", "--output-dir", required=True, help="directory to write the artifacts to")


def _cmd_artifacts(args) -> int:
    from onnxtrain.ondevice.artifacts import generate_artifacts

    paths = generate_artifacts(
        args.model, requires_grad=args.requires_grad, frozen_params=args.frozen, loss=args.loss,
        optimizer=args.optimizer, artifact_directory=args.output_dir, prefix=args.prefix,
        additional_output_names=args.additional_outputs, nominal_checkpoint=args.nominal_checkpoint,
        loss_input_names=args.loss_inputs)
    for path in (paths.training_model, paths.eval_model, paths.optimizer_model, paths.checkpoint):
        if path is not None:
            print(f"wrote {path}")
    return 0


def _cmd_grad(args) -> int:
    from onnxtrain.autodiff import gradient_model
    from onnxtrain.utils.io import save_model_atomic

    model = gradient_model(args.model, wrt=args.wrt, outputs=args.outputs)
    save_model_atomic(model, args.output)
    print(f"wrote {args.output}")
    return 0


COMMANDS = {"grad": _cmd_grad, "artifacts": _cmd_artifacts}


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

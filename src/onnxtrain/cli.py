"""The ``onnxtrain`` command line (also ``python -m onnxtrain``): ``grad`` and ``artifacts``."""

from __future__ import annotations

import argparse
import os
import sys

from onnxtrain._version import __version__

DESCRIPTION = """\
Train ONNX models on the standard onnxruntime.

  onnxtrain grad MODEL --wrt NAME [NAME ...] -o GRAD_MODEL
      write the gradient model of an ONNX model
  onnxtrain artifacts MODEL --requires-grad NAME [NAME ...] --loss mse --optimizer adamw -o DIR
      [--precision fp32|bf16|fp16]
      write on-device training artifacts (training, eval and optimizer models, checkpoint)

Run 'onnxtrain COMMAND --help' for a command's options. Errors print their
message only; set ONNXTRAIN_TRACEBACK=1 to see the traceback.
"""

TRACEBACK_ENV = "ONNXTRAIN_TRACEBACK"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``onnxtrain`` command."""
    parser = argparse.ArgumentParser(prog="onnxtrain", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"onnxtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    grad = sub.add_parser("grad", help="write the gradient model of an ONNX model",
                          description="Write the gradient model of an ONNX model: it takes <output>_grad inputs "
                                      "and returns <name>_grad outputs.")
    grad.add_argument("model", nargs="?", help="path of the ONNX model")
    grad.add_argument("--wrt", nargs="+", required=True, metavar="NAME",
                      help="initializer or input names to differentiate")
    grad.add_argument("--outputs", nargs="*", default=None, metavar="NAME",
                      help="outputs to differentiate (default: all float)")
    grad.add_argument("-o", "--output", required=True, help="path of the gradient model to write")
    _add_artifacts_parser(sub)
    return parser


def _add_artifacts_parser(sub) -> None:
    art = sub.add_parser("artifacts", help="write on-device training artifacts (models and checkpoint)",
                         description="Write the training, eval and optimizer models and the checkpoint that "
                                     "onnxtrain.api (or onnxruntime-training's runtime) trains.")
    art.add_argument("model", nargs="?", help="path of the ONNX model (inference graph, e.g. logits)")
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
    art.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                     help="bf16: float32 graphs the runtime runs in bfloat16 where it can; fp16: float16 "
                          "products with dynamic loss scaling (GradScaler's defaults); see docs/precision.md")
    art.add_argument("--target", default="default", choices=["default", "web"],
                     help="'web': artifacts for onnxruntime-web (no Scan in the optimizer; docs/web.md)")
    art.add_argument("-o", "--output-dir", required=True, help="directory to write the artifacts to")
    art.add_argument("-f", "--force", action="store_true",
                     help="replace the artifacts already in the directory (a trained checkpoint included)")


# Options taking a list of names, which swallow a model path written after them.
_LIST_OPTIONS = ("wrt", "outputs", "requires_grad", "frozen", "additional_outputs", "loss_inputs")


def _take_model_path(args, argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Recover ``MODEL`` written after a list option (``--requires-grad a b model.onnx``)."""
    if args.model is not None:
        return
    for token in reversed(argv):
        for name in _LIST_OPTIONS:
            names = getattr(args, name, None)
            if names and names[-1] == token and (token.endswith(".onnx") or os.path.isfile(token)):
                args.model = names.pop()
                return
    parser.error(f"{args.command}: the model path is missing (e.g. onnxtrain {args.command} model.onnx ...)")


def _cmd_artifacts(args) -> int:
    from onnxtrain.ondevice.artifacts import generate_artifacts

    paths = generate_artifacts(
        args.model, requires_grad=args.requires_grad, frozen_params=args.frozen, loss=args.loss,
        optimizer=args.optimizer, artifact_directory=args.output_dir, prefix=args.prefix,
        additional_output_names=args.additional_outputs, nominal_checkpoint=args.nominal_checkpoint,
        loss_input_names=args.loss_inputs, overwrite=args.force, precision=args.precision, target=args.target)
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


def error_text(exc: BaseException) -> str:
    """An exception's message for a user, without Python's quoting of a KeyError's message."""
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        text = str(exc.args[0])
    elif isinstance(exc, OSError) and exc.errno and exc.strerror and exc.filename:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return text.strip()


def main(argv: list[str] | None = None) -> int:
    """Run the ``onnxtrain`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    _take_model_path(args, argv, parser)
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:  # one clear line for the user; details with ONNXTRAIN_TRACEBACK=1
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"onnxtrain {args.command}: error: {error_text(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

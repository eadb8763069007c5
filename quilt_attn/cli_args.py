"""Pieces of the command lines (``quilt-attn`` and the benchmark harness's ``quilt-bench``): usage errors, progress
lines on stderr, the Triton interpreter switch, argparse types and JSON output."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import __version__


class UsageError(Exception):
    """A bad argument value found after parsing; reported as ``<prog>: error: ...`` with exit 2."""


class Progress:
    """Progress lines on stderr, each with the time since the command started."""

    def __init__(self, quiet: bool = False):
        self.t0 = time.perf_counter()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)


def ensure_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA device and the variable is unset."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    """Whether Triton kernels defined now run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def int_at_least(minimum: int, what: str):
    """An argparse type: an int >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


pos_int = int_at_least(1, "a positive integer")
nonneg_int = int_at_least(0, "an integer >= 0")


def unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def pow2(text: str) -> int:
    value = pos_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {value}")
    return value


def group_size_arg(text: str) -> int:
    """An argparse type: a group size, a power of two in [1, 16]."""
    value = pow2(text)
    if value > 16:
        raise argparse.ArgumentTypeError(f"expected a power of two in [1, 16], got {value}")
    return value


def check_merge_level(merge_level, group_size) -> None:
    if merge_level is not None and merge_level > group_size:
        raise UsageError(f"argument --merge-level: must be <= --group-size ({group_size}), got {merge_level}")


def int_list(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return [pos_int(t.strip()) for t in items]


def choice_list(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}")
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))} (choose from {', '.join(choices)})")
        return list(dict.fromkeys(items))

    return parse


def device_arg(name: str):
    """The torch device of a ``--device`` value (``auto``: cuda when available); ``UsageError`` for a missing GPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("argument --device: cuda requested but no CUDA device is available")
    return torch.device(name)


def write_json(path, doc: dict) -> None:
    """``doc`` as indented JSON at ``path`` (its folder made)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def run_command(prog: str, parser: argparse.ArgumentParser, argv=None) -> int:
    """The body of a command line's ``main``: set the interpreter switch (``ensure_interpreter``), parse
    ``argv`` (None: ``sys.argv[1:]``) and run the subcommand's ``func(args, log)``; a ``UsageError``, or a
    ``ValueError`` / ``TypeError`` / ``OSError`` met while running, is one line ``<prog> <command>: error: ...``
    on stderr and exit status 2. Returns the exit status."""
    ensure_interpreter()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    log = Progress(quiet=getattr(args, "quiet", False))
    try:
        return args.func(args, log)
    except UsageError as err:
        print(f"{prog} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as err:  # a bad value, file or folder found while running: one line
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"{prog} {args.command}: error: {msg}", file=sys.stderr)
        return 2


def new_parser(prog: str, description: str):
    """``(parser, subparsers, common)`` of a command line: ``--version``, a required ``COMMAND``, and
    ``common(sp)`` adding ``--quiet`` to a subcommand's parser."""
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, description=description,
        epilog="Run '%(prog)s COMMAND --help' for the options of a command. Without a CUDA device the "
               f"kernels run in Triton's interpreter: {prog} sets TRITON_INTERPRET=1 itself when it is "
               "unset (interpreter timings mean nothing).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(sp):
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")

    return p, sub, common

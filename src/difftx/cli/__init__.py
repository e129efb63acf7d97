"""``difftx <subcommand>``: a thin dispatcher.

Each subcommand lives in its own module under ``difftx.cli`` with
``add_parser(subparsers)`` and ``run(args) -> int``; modules are imported only
when their subcommand runs, so ``difftx info`` stays fast.  User errors
(:class:`~difftx.errors.DifftxError`, bad arguments) print one line and exit 2.  Ctrl-C prints one line and
exits 130; SIGTERM does the same with exit code 143 (train and compare checkpoint and stop on either).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import DifftxError, option_flag

# name -> (module, one-line help)
SUBCOMMANDS = {
    "info": ("difftx.cli.info", "parameters, FLOPs and KV-cache size of a preset or config"),
    "train": ("difftx.cli.train", "train a model on a text corpus (or images with --domain vision)"),
    "eval": ("difftx.cli.eval", "run one of the papers' evaluations on a checkpoint"),
    "bench": ("difftx.cli.bench", "benchmark training, prefill and decode speed side by side"),
    "compare": ("difftx.cli.compare", "the papers' claims measured at your scale (the main job)"),
    "grads": ("difftx.cli.grads", "gradient flow and heavy-tail analysis"),
    "convert": ("difftx.cli.convert", "convert checkpoints between difftx and Hugging Face / official layouts"),
}


# the commands whose SIGTERM is handled as Ctrl-C (train and compare handle it themselves: they checkpoint and stop)
TERM_AS_INTERRUPT = ("info", "eval", "bench", "grads", "convert")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the signal lands as Ctrl-C's KeyboardInterrupt is, so that the same clean-up runs (a
    convert's half-made DST goes, an evaluation's new --out too) instead of the process dying mid-write."""


def _terminated(signum, frame):
    raise Terminated()


# the path arguments of the subcommands, and the name options whose "" would read as "not given" (the default)
PATH_ARGS = ("out", "data", "checkpoint", "resume", "src", "dst", "cache_dir", "tokenizer")
NAME_ARGS = ("preset", "recipe", "norms")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (exit 2) instead of usage + error."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # a subcommand's: named by it ("difftx train: error: ..."), not by "difftx"
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from .. import __version__

    parser = ArgumentParser(prog="difftx", description="Differential Transformer and DNT: train, evaluate, compare.")
    parser.add_argument("--version", action="version", version=f"difftx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name, (module, help_) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_, add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None) or not hasattr(args, "func"):
        parser.print_help()
        return 0 if not argv else 2
    for name in PATH_ARGS + NAME_ARGS:  # Path("") is the current directory: an empty path is a mistake, not "here"
        value = getattr(args, name, None)  # and --out ' ' made a directory named ' ': blank is a mistake too
        if isinstance(value, str) and not value.strip() and not (args.command == "info" and name == "preset"):
            flag = name.upper() if name in ("src", "dst") else option_flag(name)
            what = "a name or a path" if name == "tokenizer" else "a name" if name in NAME_ARGS else "a path"
            blank = "is empty" if value == "" else f"is blank ({value!r})"
            parser.exit(2, f"difftx {args.command}: error: {flag} {blank}; give {what} (see --help)\n")
    threads = getattr(args, "threads", None)  # train, bench, grads, compare: torch threads per process
    if threads is not None:
        from ..runtime import usable_cpus

        cpus = usable_cpus()
        if threads > cpus:  # they only wait on each other; 10^11 overflows torch, 100000 crashes OpenMP
            parser.exit(2, f"difftx {args.command}: error: --threads {threads} is more than the {cpus} CPUs this "
                           f"process can use; give at most {cpus} (see --help)\n")
    if args.command not in ("info", "convert"):  # the commands that train, evaluate or benchmark
        from ..runtime import keep_freed_memory

        keep_freed_memory()
    import signal
    import threading

    term = None
    if (args.command in TERM_AS_INTERRUPT and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):  # not where a caller set its own handler
        term = signal.signal(signal.SIGTERM, _terminated)
    try:
        return int(args.func(args) or 0)
    except DifftxError as e:
        print(f"difftx {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"difftx {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"difftx {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `difftx info small | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit-time flush must not raise again
        return 0
    except OSError as e:  # the file system said no (disk full, permissions, a path in the way): one line
        where = f"{e.filename}: " if e.filename else ""
        print(f"difftx {args.command}: error: {where}{e.strerror or e}; check the path, its permissions and free "
              "space", file=sys.stderr)
        return 2
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)


def entry() -> int:
    """The ``difftx`` command (and ``python -m difftx``): :func:`main`, then, in a process that ran a torchrun
    process group and ended it, ``os._exit`` with main's exit code.  There the interpreter's own teardown can kill
    the finished process (gloo's C++ threads: SIGABRT "terminate called without an active exception", or
    SIGSEGV, seen twice in a row in this project's torchrun test workers on 2026-11-27), and torchrun then reports
    a run that completed, its checkpoints and results written, as failed.  Every file of ours is closed by then."""
    code = main()
    distributed = sys.modules.get("difftx.train.distributed")  # not imported: no process group either
    if distributed is not None and distributed.ended_a_group():
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(entry())

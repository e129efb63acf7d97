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

from ..errors import ConfigError, DifftxError, option_flag

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


def _as_typed(e: DifftxError, parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> str:
    """``e``'s message, a :class:`~difftx.errors.ConfigError` naming the option the user typed rather than its
    config field: ``seq_len: ...`` after ``--seq-len 0`` reads ``--seq-len: ...``, and ``n_layers: ...`` after
    ``--set n_layers=0`` reads ``--set n_layers: ...``.  A field the user did not give (a recipe's, a preset's, a
    resumed run's) keeps its field name: no flag of theirs is at fault."""
    text = str(e)
    field = getattr(e, "field", None)
    if not isinstance(e, ConfigError) or not field or not field.isidentifier() or not text.startswith(f"{field}: "):
        return text
    sub = next((a.choices.get(args.command) for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
               None)
    while sub is not None:  # eval's own subcommands: `difftx eval niah`'s options are niah's parser's
        nested = next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None)
        if nested is None or not isinstance(getattr(args, nested.dest, None), str):
            break
        sub = nested.choices.get(getattr(args, nested.dest))
    if sub is None:
        return text
    every = {o for a in sub._actions for o in a.option_strings}
    typed = {w.split("=", 1)[0] for w in (argv[:argv.index("--")] if "--" in argv else argv)}
    typed = {w for w in typed if w.startswith("--") and w != "--"}
    for action in sub._actions:  # the option of that dest, or of its flag (task_options is --task-opt's)
        if action.dest != field and option_flag(field) not in action.option_strings:
            continue
        for opt in action.option_strings:  # as typed: exactly, or an abbreviation argparse took for it
            if opt in typed or any(opt.startswith(w) and w not in every for w in typed):
                return f"{opt}: {text[len(field) + 2:]}"
    if any(str(item).partition("=")[0].strip() == field for item in getattr(args, "set", None) or []):
        return f"--set {field}: {text[len(field) + 2:]}"
    return text


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
        try:
            text = _as_typed(e, parser, args, argv)
        except Exception:  # the option's spelling is a nicety: never a traceback instead of the line
            text = str(e)
        print(f"difftx {args.command}: error: {text}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"difftx {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"difftx {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `difftx info small | head`: the reader left; not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())  # Python's exit-time flush must not raise again
        finally:
            os.close(devnull)  # stdout's descriptor is a copy of it now
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

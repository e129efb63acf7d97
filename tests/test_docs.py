"""The documentation's examples stay true: README.md and docs/*.md.

* Every fenced ```python block runs, in a fresh namespace and a temporary working directory.  HTML comments
  just before a block (blank lines between them allowed) steer it; they do not show on a rendered page:

      <!-- test-setup:
      CODE -->                what the fragment leaves to the reader (input_ids, a model directory, ...);
                              runs first, in the block's namespace
      <!-- slow-test: WHY --> runs only under ``-m slow`` (more than a few seconds)
      <!-- no-test: WHY -->   never runs (downloads, minutes of training); it is still compiled

* Every ``difftx SUBCOMMAND ...`` command in a code block (fenced or indented; also after ``python -m`` or
  ``torchrun ... -m``) parses with the real parser and passes the option checks the subcommand makes before
  it loads or writes anything.  A synopsis (``[--opt N]``, ``NAME``, ``...``) and an inline
  ```difftx SUBCOMMAND ...``` span in the prose name only options the subcommand has; an inline span that
  parses as a whole command passes the option checks too.

* Every ``python benchmarks/X.py ...`` command in the docs (benchmarks/performance/README.md too) and in a benchmark
  script's own docstring names a script that exists and only options its parser has; any other ``--option`` a
  script's docstring names is one of its own or of a ``difftx`` subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("info", "train", "eval", "bench", "compare", "grads", "convert")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SHELL = ("", "bash", "sh", "shell", "console")
INLINE = re.compile(r"`(difftx (?:%s)(?=[\s`])[^`]*)`" % "|".join(SUBCOMMANDS))
COMMAND = re.compile(r"(?:^|[\s;&|])difftx\s+(?:%s)(?:\s|$)" % "|".join(SUBCOMMANDS))
MARKER = re.compile(r"<!--\s*(test-setup|slow-test|no-test)\s*:?(.*?)-->", re.S)


@dataclass
class Block:
    where: str  # "docs/x.md:LINE", LINE the block's first line of code
    line: int
    lang: str
    code: str
    markers: dict = field(default_factory=dict)


@dataclass
class Command:
    where: str
    argv: list
    synopsis: bool  # placeholders: check the options it names only
    text: str


def _markers(lines: list[str], fence: int) -> dict:
    """The test-setup / slow-test / no-test comments on the lines just above line index ``fence``."""
    i, found = fence - 1, {}
    while i >= 0:
        if not lines[i].strip():
            i -= 1
            continue
        if not lines[i].rstrip().endswith("-->"):
            break
        start = i
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        comment = "\n".join(lines[start:i + 1]).strip()
        m = MARKER.fullmatch(comment)
        if m is None:
            if "test" in comment:  # a misspelt marker must not be ignored silently
                found["unknown"] = comment
            break
        found[m.group(1)] = m.group(2).strip()
        i = start - 1
    return found


def _scan(path: Path):
    """(fenced blocks, shell code lines, lines outside fences) of one Markdown file."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, code, prose, i = [], [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                j += 1
            body = [ln[indent:] if ln.startswith(" " * indent) else ln.lstrip() for ln in lines[i + 1:j]]
            blocks.append(Block(f"{rel}:{i + 2}", i + 2, lang, "\n".join(body) + "\n", _markers(lines, i)))
            if lang in SHELL:
                code += [(f"{rel}:{i + 2 + k}", ln) for k, ln in enumerate(body)]
            i = j + 1
            continue
        if lines[i].startswith(("    ", "\t")):  # an indented code block, or a list item's continued line
            code.append((f"{rel}:{i + 1}", lines[i]))
        prose.append((f"{rel}:{i + 1}", lines[i]))
        i += 1
    return blocks, code, prose


def _command(tokens: list[str]):
    """The difftx argv of one shell command (its tokens), or None: env assignments, time / nice / taskset,
    ``python -m`` and ``torchrun ... -m`` in front are skipped."""
    while tokens:
        t = tokens[0]
        if re.match(r"^\w+=", t) or t == "time":
            tokens = tokens[1:]
        elif t in ("nice", "taskset") and len(tokens) > 2 and tokens[1].startswith("-"):
            tokens = tokens[3:]
        elif t == "nice":
            tokens = tokens[1:]
        elif t in ("python", "python3") and tokens[1:2] == ["-m"]:
            tokens = tokens[2:]
        elif t == "torchrun" and "-m" in tokens:
            tokens = tokens[tokens.index("-m") + 1:]
        else:
            break
    if len(tokens) >= 2 and tokens[0] == "difftx" and tokens[1] in SUBCOMMANDS:
        return tokens[1:]
    return None


def _commands(code_lines) -> list[Command]:
    out, pending = [], None
    for where, line in code_lines:
        if pending is not None:  # a line continued with a backslash
            where, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (where, line.rstrip()[:-1])
            continue
        pending = None
        if not COMMAND.search(line):
            continue
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise ValueError(f"{where}: {e}: {line}") from None
        segments, cur = [], []
        for t in tokens:  # a && b ; c | d: one command each
            if t in ("&&", "||", ";", "|"):
                segments.append(cur)
                cur = []
            else:
                cur.append(t)
        for seg in segments + [cur]:
            argv = _command(seg)
            if argv is not None:
                synopsis = any(t.startswith("[") or "..." in t or t == "NAME" for t in argv)
                out.append(Command(where, argv, synopsis, line.strip()))
    return out


BLOCKS, COMMANDS, SPANS = [], [], []
for _path in DOCS:
    _b, _c, _p = _scan(_path)
    BLOCKS += _b
    COMMANDS += _commands(_c)
    SPANS += [(where, m.group(1)) for where, text in _p for m in INLINE.finditer(text)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


# ----------------------------------------------------------------------------- the CLI side
_PARSER = {}


def _parser(sub: str) -> argparse.ArgumentParser:
    if sub not in _PARSER:
        from difftx.cli import build_parser

        _PARSER[sub] = build_parser(only=sub)
    return _PARSER[sub]


def _options(sub: str, eval_name: str | None = None) -> set[str]:
    """The option strings of ``difftx SUB`` (``difftx eval NAME``'s; of every evaluation without a NAME)."""
    parser = next(a for a in _parser(sub)._actions if isinstance(a, argparse._SubParsersAction)).choices[sub]
    opts = {o for a in parser._actions for o in a.option_strings}
    if sub == "eval":
        evals = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        names = [eval_name] if eval_name in evals else list(evals)
        opts |= {o for n in names for a in evals[n]._actions for o in a.option_strings}
    return opts


def parse(argv: list[str]):
    """The Namespace of ``difftx ARGV`` (None for --help); argparse's one-line error as an AssertionError."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return _parser(argv[0]).parse_args(argv)
        except SystemExit as e:
            if e.code == 0:
                return None
            raise AssertionError(err.getvalue().strip()) from None


def precheck(args) -> None:
    """The option checks ``difftx CMD`` makes before it loads or writes anything (DifftxError when refused)."""
    cmd = args.command
    if cmd == "train" and not args.list_recipes:
        from difftx.cli import train as cli
        from difftx.train.run import _check_unread, resolve_configs

        args.task_options = cli._kv(args.task_opt, "--task-opt")
        args.domain_options = cli._kv(args.domain_opt, "--domain-opt")
        train = {f: getattr(args, f) for f in cli.TRAIN_FLAGS if getattr(args, f, None) is not None}
        model = {f: getattr(args, f) for f in cli.MODEL_FLAGS if getattr(args, f, None) is not None}
        model.update(cli._kv(args.set, "--set") or {})
        tcfg, _ = resolve_configs(args.recipe, train, model, args.preset)
        recipe_fields = set(cli.get_recipe_fields(args.recipe)) if args.recipe else set()
        _check_unread(tcfg, set(train) | recipe_fields, set(model))
        if tcfg.domain == "vision":
            from difftx.train.vision import parse_options

            parse_options(tcfg.domain_options or {})
        if tcfg.task is not None:
            from difftx.data.tasks import get_task

            get_task(tcfg.task)
    elif cmd == "compare" and not args.list_arms:
        from difftx.cli import compare as cli
        from difftx.compare import StudyConfig

        fields = cli.explicit_fields(args)
        cli.check_unread(fields, StudyConfig(**fields))
    elif cmd == "grads":
        from difftx.cli import grads as cli

        cli._check(args)
        if not args.checkpoint:
            cli._base_config(args)
    elif cmd == "bench":
        from difftx.benchmarking import ARMS, PHASES, QUICK, BenchConfig
        from difftx.cli import bench as cli

        cli._check_mode(args)
        sizes = dict(QUICK) if args.quick else {}
        sizes.update({k: getattr(args, k) for k in ("preset", "seq_len", "batch_size", "repeats", "warmup",
                                                    "decode_tokens", "threads") if getattr(args, k) is not None})
        bc = BenchConfig(dtypes=cli._csv(args.dtypes), arms=cli._csv(args.arms) if args.arms else list(ARMS),
                         peers=not args.no_peers, phases=cli._csv(args.phases) if args.phases else list(PHASES),
                         timer=args.timer or "wall", device=args.device, memory=not args.no_memory,
                         fused_adamw=args.fused_adamw, **sizes)
        if args.long_context and args.lengths is not None:
            cli._lengths(args.lengths)
        bc.validate()
        if not args.long_context:
            bc.check_seq_len()
    elif cmd == "eval" and args.eval_name != "lm-eval":
        from difftx.cli import eval as cli

        if args.quant_bits is not None and (args.eval_name == "quant" or not 2 <= args.quant_bits <= 32):
            raise AssertionError(f"--quant-bits {args.quant_bits} is refused by 'difftx eval {args.eval_name}'")
        cli._check_unread(args)
    elif cmd == "info" and (args.list or args.preset):
        from difftx.cli import info as cli

        with contextlib.redirect_stdout(io.StringIO()):
            cli.run(args)
    elif cmd == "convert" and args.depth is not None and args.depth < 0:
        raise AssertionError("--depth must be >= 0")


def check_command(argv: list[str], synopsis: bool = False) -> None:
    check_options(argv)  # by their full names: argparse would take a prefix of a renamed option
    if synopsis:
        return
    args = parse(argv)
    if args is not None:
        precheck(args)


def check_options(argv: list[str]) -> None:
    """Every --option ARGV names (``[--a N]``, ``--a/--b`` too) is an option of its subcommand."""
    known = _options(argv[0], argv[1] if argv[0] == "eval" and len(argv) > 1 else None)
    for token in argv[1:]:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", token):
            assert flag in known, f"difftx {argv[0]} has no option {flag}"


# ----------------------------------------------------------------------------- the tests
def _block_param(b: Block):
    marks = [pytest.mark.skip(reason=f"no-test: {b.markers['no-test']}")] if "no-test" in b.markers else \
        [pytest.mark.slow] if "slow-test" in b.markers else []
    return pytest.param(b, id=b.where, marks=marks)


def run_block(block: Block) -> dict:
    """Run a block (after its test-setup) as a script; the namespace it leaves.  Tracebacks name the .md line."""
    from difftx.train import domain

    ns = {"__name__": "__main__"}
    domains, threads = dict(domain.DOMAINS), torch.get_num_threads()
    try:
        if "test-setup" in block.markers:
            exec(compile(block.markers["test-setup"] + "\n", f"{block.where} (test-setup)", "exec"), ns)
        exec(compile("\n" * (block.line - 1) + block.code, block.where.rsplit(":", 1)[0], "exec"), ns)
    finally:  # a block may register a domain (docs/training.md does) or set torch's threads
        domain.DOMAINS.clear()
        domain.DOMAINS.update(domains)
        torch.set_num_threads(threads)
    return ns


@pytest.mark.parametrize("block", [_block_param(b) for b in PYTHON])
def test_python_block_runs(block, tmp_path, monkeypatch, one_thread):  # tiny models: one thread is fastest
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path / "cache"))  # token shards of a block that trains
    run_block(block)


def test_every_python_block_compiles_and_markers_have_reasons():
    for b in PYTHON:
        compile(b.code, b.where, "exec")
        if "test-setup" in b.markers:
            compile(b.markers["test-setup"], b.where, "exec")
        for key in ("slow-test", "no-test"):
            assert b.markers.get(key, "x"), f"{b.where}: <!-- {key}: WHY --> needs its reason"
        assert "unknown" not in b.markers, f"{b.where}: not a test marker: {b.markers['unknown']}"
    stray = [b.where for b in BLOCKS if b.lang != "python" and b.markers]
    assert not stray, f"test markers before blocks that are not python: {stray}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_line_is_accepted(cmd):
    try:
        check_command(cmd.argv, cmd.synopsis)
    except Exception as e:  # DifftxError from a precheck, AssertionError from argparse
        error = f"{type(e).__name__}: {e}"
    else:
        return
    pytest.fail(f"{cmd.where}: {cmd.text}\n  -> {error}")


def test_inline_commands_name_real_options():
    bad = []
    for where, text in SPANS:
        argv = text.replace("\\|", "|").split()[1:]
        try:
            check_options(argv)
            try:
                args = parse(shlex.split(text)[1:])
            except (AssertionError, ValueError):  # placeholders, a fragment: its options were checked
                continue
            if args is not None:
                precheck(args)
        except Exception as e:
            bad.append(f"{where}: `{text}` -> {type(e).__name__}: {e}")
    assert not bad, "\n".join(bad)


def test_the_collection_is_not_empty_and_the_checks_can_fail():
    assert len(PYTHON) >= 10 and len(COMMANDS) >= 25 and len(SPANS) >= 50, (len(PYTHON), len(COMMANDS), len(SPANS))
    with pytest.raises(AssertionError, match="invalid int value"):
        check_command(["train", "--steps", "many"])
    with pytest.raises(AssertionError, match="no option --no-such-option"):
        check_command(["train", "--no-such-option"])
    with pytest.raises(Exception, match="--seeds"):
        check_command(["grads", "--out", "x", "--only", "flow", "--seeds", "3"])
    with pytest.raises(AssertionError, match="no option --phase"):  # argparse alone takes it for --phases
        check_command(["bench", "--out", "x", "--phase", "decode"])
    with pytest.raises(AssertionError, match="no option --no-such-option"):
        check_options(["compare", "[--no-such-option]"])
    with pytest.raises(NameError):
        run_block(Block("x.md:3", 3, "python", "undefined_name\n"))


def test_cache_defaults_name_both_variables(monkeypatch, tmp_path):
    """Token shards, bpe vocabularies and the native kernels share one cache directory, which either of
    ``$DIFFTX_CACHE`` and ``$DIFFTX_CACHE_DIR`` moves (``difftx.runtime.cache_root``).  Every place that spells out
    the default (a chain down to ``$XDG_CACHE_HOME``: the docs, the ``--cache-dir`` helps, the kernels' module
    doc) names both: docs/training.md called ``$DIFFTX_CACHE_DIR`` "a different variable" after it moved the
    shards too."""
    from difftx.data.shards import default_cache_dir
    from difftx.nn import native

    for var in ("DIFFTX_CACHE", "DIFFTX_CACHE_DIR"):
        for v in ("DIFFTX_CACHE", "DIFFTX_CACHE_DIR"):
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv(var, str(tmp_path / var))
        assert default_cache_dir() == native._cache_dir() == tmp_path / var, var
    texts = [(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")) for path in DOCS]
    for sub in ("train", "compare"):
        parser = next(a for a in _parser(sub)._actions if isinstance(a, argparse._SubParsersAction)).choices[sub]
        texts += [(f"difftx {sub} --cache-dir", a.help) for a in parser._actions if "--cache-dir" in a.option_strings]
    texts.append(("difftx.nn.native", native.__doc__))
    bad = []
    for where, text in texts:
        for m in re.finditer(r"XDG_CACHE_HOME", text):
            chain = " ".join(text[max(0, m.start() - 120):m.start()].split())
            if not (re.search(r"DIFFTX_CACHE(?!_DIR)", chain) and "DIFFTX_CACHE_DIR" in chain):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{where}:{line}: ...{chain}XDG_CACHE_HOME")
    assert len(texts) >= 10 and not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- the benchmark scripts' commands
BENCH_DOCS = DOCS + [ROOT / "benchmarks" / "performance" / "README.md"]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if "results" not in p.relative_to(ROOT).parts)
SCRIPT_CMD = re.compile(r"(?<![\w/.-])(?:python3?|bash)\s+(benchmarks/[\w./-]+\.(?:py|sh))([^`#;|&\n]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _script_options(path: Path) -> set[str]:
    """The --options a benchmark script's argparse parser has (its ``add_argument`` calls, read statically)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
            for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


def _script_docstring(path: Path) -> str:
    import ast

    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def _script_commands(texts) -> list[tuple[str, str, str]]:
    """(where, script path, its arguments) of every ``python benchmarks/X.py ARGS`` / ``bash benchmarks/X.sh``."""
    return [(where, m.group(1), m.group(2)) for where, text in texts for m in SCRIPT_CMD.finditer(text)]


def _doc_script_texts():
    """Code lines (a backslash continues one) and inline spans (a span wrapped over two lines is one text)."""
    out = []
    for path in BENCH_DOCS:
        _, code, prose = _scan(path)
        pending = None
        for where, line in code:
            if pending is not None:
                where, line = pending[0], pending[1] + " " + line.strip()
            pending = (where, line.rstrip()[:-1]) if line.rstrip().endswith("\\") else None
            if pending is None:
                out.append((where, line))
        text = "\n".join(line for _, line in prose)
        for m in re.finditer(r"`([^`]+)`", text):
            out.append((prose[text.count("\n", 0, m.start())][0], m.group(1).replace("\n", " ")))
    return out


def _check_script_command(where: str, script: str, args: str) -> list[str]:
    path = ROOT / script
    if not path.is_file():
        return [f"{where}: {script} does not exist"]
    if path.suffix != ".py":
        return []
    known = _script_options(path)
    return [f"{where}: {script} has no option {flag}" for flag in FLAG.findall(args) if flag not in known]


def test_benchmark_commands_in_the_docs_name_real_scripts_and_options():
    cmds = _script_commands(_doc_script_texts())
    assert len(cmds) >= 20 and {s for _, s, _ in cmds} >= {"benchmarks/train_nanogpt_cpu.py",
                                                            "benchmarks/interop/llama_to_diff.py"}, cmds
    bad = [e for c in cmds for e in _check_script_command(*c)]
    assert not bad, "\n".join(bad)


def test_benchmark_scripts_docstrings_name_real_paths_and_options():
    """Each script's usage lines (``python benchmarks/X.py [--a N]``, continued on lines that start with ``[`` or
    ``--``) name an existing script and its options; any other ``--option`` the docstring names is the script's
    own or a ``difftx`` subcommand's (the command the script runs)."""
    difftx_opts = set().union(*(_options(sub) for sub in SUBCOMMANDS))
    bad, usages = [], 0
    for path in SCRIPTS:
        rel = path.relative_to(ROOT).as_posix()
        lines = _script_docstring(path).splitlines()
        texts = []
        for i, line in enumerate(lines):
            if SCRIPT_CMD.search(line):
                j = i + 1
                while j < len(lines) and lines[j].strip().startswith(("[", "--")):
                    line += " " + lines[j].strip()
                    j += 1
                texts.append((f"{rel} (docstring line {i + 1})", line))
        cmds = _script_commands(texts)
        usages += len(cmds)
        bad += [e for c in cmds for e in _check_script_command(*c)]
        own = _script_options(path)
        bad += [f"{rel}: its docstring names {flag}, an option of neither it nor difftx"
                for flag in sorted(set(FLAG.findall("\n".join(lines))) - own - difftx_opts)]
    assert len(SCRIPTS) >= 15 and usages >= 15, (len(SCRIPTS), usages)
    assert not bad, "\n".join(bad)

"""``difftx convert SRC DST``: checkpoints between difftx, transformers (Llama, DiffLlama, Mistral, Qwen2,
Qwen3, Phi-3, difftx) and unilm.

A thin layer over :func:`difftx.interop.convert.convert`.  ``--verify`` reads the
source and the result back, each with its own library (transformers for a Llama /
DiffLlama / Mistral / Qwen2 / Qwen3 / Phi-3 directory when it is installed, difftx otherwise), and prints the largest
logit difference on a fixed random batch (and the KL divergence for ``--diff-init``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..errors import DifftxError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_parser(sub) -> None:
    from ..interop.convert import FORMATS
    from ..interop.llama_to_diff import DIFF_INIT_MODES

    p = sub.add_parser(
        "convert", help="convert checkpoints between difftx and Hugging Face / official layouts",
        description="Convert SRC (a difftx model dir, a Hugging Face llama / diffllama / mistral / qwen2 / qwen3 / "
                    "phi3 / difftx dir, or a weights file of official unilm attention modules) into DST. Loading "
                    "never runs code from SRC.")
    p.add_argument("src", metavar="SRC", help="source directory (or unilm weights file)")
    p.add_argument("dst", metavar="DST", help="destination directory")
    p.add_argument("--from", dest="src_format", default="auto", choices=("auto",) + FORMATS + ("unilm",),
                   help="source format (default: detected from SRC)")
    p.add_argument("--to", dest="dst_format", choices=FORMATS,
                   help="destination format (default: difftx; a difftx SRC needs --to unless it is re-laid out or "
                        "given --diff-init)")
    p.add_argument("--pairing", choices=("adjacent", "halves"),
                   help="DIFF head pairing of a difftx or hf-difftx result (rows re-laid out; the function is "
                        "unchanged; the other hf- formats but hf-difftx fix their own)")
    p.add_argument("--rope-style", choices=("half", "interleaved"),
                   help="RoPE channel order of a difftx or hf-difftx result (rows re-laid out; the function is "
                        "unchanged; the other hf- formats but hf-difftx fix their own)")
    p.add_argument("--diff-init", choices=DIFF_INIT_MODES,
                   help="turn a softmax (Llama) model into DIFF for continued training: exact (same function, "
                        "2x attention), twin-zero (matched size, half of each head exact), twin (the paper's DIFF)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="store weights in this dtype (default: as the source)")
    p.add_argument("--depth", type=int, help="unilm: 0-based layer index of a module whose key prefix has none")
    p.add_argument("--unilm-variant", choices=("flash", "naive"), default=None,
                   help="unilm: which official file's GQA pairing the weights were trained with (default flash)")
    p.add_argument("--verify", action="store_true",
                   help="read source and result back (Llama / DiffLlama / Mistral / Qwen / Phi-3 with transformers "
                        "when installed), "
                        "print their max logit difference on random tokens and exit 1 when a conversion that "
                        "keeps the function and the precision misses it by more than 1e-3 of the largest logit")
    p.add_argument("--force", action="store_true", help="overwrite a DST that already holds a model")
    p.set_defaults(func=run)


def _read_back(path: Path):
    """(model in float32, "transformers" or "difftx"): ``path`` read by the library that owns its format."""
    from ..interop.convert import LLAMA_LIKE, detect_format
    from ..io import load_model

    fmt = detect_format(path)
    if fmt in LLAMA_LIKE:
        try:
            import transformers
        except ImportError:
            pass
        else:
            from ..interop.convert import ARCHITECTURES

            cls = getattr(transformers, ARCHITECTURES[fmt])
            try:
                model = cls.from_pretrained(str(path), local_files_only=True)
            except Exception as e:  # transformers' own refusal (a config it validates otherwise, ...): one line
                raise _TransformersCannotRead(f"transformers cannot read {path} as {cls.__name__}: "
                                              f"{type(e).__name__}: {' '.join(str(e).split())}") from None
            return model.float().eval(), "transformers"
    return load_model(path).float(), "difftx"


class _TransformersCannotRead(Exception):
    """transformers refused a directory that ``--verify`` reads back (the message is one line)."""


VERIFY_RTOL = 1e-3  # of the source's largest |logit|: two libraries' float32 sums differ ~1e-6 of it


def _verify(src: Path, dst: Path, diff_init, dtype) -> tuple[str, bool]:
    """(the line to print, whether the result passed).  A conversion that keeps the function (no ``--diff-init``
    or ``exact``) and the weights' precision (no ``--dtype`` below float32) must reproduce the source's logits
    within VERIFY_RTOL of their largest magnitude; otherwise the numbers are printed and not judged."""
    import torch

    try:
        a, ra = _read_back(src)
    except _TransformersCannotRead as e:  # the source: bad input, and the conversion itself succeeded
        raise DifftxError(f"--verify: {e}; the converted model in {dst} is kept (fix the source's config.json, "
                          "or drop --verify)") from None
    b, rb = _read_back(dst)  # the result: _TransformersCannotRead is a failed verification (run's caller)
    g = torch.Generator().manual_seed(0)
    n = min(32, getattr(a.config, "max_seq_len", None) or a.config.max_position_embeddings)
    x = torch.randint(0, a.config.vocab_size, (2, n), generator=g)
    with torch.no_grad():
        la, lb = a(x).logits.float(), b(x).logits.float()
    msg = (f"max |logit difference| {float((la - lb).abs().max()):.3g} on 2x{n} random tokens "
           f"(source read by {ra}, result by {rb})")
    if diff_init:
        kl = torch.nn.functional.kl_div(lb.log_softmax(-1), la.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1).mean()
        msg += f", KL(source || result) {float(kl):.4g} nats/token"
    if diff_init not in (None, "exact") or dtype not in (None, "float32"):
        why = f"--diff-init {diff_init} changes the function" if diff_init not in (None, "exact") else \
            f"--dtype {dtype} rounds the weights"
        return msg + f"; not judged ({why})", True
    tol = VERIFY_RTOL * max(1.0, float(la.abs().max()))
    ok = bool((la - lb).abs().max() <= tol)  # NaN fails
    return msg + (f"; within the tolerance {tol:.3g}" if ok else f"; over the tolerance {tol:.3g}"), ok


def _check_dst_path(dst: Path) -> None:
    """A DST that cannot become a directory (part of it is a file, a parent that cannot be written) is
    one line before anything is read or converted; nothing is created here."""
    import os

    parent = dst
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent == dst:
        return
    if not parent.is_dir():
        raise DifftxError(f"DST {dst}: part of the path ({parent}) is a file, not a directory; pick another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DifftxError(f"DST {dst}: cannot create a directory in {parent} (permission denied); pick another path")


def _check_overwritable(dst: Path) -> None:
    """``--force`` overwrites only a model directory convert could have written: a difftx model directory,
    a Hugging Face model directory or converted unilm attention modules -- never a training run, a
    checkpoint, a compare study or any other directory."""
    import json

    from ..interop.unilm import MODULES_FILE
    from ..io import CONFIG_FILE, FORMAT_KEY, training_run_reason

    refuse = (f"{dst}: not a model directory that difftx convert writes ({{why}}); --force overwrites only "
              "such a directory, so pick another DST (nothing was changed)")
    why = training_run_reason(dst)
    if why is not None:
        raise DifftxError(refuse.format(why=why))
    if (dst / CONFIG_FILE).is_file():
        try:
            data = json.loads((dst / CONFIG_FILE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            raise DifftxError(refuse.format(why=f"its {CONFIG_FILE} is not a JSON object"))
        if FORMAT_KEY in data:
            if not isinstance(data.get("model"), dict):  # (a training run's: training_run_reason above)
                raise DifftxError(refuse.format(why=f"its {CONFIG_FILE} is a training run's or checkpoint's"))
            return
        if "model_type" in data:
            return
        raise DifftxError(refuse.format(why=f"its {CONFIG_FILE} is neither a difftx nor a Hugging Face model config"))
    if (dst / MODULES_FILE).is_file():
        return
    raise DifftxError(refuse.format(why=f"no {CONFIG_FILE} or {MODULES_FILE}"))


def run(args) -> int:
    import torch

    from ..interop.convert import check_options, convert, detect_format

    src, dst = Path(args.src), Path(args.dst)
    if args.depth is not None and args.depth < 0:
        raise DifftxError(f"--depth must be >= 0 (0-based layer index); got {args.depth}")
    # options that contradict one another are named before DST is looked at (a full DST hid them)
    check_options(args.dst_format, pairing=args.pairing, rope_style=args.rope_style, diff_init=args.diff_init)
    if dst.exists() and not dst.is_dir():
        raise DifftxError(f"{dst}: exists and is not a directory")
    _check_dst_path(dst)
    if dst.is_dir() and any(dst.iterdir()) and not args.force:
        raise DifftxError(f"{dst}: directory is not empty; pick a new one or pass --force to overwrite")
    if dst.exists() and dst.resolve() == src.resolve():
        raise DifftxError(f"{dst}: the destination is the source; pick another directory")
    if args.force and dst.is_dir() and dst.resolve() in src.resolve().parents:
        raise DifftxError(f"{dst}: holds the source {src}, and --force replaces DST as a whole, which would delete "
                          "the source; pick another DST (nothing was changed)")
    detected = detect_format(src)
    if args.verify and detected == "unilm":  # before anything is written
        raise DifftxError("--verify compares whole models; unilm files hold attention modules (drop --verify)")
    # --force over a model: convert into a new directory beside it, and replace DST only once that succeeded
    target = dst
    if args.force and dst.is_dir() and any(dst.iterdir()):
        _check_overwritable(dst)
        target = Path(tempfile.mkdtemp(prefix=f".{dst.name}.converting-", dir=dst.parent))
    new = []  # the directories that writing DST creates (it and its missing parents), deepest first
    path = dst
    while not path.exists() and not path.is_symlink() and path != path.parent:
        new.append(path)
        path = path.parent
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        convert(src, target, args.src_format, args.dst_format, pairing=args.pairing, rope_style=args.rope_style,
                diff_init=args.diff_init, dtype=dtype, depth=args.depth, variant=args.unilm_variant)
    except BaseException:
        # a convert that failed or was interrupted midway (Ctrl-C, a full disk while the tokenizer was copied) left
        # a model without its tokenizer, or with a truncated one: DST goes back to what it was (none, or empty)
        if target != dst:
            shutil.rmtree(target, ignore_errors=True)
        elif new:
            shutil.rmtree(dst, ignore_errors=True)
            for d in new[1:]:
                try:
                    d.rmdir()
                except OSError:
                    break
        elif dst.is_dir():  # empty before (a DST holding anything was refused, or converted into ``target``)
            for p in list(dst.iterdir()):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise
    if target != dst:
        from ..io import _signals_held

        old = dst.with_name(f".{dst.name}.replaced-{os.getpid()}")
        with _signals_held():  # Ctrl-C between the two renames left no DST (the earlier model hidden as OLD)
            os.rename(dst, old)
            os.rename(target, dst)
            shutil.rmtree(old, ignore_errors=True)
    to = args.dst_format or "difftx"
    print(f"converted {src} ({detected}) -> {dst} ({to if detected != 'unilm' else 'difftx attention modules'})")
    if args.verify:
        import sys

        try:
            line, ok = _verify(src, dst, args.diff_init, args.dtype)
        except _TransformersCannotRead as e:
            print(f"difftx convert: verification failed: {e} (the result, kept for inspection); please report it "
                  "with both models' config.json", file=sys.stderr)
            return 1
        print(line)
        if not ok:
            print(f"difftx convert: verification failed: the result in {dst} does not compute the source's logits "
                  "(kept for inspection); please report it with both models' config.json", file=sys.stderr)
            return 1
    return 0

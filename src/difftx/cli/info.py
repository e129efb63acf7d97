"""``difftx info``: what a preset or config costs, counted without allocating any weights."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError, DifftxError


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="parameters, FLOPs per token and KV-cache bytes of a preset or config",
                       description="Count parameters (on the meta device), FLOPs per token (DIFF's two maps "
                                   "included) and KV-cache bytes per token for a preset, a config JSON or a "
                                   "model directory.")
    p.add_argument("preset", nargs="?", help="preset name, config .json file or model directory")
    p.add_argument("--list", action="store_true", help="list preset names and exit (with --json at most)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--attention", choices=["softmax", "diff", "diff2"],
                   help="convert the preset to its matched twin of this attention kind")
    p.add_argument("--norms", help="norm placement preset (S1..S5, dnt, post)")
    p.add_argument("--seq-len", type=int, help="sequence length for FLOPs (default: max_seq_len)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field (repeatable), e.g. --set n_layers=4")
    p.set_defaults(func=run)


def parse_overrides(items: list[str], flag: str = "--set") -> dict:
    """FIELD=VALUE strings (of option ``flag``) -> dict, values parsed as JSON when possible (numbers,
    true/false, null)."""
    out = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise DifftxError(f"{flag} expects FIELD=VALUE, got {item!r}")
        if k.strip() in out:  # --set n_layers=2 --set n_layers=4 silently dropped the first
            raise DifftxError(f"{flag} sets {k.strip()} twice ({k.strip()}={out[k.strip()]!r} and {item.strip()!r}); "
                              "give it once")
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def resolve_config(name: str, overrides: dict):
    from ..config import ModelConfig
    from ..io import read_model_config

    path = Path(name)
    if path.suffix == ".json" and not path.is_file():
        raise DifftxError(f"{path}: config file not found; give an existing .json, a model directory or a preset "
                          "name (difftx info --list)")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DifftxError(f"{path}: not valid JSON ({e}); give a ModelConfig JSON object") from None
        if isinstance(data, dict) and "model" in data:
            data = data["model"]
        if not isinstance(data, dict):
            raise DifftxError(f"{path}: expected a JSON object of ModelConfig fields (or one under 'model'), "
                              f"got {json.dumps(data)[:40]}")
        cfg = ModelConfig.from_dict(data)
    elif path.is_dir():
        cfg = read_model_config(path)
    else:
        return ModelConfig.from_preset(name, **overrides)
    attention = overrides.pop("attention", None)
    if attention and attention != cfg.attention and "n_heads" not in overrides:
        cfg, overrides = cfg.twin_with(attention, overrides)
    elif attention is not None:  # with n_heads given: the kind as it is (ModelConfig.from_preset does the same)
        overrides["attention"] = attention
    return cfg.replace(**overrides) if overrides else cfg


def describe(cfg, seq_len: int | None = None) -> dict:
    from ..accounting import count_parameters, flops_per_token, kv_cache_bytes_per_token, training_memory_floor

    tokens = cfg.n_patches + (cfg.pooling == "cls")
    if seq_len and cfg.domain == "vision" and seq_len != tokens:
        raise ConfigError("--seq-len", f"a vision model runs on its {tokens} tokens (patches"
                                       f"{' + CLS' if cfg.pooling == 'cls' else ''}), not {seq_len}; leave it out")
    if seq_len and seq_len > cfg.max_seq_len and cfg.domain == "lm" and cfg.positions in ("learned", "sinusoidal"):
        raise ConfigError("--seq-len", f"{seq_len} exceeds max_seq_len {cfg.max_seq_len}, where the model's "
                                       f"{cfg.positions} positions end; raise max_seq_len (--set) or shorten it")
    seq = seq_len or (cfg.max_seq_len if cfg.domain == "lm" else tokens)
    return {
        "preset": cfg.preset,
        "attention": cfg.attention,
        "domain": cfg.domain,
        "params": count_parameters(cfg),
        "non_embedding_params": count_parameters(cfg, non_embedding=True),
        "seq_len": seq,
        "flops_per_token": flops_per_token(cfg, seq),
        "train_flops_per_token": flops_per_token(cfg, seq, training=True),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg) if cfg.domain == "lm" else 0,
        "kv_cache_dtype_bytes": 2,
        "train_memory_floor": _memory_floor(training_memory_floor(cfg, 1, seq),
                                            training_memory_floor(cfg, 1, seq, activation_checkpointing=1)),
        "config": cfg.to_dict(),
    }


def _memory_floor(one: dict, recomputing: dict) -> dict:
    """The training-memory floor of one sequence (AdamW, fp32) as state + max(gradients, batch x activations); the
    activations also with every block recomputed in backward (--activation-checkpointing 1)."""
    return {"optimizer": "adamw", "dtype": "fp32", "state_bytes": one["state"], "gradient_bytes": one["gradients"],
            "activation_bytes_per_sequence": one["activations"],
            "activation_bytes_per_sequence_recomputing": recomputing["activations"]}


def norms_label(cfg) -> str:
    """The norm placement: its preset's name and the flags set apart from it, e.g. ``S1 + post_norm - qk_norm``."""
    from ..config import NORM_FLAGS, NORM_PRESETS

    preset = NORM_PRESETS[cfg.norms]
    differ = [f for f in NORM_FLAGS if getattr(cfg, f) != preset.get(f, False)]
    return cfg.norms + "".join(f" {'+' if getattr(cfg, f) else '-'} {f}" for f in differ)


def _human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    return f"{n / 2 ** 30:,.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def run(args) -> int:
    from ..presets import PRESETS

    if args.list:
        given = [flag for flag, value in (("PRESET", args.preset), ("--attention", args.attention),
                                          ("--norms", args.norms), ("--seq-len", args.seq_len), ("--set", args.set))
                 if value not in (None, [])]
        if given:
            raise DifftxError(f"--list lists the preset names only and reads no {given[0]}; drop it (or drop --list "
                              "to describe one model)")
        if args.json:
            print(json.dumps([{"name": p.name, "group": p.group, "description": p.description}
                              for p in PRESETS.values()], indent=2))
        else:
            width = max(len(n) for n in PRESETS)
            group = None
            for p in PRESETS.values():
                if p.group != group:
                    group = p.group
                    print(f"[{group}]")
                print(f"  {p.name:<{width}}  {p.description}")
        return 0
    if not args.preset:
        raise DifftxError("give a preset name (see `difftx info --list`), a config .json or a model directory")
    overrides = parse_overrides(args.set)
    for field, value in (("attention", args.attention), ("norms", args.norms)):
        if value:
            if field in overrides:  # the flag silently replaced the --set value
                raise DifftxError(f"--{field} {value} and --set {field}={overrides[field]} both set {field}; "
                                  "give it once")
            overrides[field] = value
    if args.seq_len is not None and args.seq_len <= 0:
        raise ConfigError("--seq-len", f"must be positive; got {args.seq_len}")
    try:
        cfg = resolve_config(args.preset, overrides)
    except TypeError as e:
        raise DifftxError(str(e)) from None
    info = describe(cfg, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{cfg.preset or args.preset}: {cfg.attention} attention, {cfg.domain}, norms {norms_label(cfg)}")
    print(f"  parameters               {info['params']:>16,}  ({_human(info['params'])})")
    print(f"  non-embedding parameters {info['non_embedding_params']:>16,}")
    print(f"  FLOPs/token (forward)    {info['flops_per_token']:>16,}  at seq_len {info['seq_len']}")
    print(f"  FLOPs/token (training)   {info['train_flops_per_token']:>16,}")
    if cfg.domain == "lm":
        print(f"  KV cache bytes/token     {info['kv_cache_bytes_per_token']:>16,}  (2-byte elements)")
    mem = info["train_memory_floor"]
    print(f"  training memory, AdamW fp32  >= {_bytes(mem['state_bytes'])} + max({_bytes(mem['gradient_bytes'])}, "
          f"batch x {_bytes(mem['activation_bytes_per_sequence'])})  (a floor, docs/training.md)")
    print(f"    recomputing every block    >= {_bytes(mem['state_bytes'])} + max({_bytes(mem['gradient_bytes'])}, "
          f"batch x {_bytes(mem['activation_bytes_per_sequence_recomputing'])})  (--activation-checkpointing 1)")
    print("  config:")
    for k, v in cfg.to_dict().items():
        print(f"    {k} = {v!r}")
    return 0

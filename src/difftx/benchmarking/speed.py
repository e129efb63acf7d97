"""Side-by-side speed and memory of matched-parameter models, in one process (``difftx bench``).

Arms: our Transformer, DIFF, DIFF V2, DNT and DIFF inside DNT, all the matched twins of one
preset (``ModelConfig.from_preset(preset, attention=..., norms=...)``), and, when transformers
is installed, its Llama and DiffLlama built locally at the same shapes (no downloads).

Phases, each per dtype (fp32, bf16 autocast):
* ``train``: forward, backward and an AdamW step on (batch, seq_len) tokens;
* ``prefill``: a no-grad forward of the same tokens;
* ``decode``: greedy decoding of ``decode_tokens`` tokens after a prompt of
  ``seq_len - decode_tokens``, with the KV cache (the prompt's prefill is not timed).

``compile``: every arm's forward (peers' too) goes through ``torch.compile`` for training and prefill, compiled in
the untimed warmup runs (at least one); decoding stays eager (each step's cache length would be a new shape).

Repeats are interleaved (A B C, B C A, ... so no arm always runs first) and medians
reported, with ratios to our Transformer (and to the transformers peers): a speed ratio is
the median over repeats of the two arms' times in that repeat (:func:`speed_ratio`), its
range over the repeats in ``ratio_spread_by_dtype``.  With both fp32 and bf16, a last training phase
alternates the two dtypes step by step for each of our arms (``dtype_ratios``: bf16 over fp32 tokens/s,
robust to a machine whose speed drifts between the dtypes' phases, which run minutes apart).  Achieved FLOP/s
use :func:`difftx.accounting.flops_per_token` (the model's FLOPs: DIFF's attention counted as its
Transformer twin's, whatever a formulation does beyond them is not credited) and are compared to the matmul peak measured in the
same run: for training, the peak measured again at the start of each repeat (the share is the
median over repeats of step FLOP/s over that repeat's peak); ``share_of_run_peak`` is against
the best peak of the whole run.  Peak training memory on the CPU is the high-water mark of live tensor bytes
recorded by ``torch.profiler`` over one step, plus the parameters, gradients-to-be and
optimiser state already held (on CUDA: ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import inspect
import operator
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..accounting import flops_per_token, kv_cache_bytes_per_token
from ..config import ModelConfig
from ..errors import ConfigError
from ..models import build_model
from ..optim import build_optimizer
from ..runtime import SLOW_BF16, keep_freed_memory, keeps_threads, native_bf16_matmul, resolve_device
from .memory import peak_live_bytes

ARMS = {  # name -> ModelConfig.from_preset overrides (the matched twins of the preset, whatever its own kind)
    "transformer": {"attention": "softmax"},
    "diff": {"attention": "diff"},
    "diff2": {"attention": "diff2"},
    "dnt": {"attention": "softmax", "norms": "dnt"},
    "diff-dnt": {"attention": "diff", "norms": "dnt"},
}
PEERS = {"hf-llama": "transformer", "hf-diffllama": "diff"}  # peer -> the arm whose shapes it copies
PHASES = ("train", "prefill", "decode")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class BenchConfig:
    preset: str = "small"
    seq_len: int = 512
    batch_size: int = 4
    repeats: int = 5
    warmup: int = 1
    dtypes: list = field(default_factory=lambda: ["auto"])  # auto: fp32, and bf16 where matmuls run it natively
    arms: list = field(default_factory=lambda: list(ARMS))
    peers: bool = True
    phases: list = field(default_factory=lambda: list(PHASES))
    decode_tokens: int = 32
    decode_batch: Optional[int] = None  # default: batch_size
    timer: str = "wall"  # wall | cpu (process CPU time: robust ratios on a shared machine)
    threads: Optional[int] = None
    device: str = "cpu"
    memory: bool = True
    fused_adamw: Optional[bool] = None  # None: build_optimizer's default (fused); False: foreach, for every arm
    compile: bool = False  # torch.compile every arm's forward for training and prefill (decoding stays eager)
    diff_attention: str = "auto"  # the DIFF arms' (diff, diff-dnt) formulation (nn.backends.DIFF_SDPA_VARIANTS)
    seed: int = 0

    def validate(self) -> None:
        from ..presets import PRESETS

        if self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; see `difftx info --list`")
        domain = ModelConfig.from_preset(self.preset).domain
        if domain != "lm":
            raise ConfigError("preset", f"{self.preset!r} is a {domain} preset; bench needs a language-model preset "
                                        "(e.g. nano, small; see `difftx info --list`)")
        self.device = str(resolve_device(self.device))  # cpu, cuda or cuda:N (auto resolved)
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ConfigError("arms", f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
        twice = next((a for i, a in enumerate(self.arms) if a in self.arms[:i]), None)
        if twice is not None:  # it ran twice into one row: two timings per repeat under one name
            raise ConfigError("arms", f"{twice!r} given twice; give each arm once")
        if "transformer" not in self.arms:
            raise ConfigError("arms", "the arms must include 'transformer' (every ratio is relative to it)")
        from ..nn.backends import DIFF_SDPA_VARIANTS

        if self.diff_attention not in DIFF_SDPA_VARIANTS:
            raise ConfigError("diff_attention", f"unknown DIFF attention formulation {self.diff_attention!r}; choose "
                                                f"from {', '.join(DIFF_SDPA_VARIANTS)}")
        if self.diff_attention != "auto" and not {"diff", "diff-dnt"} & set(self.arms):
            raise ConfigError("diff_attention", f"{self.diff_attention!r} is for the diff and diff-dnt arms, and "
                                                "--arms has neither; add one, or drop the formulation")
        bad = [d for d in self.dtypes if d not in DTYPES and d != "auto"]
        if bad:
            raise ConfigError("dtypes", f"unknown dtype(s) {', '.join(bad)}; choose from auto, {', '.join(DTYPES)}")
        if not self.dtypes:
            raise ConfigError("dtypes", "give at least one of auto, " + ", ".join(DTYPES))
        bad = [p for p in self.phases if p not in PHASES]
        if bad:
            raise ConfigError("phases", f"unknown phase(s) {', '.join(bad)}; choose from {', '.join(PHASES)}")
        if not self.phases:
            raise ConfigError("phases", "give at least one of " + ", ".join(PHASES))
        for name in ("seq_len", "batch_size", "repeats", "decode_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError("warmup", f"must be 0 or more, got {self.warmup}")
        if self.compile and self.warmup < 1 and {"train", "prefill"} & set(self.phases):
            raise ConfigError("warmup", "must be at least 1 with compile: the first run of each phase compiles, and "
                                        "would be timed")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"must be at least 1, got {self.threads}")
        if "decode" in self.phases and self.decode_tokens >= self.seq_len:
            raise ConfigError("decode_tokens", f"must be smaller than seq_len ({self.seq_len}): the prompt "
                                               f"is seq_len - decode_tokens tokens")
        if self.timer not in ("wall", "cpu"):
            raise ConfigError("timer", f"must be 'wall' or 'cpu', got {self.timer!r}")
        if self.timer == "cpu" and self.device != "cpu":  # the GPU's asynchronous work is not the process's CPU time
            raise ConfigError("timer", f"'cpu' (process CPU time) does not see the work of {self.device}, whose "
                                       "kernels run asynchronously; use --timer wall there")

    def check_seq_len(self) -> None:
        """A ConfigError unless the preset's positions reach ``seq_len`` (learned or sinusoidal positions stop at
        max_seq_len).  The side-by-side runs only (--long-context times attention alone, at its own lengths);
        the CLI checks it before --out is made."""
        base = ModelConfig.from_preset(self.preset)
        if self.seq_len > base.max_seq_len and base.positions in ("learned", "sinusoidal"):
            raise ConfigError("seq_len", f"{self.seq_len} exceeds the preset's max_seq_len {base.max_seq_len}")

    def check_memory(self) -> None:
        """InsufficientMemory, one line, when the side-by-side run's floor cannot fit in the device's free memory
        (the rule of the training check, :mod:`difftx.train.memory_check`; ``DIFFTX_MEMORY_CHECK=0`` skips it): every
        arm's fp32 weights, the batch's int64 inputs and targets, and one arm's fp32 logits of the batch (its train
        step and its prefill compute them all; decoding, its prompt's).  A --seq-len or --batch-size of 10**11
        crashed with torch's allocator error as a traceback.  Call after :meth:`validate`."""
        from ..accounting import count_parameters
        from ..train import memory_check

        if not memory_check.enabled():  # skips building the arms' configs too
            return
        base = ModelConfig.from_preset(self.preset)
        cfgs = [ModelConfig.from_preset(self.preset, max_seq_len=max(base.max_seq_len, self.seq_len), **ARMS[a])
                for a in self.arms]
        weights = 4 * sum(count_parameters(c) for c in cfgs)
        tokens = self.batch_size * self.seq_len
        scored = tokens if {"train", "prefill"} & set(self.phases) else \
            (self.decode_batch or self.batch_size) * (self.seq_len - self.decode_tokens)
        need = weights + 16 * tokens + 4 * scored * max(c.vocab_size for c in cfgs)
        memory_check.require_bytes(need, self.device, f"the {len(cfgs)} arms' fp32 weights ({memory_check.gib(weights)}"
                                                      f"), a batch of {self.batch_size:,} x {self.seq_len:,} tokens "
                                                      "and its logits",
                                   "lower --batch-size or --seq-len (or give fewer --arms)")


def resolve_dtypes(dtypes: list, device: torch.device) -> list:
    """``auto`` -> fp32, plus bf16 where the device multiplies bf16 in hardware
    (:func:`difftx.runtime.native_bf16_matmul`); explicit names stay, in order, once each."""
    out: list = []
    for d in dtypes:
        for name in (["fp32"] + (["bf16"] if native_bf16_matmul(device) else [])) if d == "auto" else [d]:
            if name not in out:
                out.append(name)
    return out


QUICK = dict(preset="nano", seq_len=32, batch_size=2, repeats=1, warmup=1, decode_tokens=4, threads=1)


# ----------------------------------------------------------------------------- arms
class Arm:
    """One model behind a uniform interface: loss, logits, decoding, its KV cache size."""

    def __init__(self, name: str, model: torch.nn.Module, cfg: ModelConfig, peer: bool,
                 fused_adamw: Optional[bool] = None, compile: bool = False):
        self.name, self.model, self.cfg, self.peer = name, model, cfg, peer
        # the forward of training and prefill: compiled, or the model itself (decode always calls the model)
        self.forward = torch.compile(model) if compile else model
        self.optimizer = build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.1, fused=fused_adamw)
        self.params = sum(p.numel() for p in model.parameters())

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.forward(ids) if not self.peer else self.forward(input_ids=ids, use_cache=False)
        return out.logits

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ids)  # the same loss for every arm: fp32 cross-entropy over all positions
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def decode(self, prompt: torch.Tensor, n_new: int, timer: Callable[[], float]) -> tuple[float, float]:
        """Greedy decoding of ``n_new`` tokens after ``prompt``; returns (seconds, KV bytes per token)."""
        b, n = prompt.shape
        if not self.peer:
            cache = self.model.new_cache(b, n + n_new)
            logits = self.model(prompt, cache=cache).logits
            t0 = timer()
            for _ in range(n_new):
                tok = logits[:, -1:].argmax(-1)
                logits = self.model(tok, cache=cache).logits
            elapsed = timer() - t0
            return elapsed, cache.bytes() / (b * cache.length)
        # transformers 5.24 renamed the cache argument and output field past_key_values -> cache
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=prompt, use_cache=True)
        past, logits = out[name], out.logits
        t0 = timer()
        for _ in range(n_new):
            tok = logits[:, -1:].argmax(-1)
            out = self.model(input_ids=tok, use_cache=True, **{name: past})
            past, logits = out[name], out.logits
        elapsed = timer() - t0
        return elapsed, _hf_cache_bytes(past) / (b * (n + n_new))


def _hf_cache_bytes(past) -> int:
    total = 0
    layers = getattr(past, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
    for kv in past:  # legacy tuple of (k, v)
        total += sum(t.numel() * t.element_size() for t in kv)
    return total


def _hf_model(peer: str, cfg: ModelConfig):
    """transformers' Llama / DiffLlama at ``cfg``'s shapes (our DIFF twin's 2h component heads = its heads)."""
    import transformers

    heads = cfg.n_heads * (2 if cfg.attention == "diff" else 1)
    kv = cfg.n_kv_heads * (2 if cfg.attention == "diff" else 1)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=heads, num_key_value_heads=kv,
                  head_dim=cfg.head_dim, max_position_embeddings=max(cfg.max_seq_len, 64),
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias)
    if peer == "hf-llama":
        conf = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        conf = transformers.DiffLlamaConfig(**common)
        cls = transformers.DiffLlamaForCausalLM
    conf._attn_implementation = "sdpa"
    return cls(conf)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
        return hasattr(transformers, "DiffLlamaForCausalLM")
    except Exception:
        return False


def peers_match(cfg: ModelConfig) -> bool:
    """Whether transformers' Llama / DiffLlama can take ``cfg``'s shapes: a LLaMA-shaped preset (pre-norm
    RMSNorm, SwiGLU, rotary positions rotating halves, no biases).  GPT-2-style presets (GELU MLP, learned
    positions) get no peers: theirs would be other models, not the same shapes."""
    return (cfg.ffn == "swiglu" and cfg.positions == "rope" and cfg.rope_style == "half" and cfg.norm == "rms"
            and cfg.norms == "S1" and not cfg.bias and not cfg.qkv_bias)


def build_arms(bc: BenchConfig, device: torch.device, log: Callable[[str], None] = print) -> list[Arm]:
    arms = []
    base = ModelConfig.from_preset(bc.preset)
    bc.check_seq_len()
    for name in bc.arms:
        torch.manual_seed(bc.seed)
        cfg = ModelConfig.from_preset(bc.preset, max_seq_len=max(base.max_seq_len, bc.seq_len), **ARMS[name])
        model = build_model(cfg).to(device)
        if cfg.attention == "diff" and bc.diff_attention != "auto":  # DIFF V1 arms; the others keep their own
            model.set_attention_backend(cfg.attn_backend, bc.diff_attention)
        arms.append(Arm(name, model, cfg, peer=False, fused_adamw=bc.fused_adamw, compile=bc.compile))
    if bc.peers and transformers_available() and peers_match(base):
        for peer, twin in PEERS.items():
            cfg = ModelConfig.from_preset(bc.preset, max_seq_len=max(base.max_seq_len, bc.seq_len), **ARMS[twin])
            torch.manual_seed(bc.seed)
            try:
                model = _hf_model(peer, cfg).to(device)
            except Exception as e:  # a transformers version whose model API moved: the bench goes on without it
                log(f"difftx bench: warning: transformers' {peer} could not be built here ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:160] if str(e) else ''}); left out of this run")
                continue
            arms.append(Arm(peer, model, cfg, peer=True, fused_adamw=bc.fused_adamw, compile=bc.compile))
    return arms


# ----------------------------------------------------------------------------- measurement
def _timer(kind: str, device: torch.device) -> Callable[[], float]:
    if kind == "cpu":
        return time.process_time
    if device.type == "cuda":
        def t():
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return t
    return time.perf_counter


def _autocast(dtype: str, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=(dtype == "bf16"))


PEAK_BUDGET_S = 0.5  # the peak's matmul size grows (x2) only while one matmul of the next size fits in this
CUDA_INNER = 10  # products per timed sample on a GPU


def matmul_peak(dtype: torch.dtype, device: torch.device, n: Optional[int] = None, repeats: int = 5,
                timer: Optional[Callable[[], float]] = None, workers: int = 1) -> float:
    """Best FLOP/s over square matmuls of 256, 512, ... up to n x n x n in ``dtype`` (the machine's practical
    matmul peak); n defaults to 2048 on a CPU and 8192 on a GPU, where each timed sample is CUDA_INNER
    products back to back (one product of 2048^3 takes ~20 us on an H100: shorter than a synchronisation).

    Every size is timed (its best of ``repeats``, after one untimed call, with each GEMM of
    :func:`_peak_products`) and the fastest size counts: which
    size that is depends on the machine and the thread count.  Measured on a 2-core Xeon with AMX in bf16: on
    one thread 1024^3 ran at 1.38-1.46 TFLOP/s against 1.22-1.27 for 2048^3, on two threads 2048^3 at
    2.25-2.47 against 1.50 for 1024^3 (about its one-thread rate).  A peak read at one size only
    would flatter the share of a step run on one thread by 10-15%.

    With ``workers`` > 1 (a CPU; ``difftx bench`` passes its thread count when it times wall clock), every
    size is also timed as ``workers`` one-thread matmuls at once (:func:`_concurrent_matmul_time`), and the
    better rate counts: on that Xeon two one-thread 1024^3 products at once ran at 2.87 TFLOP/s, where
    torch's one two-thread product reached 2.1-2.7.  The cores' peak is what a step is compared with, not
    one GEMM's threading.  Only with a wall clock: Linux's process CPU clock counts another running
    thread's time only at its scheduler ticks, so CPU-time readings of millisecond spans on several
    threads come out short (two one-thread 1024^3 products read 1.85 TFLOP/s per CPU-second, more than
    one core does).

    The size doubles only while one matmul of the next size is expected to take under PEAK_BUDGET_S: on
    hardware without bf16 matmul units (:func:`difftx.runtime.native_bf16_matmul`) a bf16 2048^3 matmul
    takes ~15 s instead of ~0.03, and the peak is then read at 512 and below.
    """
    timer = timer or _timer("wall", device)
    gpu = device.type != "cpu"
    n = n or (8192 if gpu else 2048)
    inner = CUDA_INNER if gpu else 1
    mm = _peak_products(dtype, device)
    size, rate, seconds = 256, 0.0, {}
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = float("inf")
        for product in mm:
            product(a, b)
            for _ in range(max(1, repeats)):
                t0 = timer()
                for _ in range(inner):
                    product(a, b)
                best = min(best, (timer() - t0) / inner)
        rate, seconds[size] = max(rate, 2 * size ** 3 / max(best, 1e-9)), best
        if size >= n or 8 * best > PEAK_BUDGET_S:  # one matmul of the next size: 8x the work
            break
        size *= 2
    if workers > 1:
        for size, best in seconds.items():
            if 8 * best > PEAK_BUDGET_S:  # a slow size (the last one reached): k one-thread ones take ~k x as long
                continue
            per_round = max(1, min(1000, int(0.005 / max(best, 1e-9))))  # rounds of >= ~5 ms
            for product in mm:
                each = _concurrent_matmul_time(dtype, size, workers, repeats, timer, per_round, product)
                rate = max(rate, workers * 2 * size ** 3 / max(each, 1e-9))
    return rate


def _peak_products(dtype: torch.dtype, device: torch.device) -> list:
    """The GEMMs a peak is read from: torch's ``a @ b``, and in float32 on a CPU where difftx runs its float32
    products on oneDNN (:data:`difftx.nn.linear.ONEDNN_FP32`) that product too, a @ b as x W^T with W = b^T: the
    peak is the best the machine gives either, so a step on the faster one is not read against the slower's."""
    from ..nn import linear

    products = [operator.matmul]  # a @ b
    if dtype == torch.float32 and device.type == "cpu" and linear.ONEDNN_FP32:
        products.append(lambda a, b: linear._onednn(a, b.t()))
    return products


def _concurrent_matmul_time(dtype: torch.dtype, size: int, workers: int, repeats: int,
                            timer: Callable[[], float], per_round: int = 1,
                            product: Callable = operator.matmul) -> float:
    """Best time per matmul of ``workers`` size^3 CPU matmuls run at once, each on its own Python thread with
    torch on one intra-op thread (torch's thread count is set to 1 for the measurement and restored after).

    A timed round starts before the workers are released and ends when the last one is done, so waking the
    threads counts against the rate; each worker runs ``per_round`` matmuls a round, for that to be small.
    An error in a worker breaks the barriers and is raised here."""
    import threading

    threads_before = torch.get_num_threads()
    # a round takes well under a second (sizes whose one matmul fits the budget): 60 s means a stuck thread
    go, done = threading.Barrier(workers + 1, timeout=60), threading.Barrier(workers + 1, timeout=60)
    rounds = max(1, repeats) + 1  # the first round is untimed
    errors: list = []

    def work() -> None:
        try:
            a = torch.randn(size, size).to(dtype)
            b = torch.randn(size, size).to(dtype)
            for _ in range(rounds):
                go.wait()
                for _ in range(per_round):
                    product(a, b)
                done.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # handed to the caller
            errors.append(e)
            go.abort()
            done.abort()

    torch.set_num_threads(1)
    pool = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    best = float("inf")
    try:
        for t in pool:
            t.start()
        for r in range(rounds):
            t0 = timer() if r else 0.0
            go.wait()
            done.wait()
            if r:
                best = min(best, (timer() - t0) / per_round)
    except threading.BrokenBarrierError:
        if errors:
            raise errors[0] from None
        raise
    finally:
        go.abort()  # releases the workers if the caller stopped early (an interrupt)
        done.abort()
        for t in pool:
            t.join()
        torch.set_num_threads(threads_before)
    return best


def _train_step(arm: Arm, x, y, dtype: str, device) -> None:
    with _autocast(dtype, device):
        loss = arm.loss(x, y)
    loss.backward()
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)


def _prefill(arm: Arm, x, dtype: str, device) -> None:
    with torch.no_grad(), _autocast(dtype, device):
        arm.logits(x)


def peak_train_memory(arm: Arm, x, y, dtype: str, device) -> dict:
    """Bytes: ``state`` (parameters + optimiser state held between steps), ``step`` (the high-water
    mark of tensor bytes allocated during one step: activations, gradients, temporaries), total."""
    state = sum(p.numel() * p.element_size() for p in arm.model.parameters())
    for st in arm.optimizer.state.values():
        state += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    step, method = peak_live_bytes(lambda: _train_step(arm, x, y, dtype, device), device)
    return {"state_bytes": state, "step_bytes": step, "total_bytes": state + step, "method": method}


def _interleaved(arms: list, repeats: int, warmup: int, run: Callable, timer,
                 before_repeat: Optional[Callable[[], None]] = None, failed: Optional[dict] = None) -> dict:
    """{arm name: [seconds, ...]}: warmup each, then repeats in rotating order (A B C, B C A, ...);
    ``before_repeat`` runs at the start of every repeat.  A transformers peer that raises is taken out of
    ``arms`` (in place) and its error kept in ``failed`` (name -> one line); our own arms' errors propagate."""
    failed = {} if failed is None else failed

    def attempt(arm):
        try:
            return run(arm)
        except Exception as e:  # noqa: BLE001 -- a peer's API moved under us: leave it out, not the bench
            if not arm.peer:
                raise
            failed[arm.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
            arms.remove(arm)
            return None

    for arm in list(arms):
        for _ in range(warmup):
            if arm in arms:
                attempt(arm)
    times = {arm.name: [] for arm in arms}
    for r in range(repeats):
        if before_repeat is not None:
            before_repeat()
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for arm in order:
            t0 = timer()
            extra = attempt(arm)
            if arm in arms:
                times[arm.name].append(extra if extra is not None else timer() - t0)
    return {name: t for name, t in times.items() if name not in failed}


@keeps_threads
def run_bench(bc: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every phase for every dtype and arm; returns the results dictionary (see module doc)."""
    bc.validate()
    keep_freed_memory()  # every arm, the peers included, runs under the same allocator setting
    if bc.threads:
        torch.set_num_threads(bc.threads)
    device = torch.device(bc.device)
    bc.dtypes = resolve_dtypes(bc.dtypes, device)
    if "bf16" in bc.dtypes and not native_bf16_matmul(device):
        log(f"difftx bench: warning: {SLOW_BF16}")
    timer = _timer(bc.timer, device)
    torch.manual_seed(bc.seed)
    arms = build_arms(bc, device, log)
    if bc.peers and transformers_available() and not peers_match(ModelConfig.from_preset(bc.preset)):
        log(f"difftx bench: no transformers peers for preset {bc.preset}: Llama / DiffLlama are LLaMA-shaped "
            "(SwiGLU, rotary positions, RMSNorm), this preset is not")
    b, n = bc.batch_size, bc.seq_len
    x = torch.randint(0, arms[0].cfg.vocab_size, (b, n), device=device)
    y = torch.randint(0, arms[0].cfg.vocab_size, (b, n), device=device)
    db = bc.decode_batch or b
    prompt = x[:db, : n - bc.decode_tokens] if db <= b else torch.randint(
        0, arms[0].cfg.vocab_size, (db, n - bc.decode_tokens), device=device)
    log(f"difftx bench: {len(arms)} arms ({', '.join(a.name for a in arms)}), preset {bc.preset}, "
        f"batch {b} x {n} tokens, {bc.repeats} interleaved repeats, {torch.get_num_threads()} threads"
        + (", compiled (training and prefill; the warmup compiles)" if bc.compile else ""))

    # the cores' peak: k one-thread matmuls at once count too, where they can be timed (wall clock, a CPU)
    workers = torch.get_num_threads() if device.type == "cpu" and bc.timer == "wall" else 1
    peaks = {dt: matmul_peak(DTYPES[dt], device, timer=timer, workers=workers) for dt in bc.dtypes}

    results: dict = {"arms": {}, "matmul_peak_flops": peaks}
    for arm in arms:
        results["arms"][arm.name] = {"params": arm.params, "peer": arm.peer, "config": arm.cfg.to_dict()
                                     if not arm.peer else arm.model.config.to_dict(), "by_dtype": {}}
    all_arms, failed = list(arms), {}

    def leave_out(what: str) -> None:  # peers that failed in this phase: warned once, out of the rest of the run
        for name, err in failed.items():
            if "failed" not in results["arms"][name]:
                results["arms"][name]["failed"] = {"phase": what, "error": err}
                log(f"difftx bench: warning: transformers' {name} failed in the {what} phase ({err}); left out "
                    "of the rest of the run")

    for dt in bc.dtypes:
        rows = {arm.name: results["arms"][arm.name]["by_dtype"].setdefault(dt, {}) for arm in arms}
        for arm in arms:
            arm.model.train()
        if "train" in bc.phases:
            log(f"  [{dt}] train ...")
            round_peaks: list = []  # the matmul peak again before every repeat: the share is paired with it
            times = _interleaved(arms, bc.repeats, bc.warmup, lambda a: _train_step(a, x, y, dt, device), timer,
                                 lambda: round_peaks.append(matmul_peak(DTYPES[dt], device, repeats=2, timer=timer,
                                                                       workers=workers)), failed)
            leave_out(f"{dt} train")
            results.setdefault("matmul_peak_by_repeat", {})[dt] = round_peaks
            for arm in arms:
                fpt = flops_per_token(arm.cfg, n, causal=True, training=True)
                rows[arm.name]["train"] = _speed(times[arm.name], b * n, fpt, round_peaks)
            if bc.memory:
                _interleaved(arms, 1, 0, lambda a: rows[a.name].update(memory=peak_train_memory(a, x, y, dt, device)),
                             timer, failed=failed)
                leave_out(f"{dt} memory")
        for arm in arms:
            arm.model.eval()
        if "prefill" in bc.phases:
            log(f"  [{dt}] prefill ...")
            times = _interleaved(arms, bc.repeats, bc.warmup, lambda a: _prefill(a, x, dt, device), timer,
                                 failed=failed)
            leave_out(f"{dt} prefill")
            for arm in arms:
                fpt = flops_per_token(arm.cfg, n, causal=True, training=False)
                rows[arm.name]["prefill"] = _speed(times[arm.name], b * n, fpt)
        if "decode" in bc.phases:
            log(f"  [{dt}] decode ...")
            kv = {}

            def dec(a):
                with torch.no_grad(), _autocast(dt, device):
                    seconds, kv[a.name] = a.decode(prompt, bc.decode_tokens, timer)
                return seconds

            times = _interleaved(arms, bc.repeats, bc.warmup, dec, timer, failed=failed)
            leave_out(f"{dt} decode")
            # the token at position p attends to p + 1 keys: the steps after a prompt of P tokens average
            # P + (decode_tokens + 1) / 2 (not rounded)
            context = prompt.shape[1] + (bc.decode_tokens + 1) / 2
            for arm in arms:
                fpt = flops_per_token(arm.cfg, context, causal=False, training=False)
                rows[arm.name]["decode"] = _speed(times[arm.name], db * bc.decode_tokens, fpt)
                rows[arm.name]["decode"]["kv_bytes_per_token"] = kv[arm.name]
                rows[arm.name]["decode"]["kv_bytes_per_token_accounting"] = kv_cache_bytes_per_token(
                    arm.cfg, 2 if dt == "bf16" else 4)
    if "train" in bc.phases and {"fp32", "bf16"} <= set(bc.dtypes):
        log("  [bf16 / fp32] train, the dtypes alternated ...")
        results["dtype_ratios"] = _dtype_pairs([a for a in arms if not a.peer], bc.repeats, bc.warmup,
                                               lambda a, dt: _train_step(a, x, y, dt, device), timer)
    for dt in bc.dtypes:  # the peak again at the end (the best of all): load on a shared machine drifts
        peaks[dt] = max([peaks[dt], matmul_peak(DTYPES[dt], device, timer=timer, workers=workers)]
                        + results.get("matmul_peak_by_repeat", {}).get(dt, []))
        log(f"  matmul peak {dt}: {peaks[dt] / 1e9:.1f} GFLOP/s")
        for arm in all_arms:
            for speed in results["arms"][arm.name]["by_dtype"][dt].values():
                if "achieved_flops" in speed:
                    speed["share_of_run_peak"] = speed["achieved_flops"] / peaks[dt]
                    if "share_of_matmul_peak" not in speed:  # phases without a peak per repeat
                        speed["share_of_matmul_peak"] = speed["share_of_run_peak"]
    results["ratio_spread_by_dtype"] = {dt: {} for dt in bc.dtypes}
    results["ratios_by_dtype"] = {dt: _ratios(results["arms"], dt, results["ratio_spread_by_dtype"][dt])
                                  for dt in bc.dtypes}
    results["ratios"] = _worst(results["ratios_by_dtype"])
    results["bench_config"] = asdict(bc)
    diff_heads = ModelConfig.from_preset(bc.preset, **ARMS["diff"]).n_heads
    results["environment"] = environment(device, bc.diff_attention,
                                         work=bc.batch_size * diff_heads * bc.seq_len * bc.seq_len)
    return results


def _dtype_pairs(arms: list, repeats: int, warmup: int, step: Callable, timer) -> dict:
    """{arm: {"bf16_over_fp32_train": median over repeats of t_fp32 / t_bf16, "range": [min, max], "seconds":
    {"fp32": [...], "bf16": [...]}}} for our arms: each repeat times one fp32 and one bf16 training step of every
    arm back to back (fp32 first in even repeats, bf16 first in odd ones; arms in rotating order), so a pair
    shares the machine's state where the per-dtype phases, run one after the other, do not (a VM whose matmul
    rate drifts between them moves their ratio)."""
    for arm in arms:
        arm.model.train()
        for _ in range(warmup):
            for dt in ("fp32", "bf16"):
                step(arm, dt)
    secs = {arm.name: {"fp32": [], "bf16": []} for arm in arms}
    for r in range(repeats):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            for dt in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32")):
                t0 = timer()
                step(arm, dt)
                secs[arm.name][dt].append(timer() - t0)
    out = {}
    for name, sec in secs.items():
        pairs = [a / b for a, b in zip(sec["fp32"], sec["bf16"])]
        out[name] = {"bf16_over_fp32_train": statistics.median(pairs), "range": [min(pairs), max(pairs)],
                     "seconds": sec}
    return out


def _speed(times: list, tokens: int, flops_per_tok: int, round_peaks: Optional[list] = None) -> dict:
    """Speed of one arm in one phase.  With ``round_peaks`` (the matmul peak measured at the start of
    each repeat), ``share_of_matmul_peak`` is the median over repeats of that repeat's FLOP/s over
    its own peak: the VM's matmul speed drifts within a run, and a step is compared with the peak
    of the same minute.  Otherwise (and as ``share_of_run_peak``, filled in at the end) it is
    against the best peak of the whole run."""
    med = statistics.median(times)
    tps = tokens / med
    out = {"seconds_median": med, "seconds": times, "tokens_per_s": tps, "flops_per_token": flops_per_tok,
           "achieved_flops": tps * flops_per_tok}
    if round_peaks and len(round_peaks) == len(times):
        out["share_of_matmul_peak"] = statistics.median(
            tokens * flops_per_tok / (t * pk) for t, pk in zip(times, round_peaks))
    return out  # else run_bench sets it at the end, against the run's best peak


def speed_ratio(seconds_a: list, seconds_b: list) -> float:
    """tokens/s of A over B at equal tokens: the median over repeats of t_B / t_A.

    Each repeat times every arm once, in rotating order, so a pair shares a stretch of the
    machine's state: a slow spell that hits one repeat of one arm moves one pair, where it would
    move a median of medians.  The ratio of the medians when the repeat counts differ.
    """
    if len(seconds_a) != len(seconds_b) or not seconds_a:
        return statistics.median(seconds_b) / statistics.median(seconds_a)
    return statistics.median(tb / ta for ta, tb in zip(seconds_a, seconds_b))


def _ratios(arms: dict, dt: str, spread: Optional[dict] = None) -> dict:
    """Speed, memory and KV ratios of the standard pairs; with ``spread``, also fills
    {key: [min, max]} of the per-repeat speed ratios."""
    def get(arm, *path):
        node = arms.get(arm, {}).get("by_dtype", {}).get(dt)
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    out = {}
    pairs = [("diff", "transformer"), ("diff2", "transformer"), ("dnt", "transformer"), ("diff-dnt", "dnt"),
             ("diff-dnt", "transformer"), ("diff", "hf-diffllama"), ("transformer", "hf-llama"),
             ("hf-diffllama", "hf-llama")]
    for a, b in pairs:
        key = f"{a}_over_{b}".replace("-", "_")
        for phase in PHASES:
            sa, sb = get(a, phase, "seconds"), get(b, phase, "seconds")
            if sa and sb:
                out[f"{key}_{phase}"] = speed_ratio(sa, sb)
                if spread is not None and len(sa) == len(sb):
                    pairs = [tb / ta for ta, tb in zip(sa, sb)]
                    spread[f"{key}_{phase}"] = [min(pairs), max(pairs)]
        ma, mb = get(a, "memory", "total_bytes"), get(b, "memory", "total_bytes")
        if ma and mb:
            out[f"{key}_memory"] = ma / mb
        ka, kb = get(a, "decode", "kv_bytes_per_token"), get(b, "decode", "kv_bytes_per_token")
        if ka and kb:
            out[f"{key}_kv_bytes"] = ka / kb
    return out


def _worst(by_dtype: dict) -> dict:
    """Per ratio, the least favourable dtype: the minimum speed ratio, the maximum memory / KV ratio."""
    out = {}
    for ratios in by_dtype.values():
        for k, v in ratios.items():
            worse = max if (k.endswith("_memory") or k.endswith("_kv_bytes")) else min
            out[k] = v if k not in out else worse(out[k], v)
    return out


def environment(device: torch.device, diff_attention: str = "auto", work: Optional[int] = None) -> dict:
    from ..nn import native

    cpu = native.cpuinfo_value("model name") or platform.processor() or ""
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
           "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "device": str(device),
           "native_bf16_matmul": native_bf16_matmul(device),
           "command": " ".join(["difftx"] + sys.argv[1:]) if sys.argv and "difftx" in sys.argv[0] else None}
    if device.type == "cuda" or diff_attention != "auto":
        from ..nn import backends

        # the formulation DIFF attention takes here, per dtype: auto's choice on a GPU for a training call of the
        # bench's shape (``work``: batch x heads x tokens^2; triton: difftx.nn.triton_diff), or the one named
        # (--diff-attention; where a call does not fit it, the layer's own fallback: 2call on CUDA, fused on the CPU)
        env["diff_attention"] = {dt: backends.resolve_diff_variant(diff_attention, device, 0.0, t, work=work)
                                 for dt, t in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        env["diff_attention_named"] = diff_attention != "auto"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        from ..nn import linear

        env["native_kernels"] = native.status()
        env["fp32_gemm"] = "onednn" if linear.ONEDNN_FP32 else "torch"
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:
        pass
    return env

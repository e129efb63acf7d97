"""difftx language models as transformers models: ``AutoModelForCausalLM`` and ``generate`` for every layout.

:class:`DifftxConfig` (``model_type='difftx'``) carries a difftx
:class:`~difftx.ModelConfig`; :class:`DifftxForCausalLM` holds a difftx
:class:`~difftx.models.DecoderLM` as ``.model`` (no model code is duplicated),
so every attention kind (softmax, diff, diff2) and every norm placement works.

Caches.  transformers passes one of its ``Cache`` objects (``DynamicCache`` by
default, ``StaticCache`` with ``cache_implementation="static"``, offloaded or
quantized variants) as ``past_key_values``.  :class:`_CacheView` shows it to the
difftx attention modules through the interface of difftx's own ``KVCache``
(``update(layer, k, v)``, ``length``, ``key_valid``).  A DIFF layer's cache entry
is K = [K1; K2] (2 h_kv heads of d) and V (h_kv heads of 2d); V is stored in the
transformers cache as 2 h_kv heads of d, so K and V have one shape and every
cache class (static ones allocate V like K) works, with exactly the bytes of a
Transformer with 2 h_kv KV heads.

Importing this module imports transformers (seconds) and registers the classes
with ``AutoConfig`` / ``AutoModelForCausalLM``; ``import difftx`` does not import
it but registers lazily (see :mod:`difftx.interop._hooks`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.lm import DecoderLM
from ..models.init import init_module
from ..nn.rope import sinusoidal_table
from .convert import hf_standard_fields
from .hf_config import DifftxConfig, register_config


# transformers 5.24 renamed ``past_key_values`` to ``cache`` (argument and output field); both are read, and
# the output uses the installed version's field name.
_CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _no_view() -> None:
    return None


def _packed_documents(position_ids: torch.Tensor, b: int, n: int) -> Optional[torch.Tensor]:
    """Document ids of packed sequences, as transformers packs them without padding (DataCollatorWithFlattening:
    the examples of a batch in one row, ``position_ids`` restarting at 0 for each, no ``attention_mask``): a new
    document wherever the position does not grow.  None when the positions only grow (one document a row)."""
    if position_ids.dim() != 2 or position_ids.shape[1] != n or position_ids.shape[0] not in (1, b) or n < 2:
        return None
    restart = position_ids[:, 1:] <= position_ids[:, :-1]
    if not bool(restart.any()):
        return None
    doc = torch.zeros(position_ids.shape, dtype=torch.long, device=position_ids.device)
    doc[:, 1:] = restart.long().cumsum(-1)
    return doc.expand(b, n)


class _CacheView:
    """A transformers ``Cache`` seen through difftx's ``KVCache`` interface.

    ``length`` and ``key_valid`` describe the positions cached before the current forward call (:meth:`of` sets
    them); positions are passed explicitly, so ``advance`` has nothing to do.  One view per transformers cache, kept
    on it: DIFF's lambda memo is keyed on the cache object it is given (one per generation), so a new view per call
    computed lambda again at every decoding step.  The view holds its cache weakly: a strong reference back made a
    cycle (cache -> view -> cache) that kept each finished generation's K/V alive until the garbage collector ran.
    """

    def __init__(self, cache: Cache, length: int, key_valid: torch.Tensor):
        try:
            self._cache = weakref.ref(cache)
        except TypeError:  # no weak references (__slots__): the view is not kept on such a cache, so no cycle
            self._cache = lambda: cache
        self.at(length, key_valid)

    @property
    def cache(self) -> Cache:
        return self._cache()

    def __reduce__(self):
        # deepcopy and pickle of the cache it is kept on: the copy gets no view (its own is made when it is used);
        # a copied weak reference would name the original cache, and a weak reference does not pickle
        return _no_view, ()

    def at(self, length: int, key_valid: torch.Tensor) -> "_CacheView":
        self.length = length
        self.key_valid = key_valid
        self.padded = not bool(key_valid.all())
        return self

    @classmethod
    def of(cls, cache: Cache, length: int, key_valid: torch.Tensor) -> "_CacheView":
        view = getattr(cache, "__dict__", {}).get("_difftx_view")
        if view is None or view.cache is not cache:  # none yet, or a copy's (copy.copy): it names the original
            view = cls(cache, length, key_valid)
            try:
                cache._difftx_view = view
            except AttributeError:  # a cache class with __slots__: a view per call (lambda computed each step)
                pass
        return view.at(length, key_valid)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        split_v = v.shape[-1] != k.shape[-1]  # DIFF: V of 2d -> two heads of d
        if split_v:
            b, hv, n, dv = v.shape
            v = v.reshape(b, hv, n, 2, dv // 2).transpose(2, 3).reshape(b, 2 * hv, n, dv // 2)
        keys, values = self.cache.update(k, v, layer)
        keys, values = keys[:, :, :end], values[:, :, :end]  # static caches return their whole buffer
        if split_v:
            values = values.reshape(b, hv, 2, end, dv // 2).transpose(2, 3).reshape(b, hv, end, dv)
        return keys, values

    def advance(self, n: int, step_valid: Optional[torch.Tensor] = None) -> None:
        pass


class DifftxPreTrainedModel(PreTrainedModel):
    config: DifftxConfig
    config_class = DifftxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = ["past_key_values"]
    supports_gradient_checkpointing = True  # Block.gradient_checkpointing (difftx.nn.block.run_blocks)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1):
        """What transformers' activation_checkpointing_enable / _disable (gradient_checkpointing_* before) call:
        the difftx blocks' flag, with transformers' checkpoint function.  transformers' own version counts only
        its GradientCheckpointingLayer blocks for ``every_n_layers`` and would recompute every difftx block."""
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer; got {every_n_layers!r}")
        self.model.set_activation_checkpointing(every_n_layers if enable else 0)
        if gradient_checkpointing_func is not None:
            for block in self.model.layers:
                block._gradient_checkpointing_func = gradient_checkpointing_func

    @torch.no_grad()
    def _init_weights(self, module):
        """difftx's own init (:func:`difftx.models.init.init_module`) of one module: transformers builds the model
        on the meta device and calls this for the modules whose weights a checkpoint did not hold (its init
        guards skip the parameters it did load); computed buffers are refilled."""
        if self.__dict__.get("_difftx_constructing"):  # post_init in __init__: the DecoderLM has its own init
            return
        names = self.__dict__.setdefault("_difftx_leaf_names", {})
        if id(module) not in names:
            names.update((id(m), n.rsplit(".", 1)[-1]) for n, m in self.named_modules())
        init_module(module, names.get(id(module), ""), self.config.model_config, constructed=True)
        if isinstance(module, DecoderLM) and hasattr(module, "pos_table"):
            cfg = module.config
            module.pos_table.copy_(sinusoidal_table(cfg.max_seq_len, cfg.d_model))


class DifftxForCausalLM(DifftxPreTrainedModel, GenerationMixin):
    """A difftx :class:`~difftx.models.DecoderLM` behind transformers' causal-LM interface."""

    def __init__(self, config: DifftxConfig, model: Optional[DecoderLM] = None):
        derived = hf_standard_fields(config.model_config)
        changed = {k: getattr(config, k, None) for k, v in derived.items() if getattr(config, k, None) != v}
        if changed:  # e.g. from_pretrained(dir, num_hidden_layers=1): set after the config derived its fields
            want = {k: derived[k] for k in changed}
            raise ValueError(f"DifftxConfig fields {changed} disagree with its difftx config, which gives {want}: "
                             "they are derived from config.difftx: set the value there and build the config anew "
                             "(DifftxConfig(difftx=...) or DifftxConfig.from_model_config(...)), which derives them")
        super().__init__(config)
        self.model = model if model is not None else DecoderLM(config.model_config)
        # post_init initialises nothing: a wrapped model's weights are its own (from_difftx), and a DecoderLM built
        # here has just had difftx's init (a second draw would change every weight of DifftxForCausalLM(config) /
        # from_config for a given seed); from_pretrained builds on the meta device, and initialises the weights its
        # checkpoint did not hold after post_init (_init_weights, without this flag)
        self.__dict__["_difftx_constructing"] = True
        try:
            self.post_init()
        finally:
            self.__dict__["_difftx_constructing"] = False

    @classmethod
    def from_difftx(cls, model: DecoderLM) -> "DifftxForCausalLM":
        """Wrap an existing difftx model (weights shared, not copied)."""
        return cls(DifftxConfig.from_model_config(model.config), model=model)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize, with the new vocabulary written into the difftx config (the model's and the one
        ``save_pretrained`` writes), so the saved model loads at its new size."""
        emb = super().resize_token_embeddings(*args, **kwargs)
        cfg = self.model.config.replace(vocab_size=int(self.model.embed.weight.shape[0]))
        self.model.config = cfg
        self.config.difftx, self.config.vocab_size = cfg.to_dict(), cfg.vocab_size
        return emb

    def _get_static_cache_init_shape(self):
        """The (heads, head_dim) a ``StaticCache`` is allocated with before the first call (transformers >= 5.24
        does so for ``generate(prefill_chunk_size=...)``): what the attention writes, 2 h_kv heads of d for a DIFF
        layer (K = [K1; K2], V split in two), not the config's ``num_key_value_heads`` (h_kv)."""
        shape = super()._get_static_cache_init_shape() if hasattr(super(), "_get_static_cache_init_shape") else ()
        if shape is None:  # transformers cannot initialise it early here (layers on several devices)
            return None
        cfg = self.model.config
        return cfg.n_kv_components, cfg.head_dim

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """Keep the 2-D padding mask for every cache class; the difftx model builds its own masks."""
        return attention_mask

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, logits_to_keep: int = 0, return_dict: Optional[bool] = None,
                cache: Optional[Cache] = None, **kwargs) -> CausalLMOutputWithPast:
        """transformers semantics: ``labels`` are shifted inside; ``attention_mask`` covers cached + new tokens.

        The cache comes as ``past_key_values`` or, as transformers >= 5.24 passes it, ``cache``."""
        if cache is not None:
            if past_key_values is not None and past_key_values is not cache:
                raise ValueError("pass the cache once: as `cache` or as `past_key_values`, not both")
            past_key_values = cache
        if inputs_embeds is not None:
            raise ValueError("DifftxForCausalLM takes input_ids, not inputs_embeds")
        def flag(name):  # as in transformers: the argument, else the config's (from_pretrained(dir, name=True))
            value = kwargs.pop(name, None)
            return bool(getattr(self.config, name, False) if value is None else value)

        if flag("output_attentions"):
            raise ValueError("DifftxForCausalLM does not return attention maps (its fused kernels never hold "
                             "them); use difftx.evals' attention probes")
        want_hidden = flag("output_hidden_states")
        if input_ids is None:
            raise ValueError("input_ids is required")
        b, n = input_ids.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = int(past_key_values.get_seq_length()) if past_key_values is not None else 0
        step_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("DifftxForCausalLM takes a 2-D attention_mask (batch, past + new tokens)")
            full = attention_mask.to(device=input_ids.device, dtype=torch.bool)
            if full.shape[1] == n and past > 0:  # only the new tokens' mask: earlier ones count as real
                full = torch.cat((torch.ones(b, past, dtype=torch.bool, device=full.device), full), dim=1)
            if full.shape[1] != past + n:
                raise ValueError(f"attention_mask covers {full.shape[1]} positions; expected past ({past}) "
                                 f"+ new ({n}) = {past + n}")
            step_mask = full[:, past:]
            if position_ids is None:
                position_ids = (full.long().cumsum(-1) - 1).clamp_min(0)[:, past:]
        else:
            full = torch.ones(b, past + n, dtype=torch.bool, device=input_ids.device)
        documents = None
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=input_ids.device)[None].expand(b, n)
        elif attention_mask is None and past == 0:
            documents = _packed_documents(position_ids, b, n)
        if documents is not None:  # packed sequences: no cache (its later steps could not tell the documents apart)
            past_key_values = None
        view = _CacheView.of(past_key_values, past, full[:, :past]) if past_key_values is not None else None
        states = _HiddenStates(self.model.layers) if want_hidden else contextlib.nullcontext()
        with states:
            hidden = self.model.features(input_ids, attention_mask=step_mask, position_ids=position_ids, cache=view,
                                         document_ids=documents)

        def keep(t):  # transformers' logits_to_keep: the last N positions (0: all), or a 1-D tensor of indices
            if isinstance(logits_to_keep, int):
                return t[:, -logits_to_keep:] if logits_to_keep > 0 else t
            return t[:, logits_to_keep]

        loss = None
        if labels is None:  # the head runs on the kept positions only (generate's prefill keeps the last one)
            logits = self.model.head(keep(hidden))
        else:
            every = self.model.head(hidden)
            logits = keep(every)
            loss = self.loss_function(logits=every, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=states.tuple(hidden) if want_hidden
                                     else None, **{_CACHE_FIELD: past_key_values if use_cache else None})
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()


class _HiddenStates:
    """transformers' ``hidden_states``: the first block's input, every block's output but the last, then the
    final norm's output (as LLaMA's).  Read by forward hooks, under which the blocks run one by one."""

    def __init__(self, layers):
        self.layers, self.seen, self.handles = layers, [], []

    def __enter__(self):
        self.handles = [self.layers[0].register_forward_pre_hook(lambda m, args: self.seen.append(args[0]))]
        self.handles += [b.register_forward_hook(lambda m, args, out: self.seen.append(out)) for b in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def tuple(self, final: torch.Tensor) -> tuple:
        return tuple(self.seen[:-1]) + (final,)


def register() -> None:
    """Register with AutoConfig / AutoModelForCausalLM (idempotent)."""
    register_config()
    try:
        AutoModelForCausalLM.register(DifftxConfig, DifftxForCausalLM, exist_ok=True)
    except TypeError:
        try:
            AutoModelForCausalLM.register(DifftxConfig, DifftxForCausalLM)
        except ValueError:
            pass


register()

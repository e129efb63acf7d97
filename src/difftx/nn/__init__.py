"""Building blocks: norms, rotary embeddings, masks, attention kinds and backends, FFNs, blocks, cache."""

from .attention import AttentionBase, DifferentialAttention, DiffV2Attention, SoftmaxAttention, make_attention
from .block import Block
from .cache import KVCache
from .ffn import MLP, SwiGLU, make_ffn
from .linear import Linear, project
from .mask import AttnMask, document_ids, document_positions
from .norms import LayerNorm, RMSNorm, make_norm
from .probe import AttentionProbe, attach_probe
from .rope import RotaryEmbedding, apply_rope

__all__ = [
    "AttentionBase", "DifferentialAttention", "DiffV2Attention", "SoftmaxAttention", "make_attention",
    "Block", "KVCache", "MLP", "SwiGLU", "make_ffn", "AttnMask", "document_ids", "document_positions", "LayerNorm", "RMSNorm", "make_norm",
    "AttentionProbe", "attach_probe", "RotaryEmbedding", "apply_rope", "Linear", "project",
]

"""Gemma 3 text-model configurations: the five released sizes and small random-init test models.

The released values are written out literally (importing the `gemma` library pulls in
TensorFlow); `tests/models_test.py` checks them field by field against `gemma.gm.nn`'s
`Gemma3_270M` ... `Gemma3_27B` configs.

    config = get_config("gemma3-1b")
    config.attention_types  # one AttentionType per layer: 5 local (sliding window) : 1 global
"""

from __future__ import annotations

import dataclasses
import enum

# The longest sequence an engine accepts by default: Gemma 3's context, 32K tokens for 270M
# and 1B (128K for the larger sizes).
DEFAULT_MAX_LENGTH = 32_768


class AttentionType(enum.StrEnum):
    """What a layer attends to: a sliding window of past tokens, or all of them."""

    LOCAL_SLIDING = "local_sliding"
    GLOBAL = "global"


# Gemma 3 interleaves 5 sliding-window layers with 1 global layer.
GEMMA3_ATTENTION_PATTERN = (AttentionType.LOCAL_SLIDING,) * 5 + (AttentionType.GLOBAL,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config:
    """Architecture of a Gemma 3 text model (the fields of gemma's `TransformerConfig` that
    Gemma 3 uses; the vision encoder is left out).

    Attributes:
      num_layers: Transformer blocks.
      vocab_size: Rows of the (tied) embedding table (gemma: `num_embed`).
      embed_dim: Model width D.
      hidden_dim: MLP hidden width F.
      num_heads: Query heads N.
      head_dim: Width H of one head.
      num_kv_heads: Key/value heads K (K == 1: MQA; 1 < K < N: GQA; K == N: MHA, whose q, k and
        v projections are one `qkv_einsum`, as in gemma).
      sliding_window_size: Window W of local layers: a query at position p sees keys at
        positions in (p - W, p + W) (and causally, only those <= p).
      attention_pattern: Attention type of consecutive layers, repeated (and truncated) to
        `num_layers`.
      local_base_frequency: RoPE base frequency of local layers.
      global_base_frequency: RoPE base frequency of global layers.
      local_scale_factor: RoPE positional-interpolation factor of local layers (>= 1).
      global_scale_factor: RoPE positional-interpolation factor of global layers (>= 1).
      query_pre_attn_scalar: Queries are multiplied by `query_pre_attn_scalar ** -0.5` before
        the dot product (head_dim for most sizes; embed_dim // num_heads for 27B).
      final_logit_softcap: If set, logits = c * tanh(logits / c).
      attn_logits_softcap: If set, attention logits = c * tanh(logits / c).
      use_qk_norm: RMSNorm the queries and keys (per head) before RoPE.
      use_post_attn_norm: RMSNorm the attention output before the residual add.
      use_post_ffw_norm: RMSNorm the MLP output before the residual add.
      transpose_gating_einsum: The MLP gating weight is [2, F, D] (Gemma 3) rather than
        [2, D, F].
    """

    num_layers: int
    vocab_size: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    sliding_window_size: int
    attention_pattern: tuple[AttentionType, ...] = GEMMA3_ATTENTION_PATTERN
    local_base_frequency: int = 10_000
    global_base_frequency: int = 1_000_000
    local_scale_factor: float = 1.0
    global_scale_factor: float = 1.0
    query_pre_attn_scalar: float
    final_logit_softcap: float | None = None
    attn_logits_softcap: float | None = None
    use_qk_norm: bool = True
    use_post_attn_norm: bool = True
    use_post_ffw_norm: bool = True
    transpose_gating_einsum: bool = True

    def __post_init__(self):
        for field in (
            "num_layers",
            "vocab_size",
            "embed_dim",
            "hidden_dim",
            "num_heads",
            "head_dim",
            "num_kv_heads",
            "sliding_window_size",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.attention_pattern or not all(
            isinstance(t, AttentionType) for t in self.attention_pattern
        ):
            raise ValueError(
                f"attention_pattern must be a non-empty tuple of AttentionType, "
                f"got {self.attention_pattern!r}"
            )
        if min(self.local_scale_factor, self.global_scale_factor) < 1.0:
            raise ValueError("RoPE scale factors must be >= 1")
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")

    @property
    def attention_types(self) -> tuple[AttentionType, ...]:
        """One attention type per layer: the pattern repeated, the last repeat truncated."""
        pattern = self.attention_pattern
        return (pattern * -(-self.num_layers // len(pattern)))[: self.num_layers]

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by before the attention dot product."""
        return self.query_pre_attn_scalar**-0.5


_GEMMA3_COMMON = dict(
    vocab_size=262_144,
    attention_pattern=GEMMA3_ATTENTION_PATTERN,
    local_base_frequency=10_000,
    global_base_frequency=1_000_000,
    local_scale_factor=1.0,
    final_logit_softcap=None,
    attn_logits_softcap=None,
    use_qk_norm=True,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    transpose_gating_einsum=True,
)

# The released text models. 4B, 12B and 27B are multimodal in gemma; only their text model is
# described here (their vision encoder is not part of it).
CONFIGS: dict[str, Gemma3Config] = {
    "gemma3-270m": Gemma3Config(
        num_layers=18,
        embed_dim=640,
        hidden_dim=2048,
        num_heads=4,
        head_dim=256,
        num_kv_heads=1,
        sliding_window_size=512,
        global_scale_factor=1.0,
        query_pre_attn_scalar=256.0,
        **_GEMMA3_COMMON,
    ),
    "gemma3-1b": Gemma3Config(
        num_layers=26,
        embed_dim=1152,
        hidden_dim=6912,
        num_heads=4,
        head_dim=256,
        num_kv_heads=1,
        sliding_window_size=512,
        global_scale_factor=1.0,
        query_pre_attn_scalar=256.0,
        **_GEMMA3_COMMON,
    ),
    "gemma3-4b": Gemma3Config(
        num_layers=34,
        embed_dim=2560,
        hidden_dim=10_240,
        num_heads=8,
        head_dim=256,
        num_kv_heads=4,
        sliding_window_size=1024,
        global_scale_factor=8.0,
        query_pre_attn_scalar=256.0,
        **_GEMMA3_COMMON,
    ),
    "gemma3-12b": Gemma3Config(
        num_layers=48,
        embed_dim=3840,
        hidden_dim=15_360,
        num_heads=16,
        head_dim=256,
        num_kv_heads=8,
        sliding_window_size=1024,
        global_scale_factor=8.0,
        query_pre_attn_scalar=256.0,
        **_GEMMA3_COMMON,
    ),
    "gemma3-27b": Gemma3Config(
        num_layers=62,
        embed_dim=5376,
        hidden_dim=21_504,
        num_heads=32,
        head_dim=128,
        num_kv_heads=16,
        sliding_window_size=1024,
        global_scale_factor=8.0,
        query_pre_attn_scalar=168.0,  # embed_dim // num_heads, not head_dim
        **_GEMMA3_COMMON,
    ),
    # Small random-init models for tests: one global layer after five local ones, a window much
    # shorter than test prompts (so the local mask matters) and global RoPE scaling on.
    "tiny": Gemma3Config(
        num_layers=6,
        vocab_size=512,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        sliding_window_size=8,
        global_scale_factor=8.0,
        query_pre_attn_scalar=16.0,
    ),
    "tiny-mqa": Gemma3Config(
        num_layers=6,
        vocab_size=512,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=1,
        sliding_window_size=8,
        global_scale_factor=8.0,
        query_pre_attn_scalar=16.0,
    ),
}


def get_config(name: str) -> Gemma3Config:
    """The config registered as `name`; ValueError listing the valid names otherwise."""
    try:
        return CONFIGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown Gemma 3 config {name!r}; valid: {', '.join(CONFIGS)}") from None


GGUF_MODEL = "gemma3-270m"  # the config whose real weights come from a GGUF (models/cache.py)


def has_gguf_blocks(model: str, checkpoint: object | None) -> bool:
    """Whether the weights of `model` (from `checkpoint`, if given) come from a GGUF file, so
    that they can decode on its blocks: the packaged 270M only."""
    return model == GGUF_MODEL and checkpoint is None

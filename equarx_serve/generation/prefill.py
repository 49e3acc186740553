"""Tensor-parallel prefill: a batch of token lists in, logits and the KV cache out.

    engine = PrefillEngine.from_name("gemma3-270m", tp=2, all_reduce="equarx-int8")
    result = engine.prefill([[2, 651, 6037], [2, 9259]])  # last_only=True
    result.logits  # [B, V] at each prompt's last token; result.cache["layer_0"]["k"] ...

The engine builds a 1-D mesh "tp" over `jax.devices()[:tp]` (N host devices in one process,
or, after `distributed.multiprocess.initialize`, the global devices of N processes), shards
the parameters once, and right-pads every batch to a length BUCKET: a power of two from
`MIN_BUCKET` up to `max_length` (the last bucket is `max_length` itself), so that new prompt
lengths reuse a compiled program. Programs are compiled ahead of time and cached per
(bucket, batch size, last_only, capture); `compile` exposes them (the HLO gives the wire bytes).

Parameters: `checkpoint_params` are the weights as loaded, placed on the mesh; `params` are the
ones the model runs on: the same arrays, plus rotated copies of the two row-parallel weights
when the all-reduce's rotation is folded (`models.gemma3`). Engines made by `with_all_reduce`
share the placed checkpoint and one set of rotated copies per rotation, so an engine per method
costs no memory unless its rotation is new.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.collectives import AllReduce, get_all_reduce
from equarx_serve.collectives.hadamard import HadamardRotation
from models.config import DEFAULT_MAX_LENGTH, Gemma3Config, get_config, has_gguf_blocks
from models.gemma3 import AXIS, BLOCKS, TensorParallelGemma3, init_params, mask_from_lengths

MIN_BUCKET = 16
# The decode weights (`PrefillEngine.from_name`): the checkpoint's widened to bf16, or the GGUF
# file's own quantized blocks.
WEIGHTS = ("bf16", "gguf", "auto")
# weights "auto": decode steps of at most this many rows on the GGUF's blocks, larger ones on
# the bf16 weights. Measured (`bench compare --batches 1 8` with --weights gguf and bf16, and
# `Generator` at 1, 2, 3, 4, 6 and 8 rows on both, interleaved; docs/decisions.md): the blocks
# are faster at 1 row (46.6 vs 34.6 tokens/s), bf16 from 2 rows on (66.4 vs 57.3; 8 rows 188.9
# vs 126.9), where the int8 kernel is bound by its f32 FMAs and the bf16 one is not.
AUTO_GGUF_DECODE_MAX_ROWS = 1
INIT_SEED = 0  # random-init configs: init_params(config, PRNGKey(INIT_SEED))

Params = dict[str, Any]


def length_buckets(max_length: int) -> tuple[int, ...]:
    """Powers of two from `MIN_BUCKET` below `max_length`, then `max_length`."""
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    buckets, b = [], MIN_BUCKET
    while b < max_length:
        buckets.append(b)
        b *= 2
    return (*buckets, max_length)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logits", "cache", "lengths", "trace"],
    meta_fields=["bucket"],
)
@dataclasses.dataclass(frozen=True)
class PrefillResult:
    """logits: [B, V] at each prompt's last token (last_only), else [B, bucket, V] (positions
    from a prompt's length on are padding: meaningless), split over "tp" on V as the model's
    vocab-parallel head computes them (reading the array gathers them; the model's `sampler`
    samples on the shards). cache: {"layer_i": {"k", "v"}}, each
    [B, bucket, K, H], sharded as the model produces it. lengths: [B] prompt lengths. bucket:
    the padded length. trace: with capture=True, every all-reduce's record (see
    `models.gemma3.Gemma3Output`), else None. A pytree: `jax.block_until_ready(result)` waits
    for all of it."""

    logits: jax.Array
    cache: dict[str, dict[str, jax.Array]]
    lengths: np.ndarray
    bucket: int
    trace: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class CompiledPrefill:
    """One ahead-of-time compiled prefill program and its key."""

    bucket: int
    batch: int
    last_only: bool
    capture: bool
    compiled: jax.stages.Compiled
    lowered_hlo: str  # before XLA's optimizations (collectives in the program's dtypes)

    def hlo_text(self) -> str:
        """The optimized HLO (what runs on this backend)."""
        return self.compiled.as_text()


def _global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed with `sharding` (every process passes the same value); works for
    meshes that span processes, where not every device is addressable."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


class PrefillEngine:
    """Prefill of a Gemma 3 model, tensor-parallel over `tp` devices (see module doc).

    Args:
      config: The model.
      params: The gemma parameter tree (numpy or jax arrays, global shapes).
      tp: Tensor-parallel degree: devices on the mesh axis "tp".
      all_reduce: A registered all-reduce name or an `AllReduce` instance.
      mesh: A mesh with axis "tp" of size `tp` (default: 1-D over `jax.devices()[:tp]`).
      dtype: Cast the parameters to this dtype (default: keep theirs).
      max_length: The longest prompt accepted (the last bucket).
      overlap_chunks: Run a prefill's layers on this many token chunks, so that one chunk's
        all-reduce is on the wire while the next chunk computes (`models.gemma3`, "Overlap");
        1: whole messages; "auto" (default): chunks where they pay, chosen by the run
        (`collectives.overlap.auto_chunks`: 2 CPU processes on a slow measured link, a long prompt).
      blocks: The decode weights in int8 blocks (`models.gguf.load_gguf_blocks`: a GGUF file's
        own quantized weights), or None: decode steps then run on them (`weights` "gguf"),
        prefill on `params` either way.
      gguf_decode_max_rows: With `blocks`, only decode steps of at most this many rows run on
        them, larger ones on `params` (`weights` "auto"); None: every decode step.
    """

    def __init__(
        self,
        config: Gemma3Config,
        params: Params,
        *,
        tp: int,
        all_reduce: str | AllReduce = "psum",
        mesh: Mesh | None = None,
        dtype: jnp.dtype | None = None,
        max_length: int = DEFAULT_MAX_LENGTH,
        overlap_chunks: int | Literal["auto"] = "auto",
        blocks: Params | None = None,
        gguf_decode_max_rows: int | None = None,
        _sharded: bool = False,
        _folds: dict[HadamardRotation, Params] | None = None,
    ):
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {tp!r}")
        if mesh is None:
            devices = jax.devices()
            if tp > len(devices):
                raise ValueError(f"tp={tp} needs {tp} devices, JAX has {len(devices)}")
            mesh = Mesh(np.array(devices[:tp]), (AXIS,))
        elif mesh.shape.get(AXIS) != tp:
            raise ValueError(f"the mesh's {AXIS!r} axis must have size tp={tp}: {mesh.shape}")
        self.config = config
        self.tp = tp
        self.mesh = mesh
        self.buckets = length_buckets(max_length)
        self.max_length = max_length
        # Raises ValueError when the model cannot be split tp ways, or for a bad all-reduce.
        self.model = TensorParallelGemma3(
            config,
            mesh,
            get_all_reduce(all_reduce),
            overlap_chunks=overlap_chunks,
            int8_blocks=blocks is not None,
        )
        self.all_reduce = self.model.all_reduce
        self.checkpoint_params = params if _sharded else self._shard(params, dtype)
        self.blocks = None if blocks is None else self._place_blocks(blocks)
        self.gguf_decode_max_rows = gguf_decode_max_rows
        self._folds = {} if _folds is None else _folds  # shared with `with_all_reduce` engines
        self.params = self._model_params()
        self._bf16_decoder: tuple[TensorParallelGemma3, Params] | None = None
        if self.blocks is not None:
            self.params = {**self.params, BLOCKS: self.blocks}
        self.dtype = jax.tree.leaves(self.params)[0].dtype
        self._replicated = NamedSharding(mesh, P())
        self._programs: dict[tuple[int, int, bool, bool], CompiledPrefill] = {}
        # Model metadata (set by `from_name`): tokenizer, weights checksum, source.
        self.tokenizer: Any = None
        self.info: dict[str, Any] = {}

    def _shard(self, params: Params, dtype: jnp.dtype | None) -> Params:
        def place(value, sharding):
            if isinstance(value, jax.Array) and value.is_fully_addressable and dtype is None:
                return jax.device_put(value, sharding)
            host = np.asarray(value)
            if dtype is not None:
                host = host.astype(dtype)
            return _global_array(host, sharding)

        return jax.tree.map(place, params, self.model.checkpoint_shardings())

    @property
    def weights(self) -> str:
        """What the decode steps run on: "gguf" (the GGUF's int8 blocks), "bf16", or "auto"
        (the blocks up to `gguf_decode_max_rows` rows, bf16 above)."""
        if self.blocks is None:
            return "bf16"
        return "gguf" if self.gguf_decode_max_rows is None else "auto"

    def decoder(self, rows: int) -> tuple[TensorParallelGemma3, Params]:
        """The model and parameters a decode step of `rows` rows runs on (see `weights`)."""
        limit = self.gguf_decode_max_rows
        if self.blocks is None or limit is None or rows <= limit:
            return self.model, self.params
        if self._bf16_decoder is None:  # the same model without the blocks (made once)
            model = TensorParallelGemma3(
                self.config,
                self.mesh,
                self.all_reduce,
                overlap_chunks=self.model.overlap_chunks,
            )
            params = {k: v for k, v in self.params.items() if k != BLOCKS}
            self._bf16_decoder = model, params
        return self._bf16_decoder

    def _place_blocks(self, blocks: Params) -> Params:
        def place(value, sharding):
            if isinstance(value, jax.Array):  # placed: kept (moved if it must be, and can)
                return jax.device_put(value, sharding) if value.is_fully_addressable else value
            return _global_array(np.asarray(value), sharding)

        return jax.tree.map(place, blocks, self.model.block_shardings(blocks))

    def _model_params(self) -> Params:
        """The parameters the model runs on: the checkpoint's, or its folded copy (made once
        per rotation and shared)."""
        rotation = self.model.rotation
        if rotation is None:
            return self.checkpoint_params
        if rotation not in self._folds:
            self._folds[rotation] = self.model.fold_params(self.checkpoint_params)
        return self._folds[rotation]

    def with_all_reduce(
        self, all_reduce: str | AllReduce, *, overlap_chunks: int | Literal["auto"] | None = None
    ) -> PrefillEngine:
        """The same model and (already sharded) parameters on another all-reduce (and with
        `overlap_chunks` if given, else this engine's)."""
        if overlap_chunks is None:
            overlap_chunks = self.model.overlap_chunks
        return self._sibling(
            all_reduce, overlap_chunks, self.blocks, dict(self.info), self.gguf_decode_max_rows
        )

    def with_gguf_blocks(self) -> PrefillEngine:
        """The same model and (already sharded) parameters with the decode steps on the GGUF
        file's own quantized weights (`models.cache.load_gguf_blocks_cached` of the engine's
        `info["gguf_path"]`); ValueError for an engine whose weights did not come from a GGUF
        file."""
        from models.cache import load_gguf_blocks_cached

        path, sha = self.info.get("gguf_path"), self.info.get("gguf_sha256")
        if path is None or sha is None:
            raise ValueError("decode on GGUF blocks needs an engine loaded from a GGUF file")
        blocks = load_gguf_blocks_cached(path, sha)
        info = {**self.info, "weights": "gguf"}
        return self._sibling(self.all_reduce, self.model.overlap_chunks, blocks, info, None)

    def _sibling(
        self,
        all_reduce: str | AllReduce,
        overlap_chunks: int | Literal["auto"],
        blocks: Params | None,
        info: dict[str, Any],
        gguf_decode_max_rows: int | None,
    ) -> PrefillEngine:
        """An engine on this one's (already sharded) parameters and folds, with these."""
        engine = PrefillEngine(
            self.config,
            self.checkpoint_params,
            tp=self.tp,
            all_reduce=all_reduce,
            mesh=self.mesh,
            max_length=self.max_length,
            overlap_chunks=overlap_chunks,
            blocks=blocks,
            gguf_decode_max_rows=gguf_decode_max_rows,
            _sharded=True,
            _folds=self._folds,
        )
        engine.tokenizer, engine.info = self.tokenizer, info
        return engine

    @classmethod
    def from_name(
        cls,
        model: str,
        tp: int,
        all_reduce: str | AllReduce = "psum",
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        *,
        dtype: jnp.dtype | None = jnp.bfloat16,
        max_length: int = DEFAULT_MAX_LENGTH,
        overlap_chunks: int | Literal["auto"] = "auto",
        weights: str = "bf16",
    ) -> PrefillEngine:
        """An engine for the config named `model`: with `checkpoint` (an orbax folder) and
        `tokenizer` (its SentencePiece .model), those weights; else "gemma3-270m" loads the
        real weights (`models.cache.load_gemma3_270m`) and other names are random-init
        (`init_params` with seed `INIT_SEED`). `weights` "gguf": decode steps on the GGUF
        file's own quantized weights (`load_gguf_blocks_cached`; only for the real weights);
        "auto": those of at most `AUTO_GGUF_DECODE_MAX_ROWS` rows where the weights come from
        the packaged GGUF, else bf16."""
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        max_rows = None
        if weights == "auto":
            weights = "gguf" if has_gguf_blocks(model, checkpoint) else "bf16"
            max_rows = AUTO_GGUF_DECODE_MAX_ROWS
        if weights == "gguf" and not has_gguf_blocks(model, checkpoint):
            raise ValueError(
                "weights 'gguf' decodes on a GGUF file's quantized blocks: only the packaged "
                f"gemma3-270m checkpoint has one (got model {model!r}"
                f"{'' if checkpoint is None else ', an orbax checkpoint'})"
            )
        config = get_config(model)
        blocks = None
        info: dict[str, Any] = {"model": model}
        tok = None
        if (checkpoint is None) != (tokenizer is None):
            raise ValueError("give both a checkpoint and its tokenizer, or neither")
        if checkpoint is not None:
            from models.checkpoints import load_checkpoint
            from models.gemma3 import param_shapes

            params, tok = load_checkpoint(checkpoint, tokenizer, expected=param_shapes(config))
            info.update(source="orbax", checkpoint=str(checkpoint), tokenizer=str(tokenizer))
        elif model == "gemma3-270m":
            from models.cache import load_gemma3_270m

            params, tok, load_info = load_gemma3_270m()
            info.update(
                source="gguf",
                gguf_path=str(load_info.gguf_path),
                gguf_sha256=load_info.gguf_sha256,
                weights_sha256=load_info.weights_sha256,
            )
            if weights == "gguf":
                from models.cache import load_gguf_blocks_cached

                blocks = load_gguf_blocks_cached(load_info.gguf_path, load_info.gguf_sha256)
        else:
            params = init_params(config, jax.random.PRNGKey(INIT_SEED))
            info.update(source="random-init", seed=INIT_SEED)
        engine = cls(
            config,
            params,
            tp=tp,
            all_reduce=all_reduce,
            dtype=dtype,
            max_length=max_length,
            overlap_chunks=overlap_chunks,
            blocks=blocks,
            gguf_decode_max_rows=max_rows,
        )
        info["weights"] = engine.weights
        engine.tokenizer, engine.info = tok, info
        return engine

    def bucket_for(self, length: int) -> int:
        """The padded length of a prompt of `length` tokens; ValueError if out of range."""
        if length < 1:
            raise ValueError("empty prompt: every prompt needs at least one token")
        if length > self.max_length:
            raise ValueError(
                f"prompt of {length} tokens is longer than the maximum length {self.max_length}"
            )
        return next(b for b in self.buckets if b >= length)

    def compile(
        self, bucket: int, batch: int, *, last_only: bool = True, capture: bool = False
    ) -> CompiledPrefill:
        """The compiled program for right-padded [batch, bucket] inputs (cached)."""
        key = (bucket, batch, bool(last_only), bool(capture))
        if key not in self._programs:
            tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32, sharding=self._replicated)
            mask = jax.ShapeDtypeStruct((batch, bucket), jnp.bool_, sharding=self._replicated)
            fn = jax.jit(
                functools.partial(self.model, last_only=bool(last_only), capture=bool(capture))
            )
            lowered = fn.lower(self.params, tokens, mask)
            self._programs[key] = CompiledPrefill(
                *key, lowered.compile(), lowered.as_text(dialect="hlo", debug_info=True)
            )
        return self._programs[key]

    @property
    def num_compiled(self) -> int:
        """How many programs have been compiled."""
        return len(self._programs)

    def prepare(self, token_lists: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array, int]:
        """(tokens, input_mask, bucket): the batch right-padded with 0 to its bucket, placed
        replicated on the mesh. ValueError for an empty batch, empty or too long prompts."""
        if not token_lists:
            raise ValueError("empty batch: give at least one prompt")
        lengths = [len(t) for t in token_lists]
        for i, length in enumerate(lengths):
            try:
                self.bucket_for(length)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        bucket = self.bucket_for(max(lengths))
        tokens = np.zeros((len(token_lists), bucket), np.int32)
        for i, t in enumerate(token_lists):
            tokens[i, : len(t)] = np.asarray(t, np.int32)
        mask = np.asarray(mask_from_lengths(np.asarray(lengths), bucket))
        return (
            _global_array(tokens, self._replicated),
            _global_array(mask, self._replicated),
            bucket,
        )

    def prefill(
        self,
        token_lists: Sequence[Sequence[int]],
        *,
        last_only: bool = True,
        capture: bool = False,
    ) -> PrefillResult:
        """Runs the prompts (lists of token ids) as one right-padded batch; see `PrefillResult`.
        `capture` also records every all-reduce's output and error (for the eval harness)."""
        tokens, mask, bucket = self.prepare(token_lists)
        program = self.compile(bucket, len(token_lists), last_only=last_only, capture=capture)
        out = program.compiled(self.params, tokens, mask)
        return PrefillResult(
            logits=out.logits,
            cache=out.cache,
            lengths=np.array([len(t) for t in token_lists]),
            bucket=bucket,
            trace=out.trace,
        )

"""Qwen3 / Qwen3.5 causal decoder in Flax NNX, with an incremental-decode cache.

Call signature (what the trainer, the engines and the tests rely on):

    model(input_ids [B, T], *, positions=None, cache=None, valid=None)
      -> logits [B, T, V]                  (cache is None)
      -> (logits [B, T, V], new_cache)     (with a cache)

`valid` [B, T] bool marks real tokens; each row's valid tokens must be a
prefix of the chunk (right padding). Invalid tokens never change any KV,
conv or recurrent state, and do not advance the row's cache length, so rows of
different lengths can share one batched prefill.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax import sharding
from bat_jax.model.attention import AttentionMask, pad_axis1, seq_blocks
from bat_jax.model.config import ModelConfig
from bat_jax.model.deltanet import DeltaNetState, GatedDeltaNet
from bat_jax.model.remat import recompute_vjp
from bat_jax.model.layers import (MLP, Attention, Embed, KVCache, RMSNorm, compute_param,
                                  logical_param)

LayerCache = KVCache | DeltaNetState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
  """Per-layer decode state plus per-row lengths.

  layers: one entry per decoder layer (KVCache for full attention, DeltaNetState
    for linear attention).
  lengths: [B] int32 number of tokens already in the cache for each row.
  """

  layers: tuple[LayerCache, ...]
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    for layer in self.layers:
      if isinstance(layer, KVCache):
        return layer.key.shape[-1]
    return 0  # pure-DeltaNet stacks have no length limit


class DecoderLayer(nnx.Module):
  """Pre-norm block: token mixer (attention or DeltaNet) then SwiGLU MLP."""

  def __init__(self, cfg: ModelConfig, layer_type: str, *, rngs: nnx.Rngs):
    self.layer_type = layer_type
    dt = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    norm_kw = dict(eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm,
                   param_dtype=cfg.param_dtype, axis_name="embed_norm")
    self.input_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm_kw)
    if layer_type == "full_attention":
      self.self_attn = Attention(
          hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
          num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
          rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps,
          zero_centered_norm=cfg.zero_centered_norm, output_gate=cfg.attn_output_gate,
          use_bias=cfg.attention_bias, attention_impl=cfg.attention_impl,
          block_size=cfg.attention_block_size, rngs=rngs, **dt)
    else:
      self.linear_attn = GatedDeltaNet(
          hidden_size=cfg.hidden_size, num_k_heads=cfg.linear_num_key_heads,
          num_v_heads=cfg.linear_num_value_heads, head_k_dim=cfg.linear_key_head_dim,
          head_v_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim,
          eps=cfg.rms_norm_eps, chunk_size=cfg.deltanet_chunk_size, rngs=rngs, **dt)
    self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, **dt)

  def __call__(self, x: jax.Array, *, positions: jax.Array, attn_mask: AttentionMask,
               valid: jax.Array, write_slots: jax.Array | None,
               cache: LayerCache | None) -> tuple[jax.Array, LayerCache | None]:
    h = self.input_layernorm(x)
    if self.layer_type == "full_attention":
      h, cache = self.self_attn(h, positions=positions, mask=attn_mask, cache=cache,
                                write_slots=write_slots)
    else:
      h, cache = self.linear_attn(h, valid=valid, state=cache)
    return self._residual_mlp(x, h), cache

  def _residual_mlp(self, x: jax.Array, mixed: jax.Array) -> jax.Array:
    x = x + mixed
    return x + self.mlp(self.post_attention_layernorm(x))

  def tiled(self, x: jax.Array, *, tiles: int, policy: Callable[..., bool] | None,
            positions: jax.Array, attn_mask: AttentionMask, valid: jax.Array) -> jax.Array:
    """Cache-free layer over `tiles` equal sequence tiles of x [B, T, D] (T % tiles == 0).

    A `lax.scan` over tiles: DeltaNet carries its conv and recurrent state from tile to tile;
    attention computes keys / values for the whole sequence once and scans query tiles against
    them. With `policy` each tile is rematerialised, so the backward saves the tile inputs and
    carries (attention: only its whole input, the layer being rematerialised once more) and
    holds one tile's activations at a time. Same
    arithmetic as `__call__` when tiles are multiples of the DeltaNet chunk and attention block.
    """
    tile = x.shape[1] // tiles
    graphdef, params = nnx.split(self)
    if self.layer_type == "full_attention":
      # Rematerialised once more as a whole, so the backward keeps only x: the tile steps'
      # inputs (x again, in tiles) and the keys / values are rebuilt per layer in its backward
      # instead of staying saved for every attention layer (0.8 GiB each at bat9b's shapes).
      attend = functools.partial(_tiled_attention, graphdef, tile=tile, policy=policy)
      return _rematerialise(attend, policy)(x, params, positions, attn_mask.query_slots,
                                            attn_mask.key_valid)
    xs = tuple(seq_blocks(a, tile) for a in (x, valid))

    def mix_tile(x_t, params, state, valid_t):
      layer = nnx.merge(graphdef, params)
      mixed, state = layer.linear_attn(layer.input_layernorm(x_t), valid=valid_t, state=state)
      return layer._residual_mlp(x_t, mixed), state

    step = _rematerialise(mix_tile, policy)

    def body(carry, xs):
      out, carry = step(xs[0], params, carry, xs[1])
      return carry, out

    carry = self.linear_attn.init_state(x.shape[0], self.linear_attn.dtype)
    _, out = jax.lax.scan(body, carry, xs)  # [tiles, B, tile, D]
    return jnp.moveaxis(out, 0, 1).reshape(x.shape)


def _tiled_attention(graphdef: nnx.GraphDef, x: jax.Array, params, positions: jax.Array,
                     query_slots: jax.Array, key_valid: jax.Array, *, tile: int,
                     policy: Callable[..., bool] | None) -> jax.Array:
  """A full-attention `DecoderLayer.tiled`: keys / values of the whole sequence once, then a
  scan of query tiles against them (each tile rematerialised with `policy`)."""

  def keys_values(h, params, positions):
    layer = nnx.merge(graphdef, params)
    return layer.self_attn.keys_values(layer.input_layernorm(h), positions=positions)

  def attend_tile(x_t, params, key, value, pos_t, slots_t, key_valid):
    layer = nnx.merge(graphdef, params)
    mask = AttentionMask(query_slots=slots_t, key_valid=key_valid)
    mixed = layer.self_attn.attend_to(layer.input_layernorm(x_t), positions=pos_t, key=key,
                                      value=value, mask=mask)
    return layer._residual_mlp(x_t, mixed)

  key, value = _rematerialise(keys_values, policy)(x, params, positions)  # [B, T, K, Dh]
  step = _rematerialise(attend_tile, policy)

  def body(carry, xs):
    x_t, pos_t, slots_t = xs
    return carry, step(x_t, params, key, value, pos_t, slots_t, key_valid)

  xs = tuple(seq_blocks(a, tile) for a in (x, positions, query_slots))
  _, out = jax.lax.scan(body, None, xs)  # [tiles, B, tile, D]
  return jnp.moveaxis(out, 0, 1).reshape(x.shape)


def _rematerialise(fn: Callable, policy: Callable[..., bool] | None) -> Callable:
  """fn under `policy`: full remat (`nothing_saveable`) as `recompute_vjp` (saves exactly the
  inputs, 16-bit words kept 16-bit, recompute ordered after the cotangent), other policies
  through `jax.checkpoint`, None as is."""
  if policy is None:
    return fn
  if policy is jax.checkpoint_policies.nothing_saveable:
    return recompute_vjp(fn)
  return jax.checkpoint(fn, policy=policy)


def _remat_layer(layer: DecoderLayer, x: jax.Array, policy: Callable[..., bool],
                 **inputs: jax.Array) -> jax.Array:
  """One cache-free layer call rematerialised with `policy` (see `_rematerialise`)."""
  graphdef, params = nnx.split(layer)

  def call(h, params, inputs):
    return nnx.merge(graphdef, params)(h, write_slots=None, cache=None, **inputs)[0]

  return _rematerialise(call, policy)(x, params, inputs)


def seq_tiling(cfg: ModelConfig, length: int) -> tuple[int, int]:
  """(tiles, padded length) of a cache-free forward over `length` tokens: one tile up to
  `cfg.seq_tile_size`, else the fewest tiles of about that size, each a multiple of the DeltaNet
  chunk and the attention block (so tiling keeps the kernels' arithmetic)."""
  if cfg.seq_tile_size is None or length <= cfg.seq_tile_size:
    return 1, length
  align = math.lcm(cfg.deltanet_chunk_size, cfg.attention_block_size)
  tiles = -(-length // cfg.seq_tile_size)
  tile = -(-(-(-length // tiles)) // align) * align
  return tiles, tiles * tile


def _layer_forward(layer: DecoderLayer, x: jax.Array, remat_policy: Callable[..., bool] | None,
                   tiles: int, **inputs: jax.Array) -> jax.Array:
  """One cache-free layer: over sequence tiles (tiles > 1, remat per tile), rematerialised
  whole, or plain."""
  if tiles > 1:
    return layer.tiled(x, tiles=tiles, policy=remat_policy, **inputs)
  if remat_policy is not None:
    return _remat_layer(layer, x, remat_policy, **inputs)
  return layer(x, write_slots=None, cache=None, **inputs)[0]


def _stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
  """One DecoderLayer whose params are `layers`' params stacked on a new
  leading axis (logical name "layers"). Reuses `layers[0]`'s graph."""
  first = layers[0]
  flats = [dict(nnx.to_flat_state(nnx.state(layer, nnx.Param))) for layer in layers]
  for path, var in flats[0].items():
    var.set_value(jnp.stack([flat[path].get_value() for flat in flats]))
    axes = var.get_metadata().get("out_sharding")
    if axes is not None:
      var.set_metadata(out_sharding=("layers", *axes))
  return first


def _layer_slice(stacked: DecoderLayer, index: int) -> DecoderLayer:
  """Layer `index` of a stacked DecoderLayer (params sliced; for cached decode)."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


class CausalLM(nnx.Module):
  """Decoder-only LM: embed -> layers -> final norm -> (tied or untied) unembed.

  Param layout of `layers` (an nnx.List):
  * `cfg.scan_layers=False`: one DecoderLayer per HF layer, `layers[i]`.
  * `cfg.scan_layers=True`: one DecoderLayer per position j of the repeating
    layer cycle (`cfg.layer_cycle`), every param stacked `[num_cycles, ...]`;
    `layers[j].<param>[c]` is HF layer `c * layer_cycle + j`. Cache-free
    forwards scan over cycles; cached decode slices the params per layer.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
                              param_dtype=cfg.param_dtype, rngs=rngs)
    # Built in HF layer order either way, so both layouts get the same init values.
    layers = [DecoderLayer(cfg, kind, rngs=rngs) for kind in cfg.layer_types]
    if cfg.scan_layers:
      period = cfg.layer_cycle
      layers = [_stack_layers(layers[j::period]) for j in range(period)]
    self.layers = nnx.List(layers)
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                        zero_centered=cfg.zero_centered_norm, param_dtype=cfg.param_dtype,
                        axis_name="embed_norm")
    lm_head = None  # tied: the embedding table doubles as the output projection
    if not cfg.tie_word_embeddings:
      w = 0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size))
      lm_head = logical_param(w.astype(cfg.param_dtype), ("vocab", "embed"))
    self.lm_head = nnx.data(lm_head)

  def layer(self, index: int) -> DecoderLayer:
    """HF layer `index` as an unstacked DecoderLayer (a slice when scanned)."""
    if not self.config.scan_layers:
      return self.layers[index]
    cycle, pos = divmod(index, self.config.layer_cycle)
    return _layer_slice(self.layers[pos], cycle)

  def _cache_free_layers(self, x: jax.Array, remat_policy: Callable[..., bool] | None,
                         tiles: int, **inputs: jax.Array) -> jax.Array:
    """All layers without a cache; stacked cycles run under one `lax.scan` step per cycle."""
    if not self.config.scan_layers:
      for i in range(self.config.num_hidden_layers):
        x = _layer_forward(self.layers[i], x, remat_policy, tiles, **inputs)
        x = sharding.constrain(x, sharding.ACTIVATION_AXES)
      return x
    graphdef, state = nnx.split(self.layers)

    def cycle(h, cycle_state):
      for layer in nnx.merge(graphdef, cycle_state):
        h = sharding.constrain(h, sharding.ACTIVATION_AXES)
        h = _layer_forward(layer, h, remat_policy, tiles, **inputs)
      return sharding.constrain(h, sharding.ACTIVATION_AXES), None

    if self.config.num_cycles == 1:  # a one-step loop only costs XLA fusion across its boundary
      return cycle(x, jax.tree.map(lambda a: a[0], state))[0]
    x, _ = jax.lax.scan(cycle, x, state)
    return x

  # -- public API -------------------------------------------------------------

  def unembed_kernel(self, dtype=None) -> jax.Array:
    """[D, V] output projection (the embedding table's transpose when tied),
    in `dtype` (cast on its shards, see `compute_param`) or the param dtype."""
    table = self.embed_tokens.embedding if self.lm_head is None else self.lm_head
    return (table[...] if dtype is None else compute_param(table, dtype)).T

  def init_cache(self, batch_size: int, max_len: int, dtype=None) -> DecodeCache:
    """Empty decode cache: key [B, K, Dh, max_len] and value [B, K, max_len, Dh] per
    attention layer (`KVCache`), conv +
    recurrent state per DeltaNet layer (recurrent state always fp32)."""
    dtype = jnp.dtype(dtype or self.config.dtype)
    cfg = self.config
    layers: list[LayerCache] = []
    for i, kind in enumerate(cfg.layer_types):
      if kind == "full_attention":
        kv, dh = cfg.num_key_value_heads, cfg.head_dim
        layers.append(KVCache(key=jnp.zeros((batch_size, kv, dh, max_len), dtype),
                              value=jnp.zeros((batch_size, kv, max_len, dh), dtype)))
      else:
        mixer = self.layers[i % cfg.layer_cycle if cfg.scan_layers else i].linear_attn
        layers.append(mixer.init_state(batch_size, dtype))
    return DecodeCache(layers=tuple(layers), lengths=jnp.zeros((batch_size,), jnp.int32))

  def hidden_states(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                    cache: DecodeCache | None = None, valid: jax.Array | None = None,
                    remat_policy: Callable[..., bool] | None = None,
                    attend_span: int | None = None):
    """Final-normed hidden states [B, T, D] (and the new cache when given one).

    Logits are `hidden @ unembed_kernel()`; GRPO uses this split to compute
    taken-token log-probs in chunks without materialising [B, T, V].
    `remat_policy` (a `jax.checkpoint_policies` entry; training only, no cache)
    rematerialises each decoder layer in the backward pass, so only what the
    policy saves stays live between a layer's forward and its backward.
    Cache-free forwards longer than `cfg.seq_tile_size` run each layer over
    sequence tiles (see `seq_tiling`, `DecoderLayer.tiled`).
    `attend_span` (static; with a cache): attention reads only the first `attend_span` cache
    slots, so short conversations in a long cache do not pay for all of it (decode time grows
    with the slots read). The caller guarantees that every row's tokens, cached and new, lie
    below it.
    """
    if remat_policy is not None and cache is not None:
      raise ValueError("remat_policy is for training forwards and cannot be used with a cache")
    length = input_ids.shape[1]
    tiles, padded = (1, length) if cache is not None else seq_tiling(self.config, length)
    if valid is None:
      valid = jnp.ones(input_ids.shape, dtype=bool)
    valid = jnp.broadcast_to(valid.astype(bool), input_ids.shape)
    if padded > length:  # whole tiles: trailing invalid tokens, which reach nothing
      input_ids, valid = pad_axis1(input_ids, padded, 0), pad_axis1(valid, padded, False)
      positions = None if positions is None else pad_axis1(positions, padded, 0)
    b = input_ids.shape[0]
    counts = jnp.cumsum(valid.astype(jnp.int32), axis=1)  # [B, T]
    start = cache.lengths[:, None] if cache is not None else jnp.zeros((b, 1), jnp.int32)
    # Slot (= absolute index) of each token; an invalid token borrows the slot
    # of the last valid token before it.
    slots = start + counts - 1
    if positions is None:
      positions = jnp.maximum(slots, 0)
    x = jnp.where(valid[..., None], self.embed_tokens(input_ids), 0)  # padding carries no value
    x = sharding.constrain(x, sharding.ACTIVATION_AXES)
    if cache is None:
      inputs = dict(positions=positions, attn_mask=AttentionMask.causal(valid), valid=valid)
      x = self._cache_free_layers(x, remat_policy, tiles, **inputs)
      return self.norm(x)[:, :length]
    max_len = cache.max_len
    span = max_len if attend_span is None else min(attend_span, max_len)
    inputs = dict(positions=positions, valid=valid,
                  attn_mask=AttentionMask.for_cache(slots, start[:, 0] + counts[:, -1], span))
    write_slots = jnp.where(valid, slots, max_len)  # out of range -> dropped
    new_layers = []
    for i, layer_cache in enumerate(cache.layers):
      x, layer_cache = self.layer(i)(x, write_slots=write_slots, cache=layer_cache, **inputs)
      x = sharding.constrain(x, sharding.ACTIVATION_AXES)
      new_layers.append(layer_cache)
    x = self.norm(x)
    return x, DecodeCache(layers=tuple(new_layers), lengths=cache.lengths + counts[:, -1])

  def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
               cache: DecodeCache | None = None, valid: jax.Array | None = None):
    """Logits [B, T, V] in fp32 (plus the new cache when given one)."""
    out = self.hidden_states(input_ids, positions=positions, cache=cache, valid=valid)
    hidden, new_cache = (out, None) if cache is None else out
    kernel = self.unembed_kernel(self.config.dtype)
    logits = jnp.dot(hidden.astype(self.config.dtype), kernel,
                     preferred_element_type=jnp.float32)
    return logits if cache is None else (logits, new_cache)


def build_model(cfg: ModelConfig, *, rngs: nnx.Rngs) -> CausalLM:
  """Randomly initialised model for `cfg` (params in cfg.param_dtype)."""
  return CausalLM(cfg, rngs=rngs)


def with_attention_impl(model: CausalLM, impl: str | None, *,
                        block_size: int | None = None) -> CausalLM:
  """A model sharing `model`'s parameters whose attention runs `impl`.

  For checkpoints loaded with `load_pretrained` (whose config comes from
  `config.json`): e.g. `with_attention_impl(model, "chunked")` for long
  sequences on CPU/TPU. impl: "xla" | "cudnn" | "chunked" | None (automatic).
  """
  changes: dict = dict(attention_impl=impl)
  if block_size is not None:
    changes["attention_block_size"] = block_size
  cfg = model.config.replace(**changes)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))

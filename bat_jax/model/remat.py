"""Rematerialisation whose saved residuals are exactly a function's inputs.

`recompute_vjp(fn)` is `fn` with a VJP that keeps only fn's arguments between the forward and
the backward pass and recomputes fn inside the backward. Unlike `jax.checkpoint` it leaves the
compiler nothing to reorder or widen:

* 16-bit float arguments are kept as raw 16-bit words (`bitcast_convert_type`), so a backend
  that computes bf16 in fp32 (XLA:CPU) cannot widen the saved copies, which would double the
  bytes the memory plan counts for every layer's saved input.
* The recomputation reads the incoming cotangent (`x + 0 * ct[0]`), so it cannot be scheduled
  before the backward reaches it; otherwise XLA may hoist every layer's recomputation to the
  start of the backward and keep all their activations live at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

_WORD = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


@jax.tree_util.register_pytree_node_class
class _Words:
  """A 16-bit float array held as raw words (dtype kept as static aux data)."""

  def __init__(self, words: jax.Array, dtype):
    self.words, self.dtype = words, dtype

  def tree_flatten(self):
    return (self.words,), self.dtype

  @classmethod
  def tree_unflatten(cls, dtype, children):
    return cls(children[0], dtype)


def _to_words(x: Any) -> Any:
  if isinstance(x, jax.Array) and x.dtype in _WORD:
    return _Words(jax.lax.bitcast_convert_type(x, _WORD[x.dtype]), x.dtype)
  return x


def _from_words(x: Any) -> Any:
  return jax.lax.bitcast_convert_type(x.words, x.dtype) if isinstance(x, _Words) else x


def _first_float(tree: Any) -> jax.Array | None:
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      return leaf
  return None


def _after(tree: Any, cotangent: Any) -> Any:
  """tree's float leaves made data-dependent on one element of `cotangent` (adds 0)."""
  ct = _first_float(cotangent)
  if ct is None:
    return tree
  zero = 0.0 * ct.reshape(-1)[0].astype(jnp.float32)
  return jax.tree.map(
      lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def recompute_vjp(fn: Callable[..., Any], *, wait_argnum: int = 0) -> Callable[..., Any]:
  """`fn(*args)` (arrays / pytrees of arrays) that saves only `args` for its VJP and recomputes
  `fn` in the backward pass (full rematerialisation, `nothing_saveable`). The recomputation
  waits for the cotangent through `args[wait_argnum]` (an activation, not the weights: adding
  0 to a weight tree would copy it)."""

  @jax.custom_vjp
  def call(*args):
    return fn(*args)

  def fwd(*args):
    return fn(*args), jax.tree.map(_to_words, args)

  def bwd(saved, cotangent):
    args = jax.tree.map(_from_words, saved, is_leaf=lambda x: isinstance(x, _Words))
    args = list(args)
    args[wait_argnum] = _after(args[wait_argnum], cotangent)
    return jax.vjp(fn, *args)[1](cotangent)

  call.defvjp(fwd, bwd)
  return call

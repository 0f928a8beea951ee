"""The chunked gated delta rule against an exact float64 recurrence on adversarial inputs.

Near-identical keys, beta -> 1 and slow or zero decay are where a Neumann-series UT inverse
cancels catastrophically (issue 11, found #1); long padding and lengths around the 64-token
chunk boundary are where padding must stay inert.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bat_jax.model.deltanet import (gated_delta_rule_chunked, gated_delta_rule_recurrent,
                                    unit_lower_inverse, unit_lower_solve)
from deltanet_cases import CASES, make_inputs, reference_recurrence

TOL = 1e-4
# The default suite runs these; the rest of CASES (same kernel, more lengths) run under -m slow.
DEFAULT_CASES = ("cos0.5_beta0.86_g-0.1", "cos0.9_beta0.86_g-0.01", "identical_beta0.999_g0",
                 "mixed_decay", "long_padding", "len65")


def _cases(names, default=DEFAULT_CASES):
  return [n if n in default else pytest.param(n, marks=pytest.mark.slow) for n in sorted(names)]

ARGS = ("q", "k", "v", "g", "beta", "state")
chunked = jax.jit(gated_delta_rule_chunked, static_argnames="chunk_size")
recurrent = jax.jit(gated_delta_rule_recurrent)


def _check(out, state, inputs):
  want_out, want_state = reference_recurrence(*(inputs[a] for a in ARGS))
  out, state = np.asarray(out, np.float64), np.asarray(state, np.float64)
  assert np.isfinite(out).all() and np.isfinite(state).all()
  err = max(np.abs(out - want_out).max(), np.abs(state - want_state).max())
  assert err <= TOL, err


@pytest.mark.parametrize("name", _cases(CASES))
def test_chunked_fp32_matches_float64_recurrence(name):
  inputs = make_inputs(CASES[name])
  with jax.default_matmul_precision("highest"):
    out, state = chunked(*(inputs[a] for a in ARGS), chunk_size=64)
  _check(out, state, inputs)


@pytest.mark.parametrize("name", _cases(["cos0.9_beta0.86_g-0.01", "identical_beta0.999_g0",
                                          "long_padding", "len129"],
                                         default=["identical_beta0.999_g0"]))
def test_chunked_bf16_inputs_compute_in_fp32(name):
  # bf16 activations (the compute dtype) go in; the kernel still runs in fp32, so it matches
  # the float64 recurrence of the same bf16-rounded inputs.
  inputs = make_inputs(CASES[name], seed=1)
  rounded = {a: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
             for a, x in inputs.items() if a in ARGS}
  with jax.default_matmul_precision("highest"):
    out, state = chunked(*(jnp.asarray(inputs[a], jnp.bfloat16) for a in ARGS), chunk_size=64)
  assert out.dtype == state.dtype == jnp.float32
  _check(out, state, rounded)


def test_recurrent_fp32_matches_float64_recurrence():
  inputs = make_inputs(CASES["cos0.9_beta0.86_g-0.01"])
  with jax.default_matmul_precision("highest"):
    _check(*recurrent(*(inputs[a] for a in ARGS)), inputs)


def test_unit_lower_inverse_is_exact_where_a_series_cancels():
  # Identical keys, beta 0.999, no decay: (I + A)^-1 has entries <= 1 while the terms of
  # sum_k (-A)^k reach ~1e17 (the old repeated-squaring form was off by ~1e11 here).
  c = 64
  a = np.tril(np.full((c, c), 0.999), -1)
  exact = np.linalg.inv(np.eye(c) + a)
  got = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(a, jnp.float32)), np.float64)
  assert np.abs(exact).max() <= 1.0 + 1e-9
  assert np.abs(got - exact).max() < 1e-5


@pytest.mark.parametrize("name", _cases(["cos0.9_beta0.86_g-0.01", "identical_beta0.999_g0",
                                          "long_padding"], default=["identical_beta0.999_g0"]))
def test_gradients_are_finite_and_match_recurrent(name):
  inputs = make_inputs(CASES[name], heads=1, dk=32, dv=16)
  args = [jnp.asarray(inputs[a]) for a in ARGS]
  weights = jnp.asarray(np.random.default_rng(0).normal(size=args[2].shape), jnp.float32)
  loss = lambda fn: lambda *a: jnp.sum(fn(*a)[0] * weights)
  argnums = tuple(range(6))
  with jax.default_matmul_precision("highest"):
    got = jax.jit(jax.grad(loss(lambda *a: gated_delta_rule_chunked(*a, chunk_size=64)),
                           argnums))(*args)
    want = jax.jit(jax.grad(loss(gated_delta_rule_recurrent), argnums))(*args)
  for name_, g_c, g_r in zip(ARGS, got, want):
    assert np.isfinite(g_c).all(), name_
    scale = max(1.0, float(jnp.abs(g_r).max()))
    assert float(jnp.abs(g_c - g_r).max()) <= 1e-3 * scale, name_


@pytest.mark.parametrize("block", [4, 16])
def test_unit_lower_solve_gradients_equal_the_dense_solve(block):
  """The solve's hand-written VJP against autodiff through a dense solve, in float64, on the
  regime that broke the old inverse: near-identical unit keys with beta -> 1."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    c, d = 32, 8
    keys = 1.0 + 1e-3 * rng.normal(size=(2, c, d))
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    a = jnp.asarray(0.999 * np.tril(keys @ keys.transpose(0, 2, 1), -1))   # [2, C, C]
    rhs = jnp.asarray(rng.normal(size=(2, c, d)))
    weights = jnp.asarray(rng.normal(size=(2, c, d)))
    dense = lambda a, r: jnp.linalg.solve(jnp.eye(c) + a, r)
    want = jax.grad(lambda a, r: (weights * dense(a, r)).sum(), (0, 1))(a, rhs)
    got = jax.grad(lambda a, r: (weights * unit_lower_solve(a, r, block)).sum(), (0, 1))(a, rhs)
    strict = np.tril(np.ones((c, c), bool), -1)
    assert np.abs(np.asarray(got[0]) - np.where(strict, want[0], 0.0)).max() <= 1e-9
    assert np.abs(np.asarray(got[1]) - np.asarray(want[1])).max() <= 1e-9
    assert np.all(np.asarray(got[0])[:, ~strict] == 0.0)  # no gradient off the strict triangle

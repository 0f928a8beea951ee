"""Adversarial gated-delta-rule inputs and an exact float64 NumPy recurrence.

Shared by tests/model/test_deltanet_stability.py and experiments/gpu/deltanet_stress.py.
Inputs follow the kernel contract of `bat_jax.model.deltanet`: q, k l2-normalised (q also
scaled by Dk^-0.5), g <= 0 log decay, beta in [0, 1], padding has g = beta = 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """One adversarial input family.

  key_cos: pairwise cosine of the keys inside a head (1.0: identical keys; None: random).
  beta, log_decay: constants, or None for random per token.
  real, pad: real tokens, then right padding (g = beta = 0 and junk q/k/v).
  """

  key_cos: float | None
  beta: float | None
  log_decay: float | None
  real: int = 64
  pad: int = 0
  key_noise: float = 0.0


CASES = {
    "cos0.5_beta0.86_g-0.1": Case(0.5, 0.86, -0.1),
    "cos0.5_beta0.86_g-0.01": Case(0.5, 0.86, -0.01),
    "cos0.9_beta0.86_g-0.01": Case(0.9, 0.86, -0.01),
    "identical_beta0.999_g0": Case(1.0, 0.999, 0.0),
    "near_identical_beta1_g-0.001": Case(1.0, 1.0, -0.001, real=200, key_noise=1e-3),
    "random_keys_zero_decay": Case(None, None, 0.0, real=130),
    "strong_decay_g-30": Case(0.9, 0.9, -30.0, real=70),
    "mixed_decay": Case(0.9, None, None, real=150),
    "long_padding": Case(0.9, 0.86, -0.01, real=40, pad=1000),
    # Lengths straddling the 64-token chunk boundary.
    "len63": Case(0.9, 0.95, -0.01, real=63),
    "len65": Case(0.9, 0.95, -0.01, real=65),
    "len127": Case(0.9, 0.95, -0.01, real=127),
    "len129": Case(0.9, 0.95, -0.01, real=129),
}


def make_inputs(case: Case, *, batch: int = 1, heads: int = 2, dk: int = 128, dv: int = 128,
                seed: int = 0) -> dict[str, np.ndarray]:
  """float32 q, k, v [B, T, H, D], g, beta [B, T, H], state [B, H, Dk, Dv], valid [B, T]."""
  rng = np.random.default_rng(seed)
  t = case.real + case.pad
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  if case.key_cos is None:
    k = unit(rng.normal(size=(batch, t, heads, dk)))
  else:  # shared direction u plus per-token noise orthogonal to it: cosine ~ key_cos
    u = unit(rng.normal(size=(batch, 1, heads, dk)))
    n = rng.normal(size=(batch, t, heads, dk))
    n = unit(n - np.sum(n * u, -1, keepdims=True) * u)
    k = unit(np.sqrt(case.key_cos) * u + np.sqrt(1 - case.key_cos) * n)
    k = unit(k + case.key_noise * rng.normal(size=k.shape))
  q = unit(rng.normal(size=(batch, t, heads, dk))) * dk ** -0.5
  v = rng.normal(size=(batch, t, heads, dv))
  beta = (rng.uniform(size=(batch, t, heads)) if case.beta is None
          else np.full((batch, t, heads), case.beta))
  g = (rng.choice([0.0, -0.01, -5.0], size=(batch, t, heads)) if case.log_decay is None
       else np.full((batch, t, heads), case.log_decay))
  state = 0.5 * rng.normal(size=(batch, heads, dk, dv))
  valid = np.arange(t)[None] < case.real
  pad = ~valid[..., None]
  g, beta = np.where(pad, 0.0, g), np.where(pad, 0.0, beta)
  # Junk at padding: large keys / values must not matter (g = beta = 0 there).
  k = np.where(pad[..., None], 50.0, k)
  v = np.where(pad[..., None], -1e4, v)
  f32 = lambda x: np.asarray(x, np.float32)
  return dict(q=f32(q), k=f32(k), v=f32(v), g=f32(g), beta=f32(beta), state=f32(state),
              valid=np.broadcast_to(valid, (batch, t)).copy())


def reference_recurrence(q, k, v, g, beta, state) -> tuple[np.ndarray, np.ndarray]:
  """The gated delta rule token by token in float64: (out [B, T, H, Dv], state)."""
  q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
  out = np.zeros(v.shape)
  for t in range(q.shape[1]):
    s = s * np.exp(g[:, t])[..., None, None]
    delta = (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], s)) * beta[:, t][..., None]
    s = s + k[:, t][..., :, None] * delta[..., None, :]
    out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s)
  return out, s

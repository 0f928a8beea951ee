"""The GRPO objective: taken-token logprobs through the model, then `policy_loss_terms`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from bat_jax import registry
from bat_jax.grpo.advantages import ADVANTAGE_ESTIMATORS, CREDIT_MODES
from bat_jax.grpo.logprobs import taken_token_logprobs
from bat_jax.grpo.loss import policy_loss_terms, validate_loss_config
from bat_jax.train.step import Batch, LossFn, RematPolicy

REQUIRED_KEYS = ("input_ids", "valid", "loss_mask", "advantages")
# Without `old_logp` the step is on-policy: its own logprobs under stop_gradient are the old ones.
OPTIONAL_KEYS = ("old_logp", "positions", "ref_logp", "sampler_logp")


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """GRPO loss options (BaT defaults: no std normalisation, seq-mean-token-mean, KL 0.006 k3).

  Attributes:
    advantage_mode: key of `ADVANTAGE_ESTIMATORS`.
    std_normalize: divide advantages by the group std.
    credit: `outcome` (the release: one advantage per sequence) or `stage` (each turn of an
      E2E episode credited by its stage's rewards on, `advantages.stage_credit`).
    credit_discount: the stage credit's discount over later stages, in [0, 1].
    clip_low, clip_high, dual_clip, kl_coef, kl_estimator, loss_agg, tis_cap, norm_length: see
      `policy_loss_terms`.
    temperature: the sampling temperature of the rollouts (logits are divided by it).
    logprob_chunk_size: sequence chunk of the taken-token logprob scan.
    logprob_save_probs: keep every chunk's [B, C, V] softmax for the backward instead of
      recomputing the logits matmul (B * T * V * 4 bytes per micro-batch: small vocabularies
      only; the 9B configs recompute).
    compute_entropy: report the mean policy entropy (one extra pass over each logits chunk).
    pg_min_entropy: the policy gradient counts only tokens where the policy's entropy (nats,
      at `temperature`, no gradient) is at least this; the KL term keeps every token. 0 (the
      release): every token. Wang et al. 2025 ("Beyond the 80/20 rule") train on the ~20%
      highest-entropy "forking" tokens only; a fixed threshold keeps micro-batching exact.
    pg_prob_weight: alpha in [0, 1]: each token's surrogate is weighted by
      `alpha * p_old(token) + 1 - alpha` (no gradient; Yang et al. 2025, "Do Not Let
      Low-Probability Tokens Over-Dominate in RL for LLMs", Advantage Reweighting). A sampled
      token of probability p moves its logit by ~(1 - p) per unit advantage, so rare tokens (a
      temperature-1 rollout's slips) dominate the update; 0 (the release) leaves it so, 1 turns
      the gradient of log p into that of p.
  """
  advantage_mode: str = "grpo"
  std_normalize: bool = False
  credit: str = "outcome"
  credit_discount: float = 1.0
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: Optional[float] = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  loss_agg: str = "seq-mean-token-mean"
  tis_cap: Optional[float] = None
  norm_length: Optional[float] = None
  temperature: float = 1.0
  logprob_chunk_size: int = 512
  logprob_save_probs: bool = False
  compute_entropy: bool = False
  pg_min_entropy: float = 0.0
  pg_prob_weight: float = 0.0

  def __post_init__(self):
    registry.check_registered("advantage_mode", self.advantage_mode, ADVANTAGE_ESTIMATORS)
    if self.credit not in CREDIT_MODES:
      raise ValueError(f"credit {self.credit!r} is not one of {CREDIT_MODES}")
    if not 0.0 <= self.credit_discount <= 1.0:
      raise ValueError(f"credit_discount {self.credit_discount} is outside [0, 1]")
    validate_loss_config(kl_estimator=self.kl_estimator, loss_agg=self.loss_agg,
                         clip_low=self.clip_low, clip_high=self.clip_high,
                         dual_clip=self.dual_clip, kl_coef=self.kl_coef, tis_cap=self.tis_cap,
                         norm_length=self.norm_length)
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    if self.pg_min_entropy < 0:
      raise ValueError(f"pg_min_entropy must be >= 0, got {self.pg_min_entropy}")
    if not 0.0 <= self.pg_prob_weight <= 1.0:
      raise ValueError(f"pg_prob_weight {self.pg_prob_weight} is outside [0, 1]")


def check_batch(batch: Batch) -> None:
  """Raises naming any missing/unknown key or a `[B, T]` shape mismatch."""
  missing = [k for k in REQUIRED_KEYS if k not in batch]
  if missing:
    raise ValueError(f"GRPO batch is missing keys {missing}; has {sorted(batch)}")
  unknown = sorted(set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
  if unknown:
    raise ValueError(f"GRPO batch has unknown keys {unknown}")
  shape = batch["input_ids"].shape
  for key in ("valid", "loss_mask", "old_logp", "positions", "ref_logp", "sampler_logp"):
    if key in batch and batch[key].shape != shape:
      raise ValueError(f"batch[{key!r}] has shape {batch[key].shape}, expected {shape}")
  if batch["advantages"].shape not in (shape[:1], shape):
    raise ValueError(f"batch['advantages'] has shape {batch['advantages'].shape}, "
                     f"expected ({shape[0]},) per sequence or {shape} per token")


def _pg_weight(cfg: GrpoConfig, old_logp: jax.Array,
               entropy: Optional[jax.Array]) -> Optional[jax.Array]:
  """The surrogate's per-token weight `[B, T]` (None: every token 1): the entropy mask times
  the probability reweighting, each only when configured."""
  weight = None
  if cfg.pg_min_entropy > 0:
    weight = (entropy >= cfg.pg_min_entropy).astype(jnp.float32)
  if cfg.pg_prob_weight > 0:
    prob = jnp.exp(jax.lax.stop_gradient(old_logp).astype(jnp.float32))
    reweight = cfg.pg_prob_weight * prob + (1.0 - cfg.pg_prob_weight)
    weight = reweight if weight is None else weight * reweight
  return weight


def grpo_loss_fn(cfg: GrpoConfig) -> LossFn:
  """A `LossFn` for `build_step_fn`; reference logprobs are never computed when kl_coef == 0."""

  def loss_fn(model: nnx.Module, batch: Batch, ref_model: Optional[nnx.Module],
              remat_policy: RematPolicy = None):
    check_batch(batch)
    logp, entropy = taken_token_logprobs(
        model, batch["input_ids"], valid=batch["valid"], positions=batch.get("positions"),
        chunk_size=cfg.logprob_chunk_size, temperature=cfg.temperature,
        with_entropy=cfg.compute_entropy or cfg.pg_min_entropy > 0, save_probs=cfg.logprob_save_probs,
        remat_policy=remat_policy)
    ref_logp = None
    if cfg.kl_coef > 0:
      ref_logp = batch.get("ref_logp")
      if ref_logp is None:
        if ref_model is None:
          raise ValueError("kl_coef > 0 needs batch['ref_logp'] or reference params")
        ref_logp, _ = taken_token_logprobs(
            ref_model, batch["input_ids"], valid=batch["valid"], positions=batch.get("positions"),
            chunk_size=cfg.logprob_chunk_size, temperature=cfg.temperature)
      ref_logp = jax.lax.stop_gradient(ref_logp)
    # On-policy (no `old_logp` given): the params being updated scored these tokens, so the
    # ratio is exactly 1 and its gradient is grad logp, without a second forward.
    old_logp = batch.get("old_logp")
    old_logp = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    pg_weight = _pg_weight(cfg, old_logp, entropy)                                 # [B, T]
    numerator, denominator, stats = policy_loss_terms(
        logp, old_logp, batch["advantages"], batch["loss_mask"], ref_logp=ref_logp,
        sampler_logp=batch.get("sampler_logp"), clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
        loss_agg=cfg.loss_agg, tis_cap=cfg.tis_cap, norm_length=cfg.norm_length,
        pg_weight=pg_weight)
    if entropy is not None:
      stats["entropy_sum"] = (entropy * batch["loss_mask"].astype(jnp.float32)).sum()
    return numerator, denominator, stats

  return loss_fn

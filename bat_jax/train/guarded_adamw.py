"""`make_optimizer`'s AdamW update with the step's finite guard inside it (no moment copies).

The step keeps params and moments unchanged when the loss or a gradient is not finite. Guarding
optax's result (`where(ok, new, old)` on its new state) leaves XLA two readers of each old moment:
the guarded moment's fusion and the param update's, which recomputes the unguarded moment from
the old one. Since the new moment is written into the old one's (donated) buffer and nothing
orders the two readers, copy insertion copies every moment at the start of the step: 8.35 GiB per
device in the bat9b GRPO step's plan, all of AdamW's state a second time. Here the param update
reads the guarded moments themselves (when the guard fails the param is kept anyway), so each old
moment has one reader, which overwrites it in place.

Same arithmetic as `optax.chain(clip_by_global_norm, adamw(...))` (optax's own moment, bias
correction and tail transforms), same state tree; tests/train/test_step.py compares the two.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

Array = jax.Array
# (grads, opt_state, params, ok) -> (new params, new opt_state), both already guarded by `ok`.
GuardedUpdate = Callable[[Any, Any, Any, Array], tuple[Any, Any]]


def guarded_adamw(cfg, schedule: optax.Schedule) -> GuardedUpdate:
  """The guarded update of `make_optimizer(cfg)` (`cfg`: an `OptimizerConfig`; `schedule`: its
  `make_schedule`). Its opt_state is that optimizer's: `(clip, (adam, decay, schedule))`, or
  `(adam, decay, schedule)` without clipping."""
  clip = None if cfg.max_grad_norm is None else optax.clip_by_global_norm(cfg.max_grad_norm)
  tail = optax.chain(optax.add_decayed_weights(cfg.weight_decay),
                     optax.scale_by_learning_rate(schedule))
  eps_root = 0.0  # optax.adamw's default

  def update(grads, opt_state, params, ok):
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    clip_state, adamw_state = (None, opt_state) if clip is None else opt_state
    if clip is not None:
      grads, new_clip = clip.update(grads, clip_state)
      clip_state = keep(new_clip, clip_state)
    adam, *tail_state = adamw_state
    # The guarded moments: each reads its old value once and is written over it.
    mu = keep(optax.tree.update_moment(grads, adam.mu, cfg.b1, 1), adam.mu)
    nu = keep(optax.tree.update_moment_per_elem_norm(grads, adam.nu, cfg.b2, 2), adam.nu)
    count = keep(numerics.safe_increment(adam.count), adam.count)
    # The update from the guarded moments (equal to optax's when ok; unused otherwise).
    mu_hat = optax.tree.bias_correction(mu, cfg.b1, count)
    nu_hat = optax.tree.bias_correction(nu, cfg.b2, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + cfg.eps), mu_hat, nu_hat)
    updates, new_tail = tail.update(updates, tuple(tail_state), params)
    new_params = keep(optax.apply_updates(params, updates), params)
    adamw_state = (adam._replace(count=count, mu=optax.tree.cast_like(mu, adam.mu),
                                 nu=optax.tree.cast_like(nu, adam.nu)), *keep(new_tail,
                                                                              tuple(tail_state)))
    return new_params, (adamw_state if clip is None else (clip_state, adamw_state))

  return update

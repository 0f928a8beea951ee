"""Placing host values onto (possibly multi-host) shardings (fetching a host's own copy back is
`bat_jax.sharding.host_local`).

Under `jax.distributed` every process runs the same program on its own devices. A tree that every
process holds in full (params built from the same seed, an SFT batch from the same grain seed) is
placed by each process building its own shards from the host values: a `jax.device_put` of
committed single-device arrays onto a sharding that spans processes gives arrays orbax cannot
save. With one process every helper is `jax.device_put` or a no-op.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np


def place(tree: Any, shardings: Any) -> Any:
  """`jax.device_put(tree, shardings)` of a tree every process holds in full. Leaves already on
  their target sharding are kept as they are (no copy, and never fetched to the host)."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, s):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
      return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

  return jax.tree.map(one, tree, shardings)


def global_batch(local: Mapping[str, np.ndarray], shardings: Mapping[str, Any]) -> dict:
  """Global `[B, ...]` arrays from each process's own rows (B = the sum of local rows); the local
  numpy batch itself with one process."""
  if jax.process_count() == 1:
    return dict(local)
  return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v))
          for k, v in local.items()}

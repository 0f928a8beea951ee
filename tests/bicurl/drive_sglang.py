"""Runs BiCuRL on the SGLang path in WORKDIR (argv[1]): `rollout.engine=sglang` with the
launcher starting `python -m bat_jax.serve` in place of `sglang.launch_server`."""

import logging
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from bat_jax import bicurl  # noqa: E402
from tests.bicurl.fast_config import fast_config  # noqa: E402

# Same flags as for SGLang where they apply (--model-path, --dtype, --context-length, ...);
# the engine sizes after them are bat_jax.serve's own.
SGLANG_PATH = {
    "grpo.rounds": 1,
    "rollout.engine": "sglang",
    "rollout.sglang.server_module": "bat_jax.serve",
    "rollout.sglang.port": 0,
    "rollout.sglang.dp_size": 1,
    "rollout.sglang.release_memory": True,
    "rollout.sglang.startup_timeout_s": 300.0,
    "rollout.sglang.max_retries": 2,
    "rollout.sglang.extra_args": ("--num-slots", "8", "--prefill-chunk", "256",
                                  "--decode-block", "8"),
}

if __name__ == "__main__":
  logging.basicConfig(level=logging.WARNING)
  logging.getLogger("bat_jax").setLevel(logging.INFO)
  cfg = fast_config()
  cfg.update_from_flattened_dict(SGLANG_PATH)
  bicurl.run(cfg, sys.argv[1])

"""One process of a two-process BiCuRL run (a subprocess target for tests/bicurl/test_multihost.py).

argv: WORKDIR PROCESS_ID PORT [NUM_PROCESSES]. jax.distributed is initialised through
launch.py's own `initialize_distributed` (CPU collectives over gloo), then the fast test config
runs with one round on a data-parallel mesh over both processes.
"""

import logging
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ml_collections  # noqa: E402

import launch  # noqa: E402
from tests.bicurl.fast_config import fast_config  # noqa: E402

if __name__ == "__main__":
  workdir, process_id, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  num_processes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
  logging.basicConfig(level=logging.WARNING,
                      format=f"[p{process_id}] %(asctime)s %(name)s %(message)s")
  logging.getLogger("bat_jax").setLevel(logging.INFO)
  launch.initialize_distributed(ml_collections.ConfigDict({
      "coordinator_address": f"127.0.0.1:{port}", "num_processes": num_processes,
      "process_id": process_id}))
  from bat_jax import bicurl  # noqa: E402  (after jax.distributed)
  # A save every SFT step: the test's mid-SFT kill point is the first one (ckpt/sft/1).
  cfg = fast_config(mesh__data=-1, grpo__rounds=1, distributed__enabled=True,
                    distributed__num_processes=num_processes, sft__checkpoint__every=1)
  bicurl.run(cfg, workdir)

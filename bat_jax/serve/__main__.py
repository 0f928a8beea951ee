"""`python -m bat_jax.serve`: the HTTP model server's entry point (see bat_jax.rollout.server.cli)."""

import signal
import sys

from bat_jax.rollout.server.cli import interrupt, main

if __name__ == "__main__":
  signal.signal(signal.SIGTERM, interrupt)
  sys.exit(main())

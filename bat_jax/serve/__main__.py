"""`python -m bat_jax.serve`: see bat_jax.serve.cli."""

import signal
import sys

from bat_jax.serve.cli import interrupt, main

if __name__ == "__main__":
  signal.signal(signal.SIGTERM, interrupt)
  sys.exit(main())

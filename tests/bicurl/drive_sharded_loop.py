"""One process of the two-host sharded-policy check (a subprocess target for
test_sharded_policy.py). argv: OUT_DIR PROCESS_ID PORT. Under jax.distributed (gloo CPU
collectives, 8 fake devices a process) it runs `sharded_loop.run_phases` on the reference
layout over two hosts (data 2 x fsdp 8) and writes its own per-device figures."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "bicurl")]

import ml_collections  # noqa: E402

import launch  # noqa: E402


def main(out: pathlib.Path, pid: int, port: int) -> None:
  launch.initialize_distributed(ml_collections.ConfigDict(
      {"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2, "process_id": pid}))
  import jax
  from sharded_loop import SMALL_WIDTHS, phase_config, run_phases, write
  assert jax.process_count() == 2 and jax.device_count() == 16
  cfg = phase_config(SMALL_WIDTHS, batch=16, hosts=2)
  figures = run_phases(cfg, out, train=len(sys.argv) > 4 and sys.argv[4] == "train")
  write(figures, out / f"figures_p{pid}.json")
  print(f"process {pid} done", flush=True)


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

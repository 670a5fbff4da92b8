"""Several hosts on one machine: the clippers on 2 processes x 4 CPU devices.

Starts two processes that join with ``jax.distributed.initialize`` (CPU
collectives over gloo) into one 8-device mesh, then in each:

* ``chain(clip_global(1.0), adam)`` under jit on a tree whose kernel is split
  over all 8 devices (4 per process): the pre-clip norm in ``stats()``;
* ``clip_per_example(axis_name="d")`` inside ``shard_map`` with the batch
  split over the 8 devices, with noise and an adaptive clip norm.

The parent then computes both on one process and prints whether they agree.

    python benchmarks/multihost_cpu.py
"""

import json
import os
import subprocess
import sys

PORT = int(os.environ.get("MULTIHOST_PORT", "12377"))


def data():
  import numpy as np

  rng = np.random.default_rng(0)
  tree = {
    "kernel": rng.normal(size=(16, 4)).astype(np.float32),
    "scale": rng.normal(size=(3,)).astype(np.float32),
  }
  return tree, rng.normal(size=(32, 5)).astype(np.float32)


def per_example(axis_name=None):
  import optaxclip

  return optaxclip.clip_per_example(
    1.0, noise_multiplier=0.5, target_quantile=0.5, axis_name=axis_name
  )


def worker(process_id):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax

  import optaxclip

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{PORT}", num_processes=2, process_id=process_id
  )
  mesh = jax.make_mesh((jax.device_count(),), ("d",))

  def global_array(x, spec):
    return jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, spec), lambda index: x[index]
    )

  tree, batch = data()
  grads = {
    "kernel": global_array(tree["kernel"], P("d")),
    "scale": global_array(tree["scale"], P()),
  }
  tx = optax.chain(optaxclip.clip_global(1.0), optax.adam(1e-2))
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(grads)
    _, state = jax.jit(tx.update)(grads, state, grads)
  norm = float(optaxclip.stats(state)["clip_global/norm"])

  dp = per_example("d")
  step = jax.jit(
    jax.shard_map(
      lambda x: dp.update({"w": x}, dp.init(None)),
      mesh=mesh,
      in_specs=P("d"),
      out_specs=P(),
    )
  )
  out, dp_state = step(global_array(batch, P("d")))
  print(
    json.dumps(
      {
        "process": jax.process_index(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "norm": norm,
        "dp_mean": np.asarray(out["w"]).tolist(),
        "dp_clip_norm": float(dp_state.clip_norm),
      }
    ),
    flush=True,
  )


def main():
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = []
  for proc in procs:
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode:
      sys.exit(f"a worker failed:\n{stderr[-3000:]}")
    results.append(json.loads(stdout.strip().splitlines()[-1]))

  import jax
  import numpy as np

  tree, batch = data()
  want_norm = float(
    np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in tree.values()))
  )
  tx = per_example()
  want_out, want_state = jax.jit(tx.update)({"w": batch}, tx.init(None))
  for r in results:
    dp_err = float(np.max(np.abs(np.asarray(r["dp_mean"]) - want_out["w"])))
    print(
      f"process {r['process']} ({r['local_devices']} of {r['devices']} "
      f"devices): clip_global norm {r['norm']:.6f} (numpy {want_norm:.6f})"
      f"; clip_per_example over the data axis: clip norm "
      f"{r['dp_clip_norm']:.6f} "
      f"(one process {float(want_state.clip_norm):.6f})"
      f", max |mean - one process| {dp_err:.1e}"
    )
    assert abs(r["norm"] - want_norm) <= 1e-5 * want_norm
    assert dp_err <= 1e-5
  print("agree")


if __name__ == "__main__":
  if len(sys.argv) > 1:
    worker(int(sys.argv[1]))
  else:
    main()

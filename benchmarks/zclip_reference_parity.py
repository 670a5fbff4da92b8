"""Parity check: optaxclip.clip_zscore against the authors' ZClip class.

Runs the ``ZClip`` class of the reference implementation
(https://github.com/bluorion-com/ZClip, ``zclip/zclip.py``) side by side with
``optaxclip.clip_zscore`` on random norm streams with spikes, for every
combination of mode, clip option, clip factor, max norm and
``skip_update_on_spike``, and compares the scale factor applied at each step
and the EMA mean and variance. The reference file is loaded from a local
checkout (not shipped here); PyTorch is not needed: the few torch names the
class touches are replaced by stand-ins, and the class's two torch-facing
methods (norm computation, in-place scaling) are overridden to read the
stream's norm and record the scale factor.

    python benchmarks/zclip_reference_parity.py /path/to/ZClip/zclip/zclip.py
"""

import argparse
import importlib.util
import itertools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import optaxclip

_LAST = {}


def _install_torch_stand_ins():
  torch = types.ModuleType("torch")
  dist = types.ModuleType("torch.distributed")
  fsdp = types.ModuleType("torch.distributed.fsdp")
  nn = types.ModuleType("torch.nn")
  utils = types.ModuleType("torch.nn.utils")

  class FullyShardedDataParallel:  # never instantiated
    pass

  def clip_grad_norm_(parameters, max_norm):
    del parameters
    norm = _LAST["norm"]
    _LAST["factor"] = min(1.0, max_norm / (norm + 1e-6))

  fsdp.FullyShardedDataParallel = FullyShardedDataParallel
  utils.clip_grad_norm_ = clip_grad_norm_
  torch.distributed, dist.fsdp, torch.nn, nn.utils = dist, fsdp, nn, utils
  sys.modules.update(
    {
      "torch": torch,
      "torch.distributed": dist,
      "torch.distributed.fsdp": fsdp,
      "torch.nn": nn,
      "torch.nn.utils": utils,
    }
  )


def _load_reference(path):
  _install_torch_stand_ins()
  spec = importlib.util.spec_from_file_location("zclip_reference", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)

  class Reference(module.ZClip):
    def _compute_grad_norm(self, model):
      return _LAST["norm"]

    def apply_in_place_clipping(self, pl_module, global_norm, max_global_norm):
      _LAST["factor"] = (
        max_global_norm / (global_norm + 1e-6)
        if global_norm > max_global_norm
        else 1.0
      )

  return Reference


class _Model:
  def modules(self):
    return []

  def parameters(self):
    return []


def _stream(steps, seed):
  rng = np.random.default_rng(seed)
  norms = (1 + 0.005 * np.arange(steps)) * np.exp(
    0.15 * rng.standard_normal(steps)
  )
  for t in rng.choice(steps, size=steps // 8, replace=False):
    norms[t] *= rng.uniform(1.5, 30)
  return norms.astype(np.float32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("zclip_py", help="path to the reference zclip/zclip.py")
  parser.add_argument("--steps", type=int, default=120)
  args = parser.parse_args()
  reference_class = _load_reference(args.zclip_py)

  worst = {"factor": 0.0, "mean": 0.0, "var": 0.0}
  steps = clipped = configs = 0
  for mode, option, factor, max_norm, skip, seed in itertools.product(
    ("zscore", "percentile"),
    ("adaptive_scaling", "mean"),
    (1.0, 0.7, 1.3),
    (None, 3.0),
    (False, True),
    (0, 1),
  ):
    if mode == "percentile" and (option == "mean" or factor != 1.0):
      continue  # both are unused in percentile mode
    configs += 1
    kwargs = dict(
      alpha=0.95,
      z_thresh=2.0,
      eps=1e-6,
      warmup_steps=7,
      mode=mode,
      clip_option=option,
      clip_factor=factor,
      skip_update_on_spike=skip,
    )
    reference = reference_class(max_grad_norm=max_norm, **kwargs)
    ours = {k: v for k, v in kwargs.items() if k != "z_thresh"}
    tx = optaxclip.clip_zscore(
      max_norm=max_norm, spike_z=kwargs["z_thresh"], **ours
    )
    update = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(2)})
    for norm in _stream(args.steps, seed):
      _LAST.update(norm=float(norm), factor=1.0)
      reference.step(_Model())
      out, state = update({"w": jnp.array([norm, 0.0])}, state)
      ours = float(out["w"][0]) / float(norm)
      worst["factor"] = max(
        worst["factor"], abs(ours - _LAST["factor"]) / _LAST["factor"]
      )
      if reference.initialized:
        worst["mean"] = max(
          worst["mean"],
          abs(float(state.mean) - reference.mean) / reference.mean,
        )
        worst["var"] = max(
          worst["var"],
          abs(float(state.var) - reference.var) / max(reference.var, 1e-12),
        )
      steps += 1
      clipped += _LAST["factor"] < 1
  print(
    f"{configs} runs (configuration x seed), {steps} steps, {clipped} "
    "clipped by the reference"
  )
  print(
    "worst relative difference: "
    + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
  )
  if max(worst.values()) > 1e-4:
    raise SystemExit("MISMATCH")


if __name__ == "__main__":
  main()

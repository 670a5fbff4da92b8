"""Which layer exploded? Per-layer gradient norms and explain() on a deep stack.

A stack of residual tanh blocks, its weights stacked along a leading layer
axis and run with ``jax.lax.scan`` (as ``nn.scan``/``nnx.scan`` stack them),
learns a random regression. One block is badly parametrised: its weight is
stored ``--gain`` times too small and multiplied back in the forward pass (a
forgotten fan-in rescaling), so its gradient is ``--gain`` times larger than
its neighbours' and Adam moves it ``--gain`` times too far: its norm
dominates and spikes. The optimizer is

    optax.chain(optaxclip.clip_global(5.0, leaf_stats=True,
                                      layer_axis={"blocks": 0, "head": None}),
                optax.adam(lr))

so the state holds each layer's pre-clip norm at no extra pass. The script
draws a heatmap (layers x steps, log colour of the pre-clip norm, clipped
steps marked), prints ``optaxclip.explain()`` for the steps with the largest
norms, and with ``--tensorboard DIR`` writes ``optaxclip.stats()`` (one
scalar per layer) and a histogram of the layer norms as TensorBoard events
(tensorboardX, from the ``examples`` extra).

    python examples/which_layer.py --out docs/which_layer.png
"""

import math
import os
import time

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax

import _flags as flags

matplotlib.use("Agg")
import matplotlib.colors
import matplotlib.pyplot as plt

import optaxclip

BATCH = 64


def init(key, layers, width, bad_layer, gain):
  """Stacked block weights (layer axis 0), a head, and each block's fixed
  forward multiplier (``gain`` for the bad block, 1 elsewhere).
  """
  k_w, k_head = jax.random.split(key)
  scale = np.ones(layers, np.float32)
  scale[bad_layer] = gain
  std = 1.0 / math.sqrt(width)
  w = jax.random.normal(k_w, (layers, width, width)) * std
  # The bad block's weight is stored `gain` times smaller: the forward pass
  # is the same as its neighbours', its gradient `gain` times larger.
  w = w / jnp.asarray(scale)[:, None, None]
  params = {
    "blocks": {"w": w, "b": jnp.zeros((layers, width))},
    "head": {"w": jax.random.normal(k_head, (width, 1)) * std},
  }
  return params, jnp.asarray(scale)


def forward(params, scale, x):
  def block(h, layer):
    w, b, s = layer
    return h + jnp.tanh(h @ (s * w) + b), None

  blocks = params["blocks"]
  h, _ = jax.lax.scan(block, x, (blocks["w"], blocks["b"], scale))
  return (h @ params["head"]["w"])[:, 0]


def make_data(key, steps, width):
  """A fixed random regression: y = sin(x . a) + noise, new batches a step."""
  k_a, k_x, k_n = jax.random.split(key, 3)
  a = jax.random.normal(k_a, (width,)) / math.sqrt(width)
  x = jax.random.normal(k_x, (steps, BATCH, width))
  y = jnp.sin(3 * x @ a) + 0.1 * jax.random.normal(k_n, (steps, BATCH))
  return x, y


def train(args):
  """Per step: the kernels' pre-clip norms (an array of steps x (layers +
  1): each block's, then the head's), whether the step was clipped, the
  loss, and the clipper's state (fetched to the host).
  """
  key_init, key_data = jax.random.split(jax.random.key(args.seed))
  params, scale = init(
    key_init, args.layers, args.width, args.bad_layer, args.gain
  )
  tx = optax.chain(
    optaxclip.clip_global(
      args.max_norm,
      leaf_stats=True,
      layer_axis={"blocks": 0, "head": None},
    ),
    optax.adam(args.lr),
  )
  opt_state = tx.init(params)
  xs, ys = make_data(key_data, args.steps, args.width)

  def loss_fn(p, x, y):
    return jnp.mean((forward(p, scale, x) - y) ** 2)

  @jax.jit
  def step(p, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state, loss

  norms, clipped, losses, states = [], [], [], []
  for t in range(args.steps):
    params, opt_state, loss = step(params, opt_state, xs[t], ys[t])
    clip_state = jax.device_get(opt_state[0])
    states.append(clip_state)
    leaf_norms = clip_state.leaf_norms
    norms.append(np.append(leaf_norms["blocks"]["w"], leaf_norms["head"]["w"]))
    clipped.append(float(clip_state.clip_fraction) > 0)
    losses.append(float(loss))
  return np.stack(norms), np.array(clipped), np.array(losses), states


def plot(norms, clipped, bad_layer, path, title):
  """Heatmap of the kernels' pre-clip norms over the steps (log colours):
  one row per block, the head's on top.
  """
  steps, layers = norms.shape
  fig, ax = plt.subplots(figsize=(9, 3.6))
  finite = norms[np.isfinite(norms) & (norms > 0)]
  low, high = (finite.min(), finite.max()) if finite.size else (1e-3, 1.0)
  image = ax.imshow(
    norms.T,
    aspect="auto",
    origin="lower",
    interpolation="nearest",
    cmap="magma",
    norm=matplotlib.colors.LogNorm(vmin=low, vmax=max(high, low * 10)),
    extent=(-0.5, steps - 0.5, -0.5, layers - 0.5),
  )
  marked = np.flatnonzero(clipped)
  ax.scatter(
    marked,
    np.full(marked.shape, layers - 0.5 + 0.35),
    marker="v",
    s=9,
    color="tab:cyan",
    clip_on=False,
    label="clipped step",
  )
  ax.set(
    xlabel="step",
    ylabel="blocks/w layer, head/w",
    yticks=range(layers),
    ylim=(-0.5, layers - 0.5 + 0.7),
  )
  ax.set_title(title, loc="left", fontsize="medium")
  ax.set_yticklabels(
    [f"{i} (bad)" if i == bad_layer else str(i) for i in range(layers - 1)]
    + ["head"]
  )
  fig.colorbar(image, ax=ax, label="pre-clip gradient norm", pad=0.02)
  ax.legend(
    loc="lower right",
    bbox_to_anchor=(1.0, 1.0),
    fontsize="small",
    frameon=False,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def tensorboard_writer():
  """The SummaryWriter of tensorboardX, imported only for --tensorboard."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    raise SystemExit(
      '--tensorboard needs tensorboardX: pip install -e ".[examples]"'
    ) from None
  return SummaryWriter


def write_tensorboard(summary_writer, logdir, states, losses):
  """stats() per step as scalars, the layer norms as a histogram."""
  with summary_writer(logdir) as writer:
    for t, (state, loss) in enumerate(zip(states, losses)):
      for key, value in optaxclip.stats(state).items():
        writer.add_scalar(key, float(value), t)
      writer.add_scalar("loss", loss, t)
      layers = np.asarray(state.leaf_norms["blocks"]["w"])
      writer.add_histogram("clip_global/leaf_norm/blocks/w", layers, t)


def parse_args(argv=None):
  parser = flags.parser(__doc__)
  flags.add_count(parser, "--steps", 300, "training steps")
  flags.add_count(parser, "--layers", 12, "blocks in the stack", low=2)
  flags.add_count(parser, "--width", 32, "width of each block")
  flags.add_count(
    parser,
    "--bad-layer",
    7,
    "the badly scaled block (counted from 0; below --layers)",
    low=0,
  )
  flags.add_positive(
    parser, "--gain", 30.0, "how much larger the bad block's gradient is"
  )
  flags.add_positive(parser, "--max-norm", 5.0, "clip_global's max_norm")
  flags.add_positive(parser, "--lr", 1e-2, "Adam's learning rate")
  flags.add_seed(parser)
  flags.add_count(
    parser,
    "--worst",
    3,
    "how many of the largest-norm steps to explain()",
    low=0,
  )
  flags.add_out(parser, "which_layer.png", "where to write the heatmap PNG")
  parser.add_argument(
    "--tensorboard",
    metavar="DIR",
    help="also write TensorBoard event files there (needs tensorboardX: "
    'pip install -e ".[examples]")',
  )
  args = parser.parse_args(argv)
  if args.bad_layer >= args.layers:
    parser.error(
      f"argument --bad-layer: must be below --layers ({args.layers}); got "
      f"{args.bad_layer}"
    )
  return args


def main(argv=None):
  args = parse_args(argv)
  print(
    f"{args.layers} residual tanh blocks of width {args.width} under "
    f"lax.scan; block {args.bad_layer} scaled x{args.gain:g}; Adam lr "
    f"{args.lr:g}; clip_global({args.max_norm:g}, leaf_stats=True); "
    f"{args.steps} steps; seed {args.seed}"
  )
  summary_writer = tensorboard_writer() if args.tensorboard else None
  start = time.perf_counter()
  norms, clipped, losses, states = train(args)
  totals = np.array([float(s.norm) for s in states])
  # The largest norms after the first tenth of the run (the start, where
  # every norm is large, says little).
  skip = args.steps // 10
  order = skip + np.argsort(
    -np.nan_to_num(totals[skip:], nan=np.inf), kind="stable"
  )
  print(
    f"\nclipped {int(clipped.sum())} of {args.steps} steps; loss "
    f"{losses[0]:.3g} -> {np.mean(losses[-max(1, args.steps // 10) :]):.3g}"
  )
  print(
    f"\nexplain() at the {min(args.worst, len(order))} largest norms after "
    f"step {skip}:"
  )
  for t in sorted(order[: args.worst]):
    for sentence in optaxclip.explain(states[t]):
      print(f"  step {t}: {sentence}")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  plot(
    norms,
    clipped,
    args.bad_layer,
    args.out,
    f"Which layer exploded? pre-clip norm of each kernel "
    f"(block {args.bad_layer} scaled x{args.gain:g})",
  )
  print(f"\nheatmap: {os.path.abspath(args.out)}")
  if summary_writer is not None:
    write_tensorboard(summary_writer, args.tensorboard, states, losses)
    print(f"tensorboard: {os.path.abspath(args.tensorboard)}")
  print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()

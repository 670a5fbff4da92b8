"""optaxclip: gradient clipping for JAX as optax transformations.

Every clipper is an ``optax.GradientTransformation`` to chain before the
optimizer::

    tx = optax.chain(optaxclip.clip_global(5.0), optax.adam(1e-3))
"""

from optaxclip._adaptive import ClipPercentileState
from optaxclip._adaptive import ClipRelativeState
from optaxclip._adaptive import ClipZscoreState
from optaxclip._adaptive import clip_percentile
from optaxclip._adaptive import clip_relative
from optaxclip._adaptive import clip_zscore
from optaxclip._clipped_grad import DpNoiseState
from optaxclip._clipped_grad import Sensitivity
from optaxclip._clipped_grad import clipped_grad
from optaxclip._clipped_grad import dp_noise
from optaxclip._explain import explain
from optaxclip._functional import clip_by_global_norm
from optaxclip._functional import clip_by_norm
from optaxclip._functional import clip_by_value
from optaxclip._functional import global_norm
from optaxclip._functional import leaf_norms
from optaxclip._guard import GuardCounts
from optaxclip._guard import GuardState
from optaxclip._guard import GuardVerdict
from optaxclip._guard import LossMonitor
from optaxclip._guard import Moments
from optaxclip._guard import Window
from optaxclip._guard import guard
from optaxclip._per_example import ClipPerExampleState
from optaxclip._per_example import clip_per_example
from optaxclip._spam import ClipSpikesAdaptiveState
from optaxclip._spam import ClipSpikesState
from optaxclip._spam import ScaleByNormEmaState
from optaxclip._spam import SpamState
from optaxclip._spam import StableSpamState
from optaxclip._spam import clip_spikes
from optaxclip._spam import clip_spikes_adaptive
from optaxclip._spam import scale_by_norm_ema
from optaxclip._spam import spam
from optaxclip._spam import stable_spam
from optaxclip._stable_adamw import StableAdamWState
from optaxclip._stable_adamw import stable_adamw
from optaxclip._static import ClipBlockRMSState
from optaxclip._static import ClipGlobalState
from optaxclip._static import ClipNormState
from optaxclip._static import ClipUnitwiseState
from optaxclip._static import ClipValueState
from optaxclip._static import clip_block_rms
from optaxclip._static import clip_global
from optaxclip._static import clip_norm
from optaxclip._static import clip_unitwise
from optaxclip._static import clip_value
from optaxclip._static import default_unit_axes
from optaxclip._stats import leaf_norm_table
from optaxclip._stats import stats
from optaxclip._stats import upgrade_state
from optaxclip._telemetry import LeafNorms
from optaxclip._watch import WatchState
from optaxclip._watch import watch
from optaxclip._wrappers import clipped

__version__ = "0.1.0"

# Names kept for code written against an earlier release: old name -> today's.
_DEPRECATED = {"LossMoments": "Moments"}


def __getattr__(name: str):
  if name in _DEPRECATED:
    import warnings

    warnings.warn(
      f"optaxclip.{name} is deprecated: use optaxclip.{_DEPRECATED[name]}.",
      DeprecationWarning,
      stacklevel=2,
    )
    return globals()[_DEPRECATED[name]]
  raise AttributeError(f"module 'optaxclip' has no attribute {name!r}")


__all__ = (
  "ClipBlockRMSState",
  "ClipGlobalState",
  "ClipNormState",
  "ClipPerExampleState",
  "ClipPercentileState",
  "ClipRelativeState",
  "ClipSpikesAdaptiveState",
  "ClipSpikesState",
  "ClipUnitwiseState",
  "ClipValueState",
  "ClipZscoreState",
  "DpNoiseState",
  "GuardCounts",
  "GuardState",
  "GuardVerdict",
  "LeafNorms",
  "LossMonitor",
  "Moments",
  "ScaleByNormEmaState",
  "Sensitivity",
  "SpamState",
  "StableAdamWState",
  "StableSpamState",
  "WatchState",
  "Window",
  "clip_block_rms",
  "clip_by_global_norm",
  "clip_by_norm",
  "clip_by_value",
  "clip_global",
  "clip_norm",
  "clip_per_example",
  "clip_percentile",
  "clip_relative",
  "clip_spikes",
  "clip_spikes_adaptive",
  "clip_unitwise",
  "clip_value",
  "clip_zscore",
  "clipped",
  "clipped_grad",
  "default_unit_axes",
  "dp_noise",
  "explain",
  "global_norm",
  "guard",
  "leaf_norm_table",
  "leaf_norms",
  "scale_by_norm_ema",
  "spam",
  "stable_adamw",
  "stable_spam",
  "stats",
  "upgrade_state",
  "watch",
)

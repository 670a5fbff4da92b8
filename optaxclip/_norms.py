"""The numerics every clipper shares, as the rest of the package names them.

Re-exported from :mod:`optaxclip._numerics`, whose docstring maps its modules
and states the rules every norm follows.
"""

from optaxclip._numerics.collectives import axis_size as axis_size
from optaxclip._numerics.collectives import may_span_devices as may_span_devices
from optaxclip._numerics.collectives import psum_sharded as psum_sharded
from optaxclip._numerics.collectives import varying as varying
from optaxclip._numerics.floats import Scaled as Scaled
from optaxclip._numerics.floats import accumulation_dtype as accumulation_dtype
from optaxclip._numerics.floats import as_scaled as as_scaled
from optaxclip._numerics.floats import exponent as exponent
from optaxclip._numerics.floats import ldexp as ldexp
from optaxclip._numerics.floats import magnitude as magnitude
from optaxclip._numerics.floats import normalize as normalize
from optaxclip._numerics.floats import pow2 as pow2
from optaxclip._numerics.floats import product as product
from optaxclip._numerics.floats import promote_types as promote_types
from optaxclip._numerics.floats import safe_root as safe_root
from optaxclip._numerics.floats import scale_exponent as scale_exponent
from optaxclip._numerics.floats import scaled_product as scaled_product
from optaxclip._numerics.floats import select as select
from optaxclip._numerics.floats import (
  tree_accumulation_dtype as tree_accumulation_dtype,
)
from optaxclip._numerics.layouts import PACKED_SCALE_SIZE as PACKED_SCALE_SIZE
from optaxclip._numerics.layouts import UnitLayout as UnitLayout
from optaxclip._numerics.layouts import handed_run as handed_run
from optaxclip._numerics.layouts import handing_over as handing_over
from optaxclip._numerics.layouts import take_leaf as take_leaf
from optaxclip._numerics.layouts import take_leaves as take_leaves
from optaxclip._numerics.maxima import SAMPLE_STRIDE as SAMPLE_STRIDE
from optaxclip._numerics.maxima import (
  largest_and_count_above as largest_and_count_above,
)
from optaxclip._numerics.maxima import (
  largest_and_count_parts as largest_and_count_parts,
)
from optaxclip._numerics.maxima import largest_magnitude as largest_magnitude
from optaxclip._numerics.maxima import largest_part as largest_part
from optaxclip._numerics.maxima import limit_bits as limit_bits
from optaxclip._numerics.maxima import magnitude_bits as magnitude_bits
from optaxclip._numerics.maxima import modulus as modulus
from optaxclip._numerics.norms import N_BUCKETS as N_BUCKETS
from optaxclip._numerics.norms import bucket_norms as bucket_norms
from optaxclip._numerics.norms import combine_norms as combine_norms
from optaxclip._numerics.norms import combine_norms_each as combine_norms_each
from optaxclip._numerics.norms import (
  combine_norms_scaled as combine_norms_scaled,
)
from optaxclip._numerics.norms import global_norm as global_norm
from optaxclip._numerics.norms import global_norm_scaled as global_norm_scaled
from optaxclip._numerics.norms import part_norms as part_norms
from optaxclip._numerics.norms import reduce_norms as reduce_norms
from optaxclip._numerics.norms import row_scales as row_scales
from optaxclip._numerics.norms import to_buckets as to_buckets
from optaxclip._numerics.norms import unit_norms as unit_norms
from optaxclip._numerics.norms import unit_norms_packed as unit_norms_packed
from optaxclip._numerics.norms import unit_norms_scaled as unit_norms_scaled
from optaxclip._numerics.packing import CHUNK_SIZE as CHUNK_SIZE
from optaxclip._numerics.packing import SMALL_LEAF_SIZE as SMALL_LEAF_SIZE
from optaxclip._numerics.packing import blocked_concat as blocked_concat
from optaxclip._numerics.packing import chunked as chunked
from optaxclip._numerics.packing import concat_parts as concat_parts
from optaxclip._numerics.packing import concatenable as concatenable
from optaxclip._numerics.packing import part_groups as part_groups
from optaxclip._numerics.packing import split_parts as split_parts
from optaxclip._numerics.packing import take_each as take_each
from optaxclip._numerics.reductions import all_true as all_true
from optaxclip._numerics.reductions import count as count
from optaxclip._numerics.reductions import max_sum_all as max_sum_all
from optaxclip._numerics.reductions import nan_extremes as nan_extremes
from optaxclip._numerics.reductions import nan_max as nan_max
from optaxclip._numerics.scaling import clip_factor as clip_factor
from optaxclip._numerics.scaling import clip_scale as clip_scale
from optaxclip._numerics.scaling import clip_scale_parts as clip_scale_parts
from optaxclip._numerics.scaling import is_scaled_down as is_scaled_down
from optaxclip._numerics.scaling import materialized as materialized
from optaxclip._numerics.scaling import materialized_rows as materialized_rows
from optaxclip._numerics.scaling import (
  materialized_scaled as materialized_scaled,
)
from optaxclip._numerics.scaling import ratio as ratio
from optaxclip._numerics.scaling import scale_all as scale_all
from optaxclip._numerics.scaling import scale_each as scale_each
from optaxclip._numerics.scaling import scale_leaf as scale_leaf
from optaxclip._numerics.scaling import (
  smallest_clip_factor as smallest_clip_factor,
)
from optaxclip._numerics.sums import exact_rows as exact_rows
from optaxclip._numerics.sums import scaled_norm as scaled_norm
from optaxclip._numerics.sums import scaled_sum as scaled_sum
from optaxclip._numerics.sums import trusted_max as trusted_max
from optaxclip._numerics.sums import trusted_min as trusted_min
from optaxclip._numerics.sums import trusted_sum as trusted_sum

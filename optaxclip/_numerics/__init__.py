"""The numerics every clipper shares, by concept.

Modules (each imports only from those listed above it):

* ``floats``: powers of two, exponents and :class:`Scaled` values (``value *
  2**exponent``); dtypes of accumulation; the root of a power sum.
* ``collectives``: which mapped axes an array spans, and the psum and pmax
  over them.
* ``reductions``: reductions that keep NaN (maxima, extremes, all, counts),
  each with derivatives from its plain formula.
* ``packing``: small leaves and per-part values packed into one vector and cut
  back (the id-keyed cache of cut pieces).
* ``sums``: power sums: the direct one, the trusted range, and the exact
  (scaled) recompute.
* ``scaling``: clip factors and applying them to leaves by exact powers of
  two.
* ``layouts``: :class:`UnitLayout` (leaves stacked into parts by unit size)
  and the thread-local hand-over of packed vectors between stages.
* ``maxima``: largest magnitudes and counts above a limit, compared as integer
  bits.
* ``norms``: p-norms per unit, per part and over the tree; combining norms;
  power-of-two buckets of sums of squares.

The rest of the package takes these names through ``optaxclip._norms``.

Three rules hold for every norm computed here:

* Accumulation happens in float32, or wider when a leaf is wider, whatever the
  leaf dtype: a bfloat16 sum over millions of elements is useless.
* Norms are overflow- and underflow-safe. The fast path is one reduction pass
  that sums ``|x|**p`` directly. When a sum is not finite (float32 overflows at
  elements near 1e19 for p=2), too small to be trusted, or exactly zero where
  the elements might be tiny rather than zero, one ``lax.cond`` recomputes the
  norms exactly, in one more pass that carries ``(M, sum (|x|/M)**p)`` with
  ``M`` the largest magnitude so far, as BLAS ``nrm2`` does (Blue, 1978;
  Anderson, "Algorithm 978: Safe scaling in the Level 1 BLAS", 2017).
  Ordinary steps pay for the fast path alone.
* No division by a data-dependent scale: XLA compiles ``x / s`` as
  ``x * (1 / s)``, and for ``s`` above 2**126 the reciprocal is subnormal and
  flushed to zero. Values are rescaled by exact powers of two instead, and
  norms and clip factors that may leave the dtype's range (the norm of
  finite float32 values can exceed 3.4e38; ``1e-3 / 1.4e37`` is below
  2**-126) are carried as :class:`Scaled`, ``value * 2**exponent``, until
  they scale a leaf.
* Derivatives of every order are finite, at a zero gradient and exactly on
  a clipping threshold too (meta-learning differentiates through
  ``update``; Hessian-vector products through the optimizer need the second
  order); the known limits at both ends of float32's range are under
  "Derivatives" below.

Non-finite gradients (the policy of every clipper)
--------------------------------------------------

A NaN or an infinity in the gradient makes the clipped update non-finite,
as in PyTorch's ``clip_grad_norm_`` and optax's ``clip_by_global_norm``, so
that the failure is visible and :func:`optaxclip.guard` (or
``optax.apply_if_finite``) can skip the step; a finite value is never passed
through unclipped because a non-finite one hid the norm. Precisely: every
value of a clipping unit whose norm is NaN or infinite comes out NaN (its
factor from :func:`clip_scale` is NaN). The unit is the whole tree for a
global clipper (``clip_global``, the ``scope="global"`` adaptive ones), a
leaf or a slice for the per-unit ones, and a leaf for ``clip_value``
(which, unlike ``optax.clip``, does not turn an infinity into
``max_delta``). Units without a NaN or inf are clipped as usual. The
statistics describe the update returned: ``norm`` is what was measured
(inf, or NaN when a NaN was seen), ``clipped_norm`` is NaN, and the units
made NaN count as clipped in ``clip_fraction``. Helpers for other
transformations: :func:`clip_scale` (the factor, NaN for a non-finite
norm), :func:`scale_leaf`, :func:`is_scaled_down` (for ``clip_fraction``),
:func:`combine_norms` (NaN/inf-aware).

Derivatives
-----------

A :class:`Scaled` factor scales a leaf by its exact powers of two first and
its mantissa last (:func:`scale_leaf`), so that the mantissa's cotangent is
``sum(ct * x * 2**E)``, of the size of the result, not ``sum(ct * x)``
(inf for leaves near float32's largest value: a NaN gradient). A zero
limit gives a zero factor whose derivative does not depend on the norm
(:func:`clip_scale`). The root of a power sum is differentiated through
the sum's mantissa and exponent (``_root``), not as ``s ** (1/p - 1)``,
whose next order flushes or overflows for sums far from 1: Hessian-vector
products of float32 p-norms are checked against float64 finite differences
on values from 1e-30 to 1e19 (tests/test_fuzz_edges.py). A power sum is
taken directly only where it and its derivatives stay well inside the
range (at most ``max * eps``: :func:`trusted_max`), and the direct sum's
derivative rule clamps the values at that bound, so that the masked-out
derivative of an untrusted sum holds no inf (``inf * 0`` is NaN). Known
limit of float32 derivatives, left as it is: where the clipped update's
inner product with the cotangent comes within a factor of four of the
dtype's range, the cotangent overflows (the factor's mantissa is a
quotient of mantissas in [0.5, 1): its derivative multiplies by up to
4). Seen with a limit near 3.4e38 on several values of that size, and
with clip_unitwise(0.375) of two values of -3.4e38 (an update of two
values of -1.3e38) whose params are the gradient. At the
other end, units whose values all lie within a few powers of two of the
smallest normal number (1e-37 and below in float32), whatever the limit:
a product inside the norm's derivative is flushed, so a gradient can
miss the norm's own term (clip_global(1.45e-37) of ``[1, 2, -1.5] *
1e-37`` against the cotangent ``[1, 2, 3]``: 0.5385 where 0.5014 is right,
in the first element; the gradient of the L2 norm of six values of
1.76e-38 reads 0 where 0.408 is right) and a Hessian-vector product can be
NaN (cases in float32 include clip_global with a limit of
1.45e-38 on values of 1e-38; clip_unitwise(2.35e-38, eps=1e-3) on values
of 1.2e-38 that are also its params; clip_norm(inf) and clip_block_rms(0)
on a leaf of six values of 1.76e-38). The flushed product: the exact
norm is ``root(q) * 2**E`` with ``q`` the power sum of the values scaled
by ``2**-E``, and reverse mode multiplies the cotangent by ``2**E *
d root / dq`` first, below the smallest normal number once ``E`` is -125
(``d norm / dq`` of ``q = 3.375``: 1.3e-38 at ``E = -124``, 0 at -125
where 6.4e-39 is right), before the scaled values' derivative (times
``2**-E``) would bring it back to the size of ``x / norm``. Not fixed:
scaling tiny values up less (a larger ``E``) underflows the power sum of
high orders instead, and a rule that cancels the two powers of two must
hold in every path the norm takes into a clip factor (as :class:`Scaled`).

``axis_name`` support: inside ``shard_map`` or ``pmap``, the partial sums of
leaves that are sharded over the named axis (or axes) are ``psum``-ed, and the
maxima ``pmax``-ed, so each device sees the norm of the whole array; leaves
replicated over the axis are counted once.

Performance notes (XLA on CPU; figures in ``docs/performance.md``): a plain
``sum(x * x)`` is the fastest reduction XLA emits, but any scalar operand in
it (a threshold, a scale) makes XLA write a broadcast of the scalar to memory,
and a square (or bfloat16 upcast) of the raw gradient is merged with the
optimizer's own and then written out in full. Hence the fast path squares the
leaf behind an ``optimization_barrier`` with no other operand, and
``clip_value``'s statistics use multi-output reductions, which need no scalar
operand (their derivatives come from the plain formulas). The exact
recompute, which runs only on steps whose sums leave the trusted range, takes
two passes that XLA vectorizes (the largest magnitude, then the values scaled
by its power of two; see :func:`scaled_sum`). With jaxlib 0.10, XLA:CPU
hands a reduction to its YNNPACK kernels when the operand is element-wise
arithmetic they take (abs, sign, convert, add, multiply, max and the like)
and no comparison or select, whose result it computes into memory first
(benchmarks/FLOORS.md); a scale that an earlier reduction computed, as in
that second pass, stays a one-element operand.
Small leaves are concatenated (in chunks of at most ``CHUNK_SIZE`` elements)
for the tree-wide norm, so that the compiled program does not grow with the
number of leaves.
"""

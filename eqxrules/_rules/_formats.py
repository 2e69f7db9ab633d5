r"""The small floating-point element formats that quantisation-aware training targets
(FP8, FP6, FP4), and exact arithmetic on them in float32.

Rounding is done arithmetically, never by casting to a format's dtype: XLA cannot
convert to every format on every backend (to FP6 on the CPU, say), nor on the oldest
JAX eqxrules supports. For a format with $m$ mantissa bits and smallest normal
exponent $e_\min$, the spacing of the format's values around $y$ is
$2^{\max(\lfloor \log_2 \lvert y \rvert \rfloor,\, e_\min) - m}$; the exponent is read
from the float32 bits (exact, unlike `log2`), and `jnp.round` (half to even) rounds
$y$ to a multiple of that spacing. Multiplying by a power of two is exact, so the
result is the format's nearest value, ties to the even mantissa, subnormals kept: the
same bits as `ml_dtypes`' cast (the tests check every bfloat16 and float16 input).

Stochastic rounding (`stochastic_round_to`) uses the same spacing: with
$v = \lvert y \rvert \cdot 2^{-k}$ the magnitude in units of the spacing and
$f = v - \lfloor v \rfloor$ (both exact in float32), the magnitude rounds up iff
$j < 2^{24} f$, where $j$ is the top 24 of 32 random bits. Both sides of that
comparison are exact, so $P(\text{up}) = \lceil 2^{24} f \rceil / 2^{24}$ exactly.
The sign is put back afterwards. `stochastic_floor` is the part that knows nothing
of float formats, for any grid of unit spacing (an integer grid, say).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class Format:
    """An element format: `mbits` mantissa bits, smallest normal exponent `emin`,
    largest finite value `max`; `emax` is the largest exponent (OCP MX's
    $e_\\max^{\\text{elem}}$)."""

    name: str
    mbits: int
    emin: int
    max: float
    inf: bool
    dtype: str  # the `ml_dtypes` / JAX dtype with these semantics

    @property
    def emax(self) -> int:
        return math.frexp(self.max)[1] - 1

    def magnitudes(self) -> list[float]:
        """Every non-negative finite value, ascending (from the definition: the
        subnormals, then each binade up to `max`)."""
        step = 2.0 ** (self.emin - self.mbits)
        out = [k * step for k in range(2**self.mbits)]
        e = self.emin
        while True:
            for k in range(2**self.mbits):
                v = (1 + k / 2**self.mbits) * 2.0**e
                if v > self.max:
                    return out
                out.append(v)
            e += 1


FORMATS = {
    f.name: f
    for f in (
        Format("e4m3", 3, -6, 448.0, False, "float8_e4m3fn"),
        Format("e5m2", 2, -14, 57344.0, True, "float8_e5m2"),
        Format("e3m2", 2, -2, 28.0, False, "float6_e3m2fn"),
        Format("e2m3", 3, 0, 7.5, False, "float6_e2m3fn"),
        Format("e2m1", 1, 0, 6.0, False, "float4_e2m1fn"),
    )
}
FORMAT_NAMES = tuple(FORMATS)


def exponent(y: Array) -> Array:
    """$\\lfloor \\log_2 \\lvert y \\rvert \\rfloor$ of a float32 `y`, from its bits:
    exact for normal numbers; -127 for zero and subnormals, 128 for inf and NaN."""
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def pow2(k: Array) -> Array:
    """$2^k$ in float32, built from its bits, for integers `k` in [-126, 127] (the
    normal range: a subnormal power of two may be flushed to zero by XLA)."""
    bits = jnp.left_shift(k.astype(jnp.int32) + 127, 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def round_to(fmt: Format, y: Array) -> Array:
    """The value of `fmt` nearest the float32 `y`, ties to the even mantissa,
    subnormals kept. `y` must be within $\\pm$`fmt.max` (or NaN, which stays NaN)."""
    k = jnp.maximum(exponent(y), fmt.emin) - fmt.mbits
    return jnp.round(y * pow2(-k)) * pow2(k)


RESOLUTION = 24
"""Random bits per element that stochastic rounding reads: the top 24 of 32."""


_MIXER = ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None))
"""The rounds of $h$ (`random_bits`): shift right, xor, then multiply by the odd
constant (none after the last shift)."""


def _mix(x: Array) -> Array:
    """$h$ of `random_bits` on uint32 `x` (Wellons' `lowbias32`)."""
    for shift, factor in _MIXER:
        x = x ^ (x >> shift)
        if factor is not None:
            x = x * jnp.uint32(factor)
    return x


def _draw_size(shape: tuple[int, ...], name: str) -> int:
    n = math.prod(shape)
    if n > 2**32:
        raise ValueError(
            f"`{name}`: `shape` (={tuple(shape)}) has {n} elements, more than the "
            f"2**32 that one draw numbers with a uint32 counter; round the array in "
            f"parts, each with its own key (`jax.random.split`)."
        )
    return n


def random_bits(key: PRNGKeyArray, shape: tuple[int, ...]) -> Array:
    r"""The uint32 random bits stochastic rounding reads, one word per element of
    `shape`: a counter-based generator keyed from `key`. Two seed words
    $(s_0, s_1)$ = `jax.random.bits(key, (2,), jnp.uint32)` are drawn from the key
    once; element $i$ (its flat row-major index, $0 \le i < 2^{32}$) gets

    $$w_i = h\big(h(i \oplus s_0) \oplus s_1\big), \qquad
    h = \sigma_{16} \circ \mu_{\mathtt{846ca68b}} \circ \sigma_{15} \circ
    \mu_{\mathtt{7feb352d}} \circ \sigma_{16},$$

    with $\sigma_r(x) = x \oplus \lfloor x / 2^r \rfloor$ and
    $\mu_c(x) = c\,x \bmod 2^{32}$: $h$ is Wellons' `lowbias32` integer hash.
    Every step of $h$ is a bijection of the uint32 words ($\sigma_r$ is undone
    by repeating it, $c$ is odd), so:

    - for any one element, $w_i$ is uniform whenever $s_1$ is (it is
      $h(\,\cdot \oplus s_1)$ of a word independent of $s_1$): the top 24 bits
      $j$ that stochastic rounding compares are exactly uniform over keys, and the
      rounding's bias is what the uniform $j$ gives (below $2^{-24}$ of a gap);
    - within one draw no two elements share a word (distinct $i$, distinct $w_i$);
    - the same key gives the same words, eagerly and under `jit`; keys that
      `jax.random` makes independent (`split`, `fold_in`) give independent seeds.

    Independence of neighbouring and distant elements, and of split and folded-in
    keys, is checked statistically (`tests/test_random_bits.py`). The cost is
    about 14 integer operations per element, which XLA fuses into the rounding:
    on a CPU, about a tenth of the time of `jax.random.bits(key, shape,
    jnp.uint32)` (threefry) for the same shape. A shape of more than $2^{32}$ elements is a `ValueError`
    (the counter would wrap)."""
    n = _draw_size(shape, "random_bits")
    s = jax.random.bits(key, (2,), jnp.uint32)
    i = jax.lax.iota(jnp.uint32, n).reshape(shape)
    return _mix(_mix(i ^ s[0]) ^ s[1])


def reference_random_bits(key: PRNGKeyArray, shape: tuple[int, ...]) -> Array:
    r"""An independent `random_bits`, written from its docstring: the flat index from
    one iota per axis and the row-major strides, and each product
    $c\,x \bmod 2^{32}$ from 16-bit halves (no product but exact ones, the sums
    wrapping): $c_{\mathrm{lo}} x_{\mathrm{lo}} + 2^{16}\big((c_{\mathrm{hi}}
    x_{\mathrm{lo}} + c_{\mathrm{lo}} x_{\mathrm{hi}}) \bmod 2^{16}\big)$."""
    _draw_size(shape, "reference_random_bits")
    seed = jax.random.bits(key, (2,), jnp.uint32)
    i = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        i = i + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]

    def times(c: int, x: Array) -> Array:
        c_lo, c_hi = jnp.uint32(c & 0xFFFF), jnp.uint32(c >> 16)
        x_lo, x_hi = x & jnp.uint32(0xFFFF), x >> jnp.uint32(16)
        cross = (c_hi * x_lo + c_lo * x_hi) & jnp.uint32(0xFFFF)
        return c_lo * x_lo + cross * jnp.uint32(2**16)

    def h(x: Array) -> Array:
        x = jnp.bitwise_xor(x, jnp.right_shift(x, jnp.uint32(16)))
        x = times(0x7FEB352D, x)
        x = jnp.bitwise_xor(x, jnp.right_shift(x, jnp.uint32(15)))
        x = times(0x846CA68B, x)
        return jnp.bitwise_xor(x, jnp.right_shift(x, jnp.uint32(16)))

    return h(jnp.bitwise_xor(h(jnp.bitwise_xor(i, seed[0])), seed[1]))


def stochastic_floor(v: Array, bits: Array, resolution: int = RESOLUTION) -> Array:
    r"""$\lfloor v \rfloor + [\,j < 2^R (v - \lfloor v \rfloor)\,]$ for a float32
    `v` >= 0 (or NaN, which stays NaN), with $j$ the top $R$ = `resolution` bits of
    the uint32 `bits`: `v` rounded down or up to an integer, up with probability
    $\lceil 2^R f \rceil / 2^R$ for uniform bits, where $f = v - \lfloor v \rfloor$.

    Exact: $f$ is (Sterbenz: $\lfloor v \rfloor \le v \le 2\lfloor v \rfloor$
    for $v \ge 1$), and so are $2^R f$ and $j < 2^R$, so the comparison is; the
    probability exceeds $f$ by less than $2^{-R}$, and by nothing where $2^R f$ is
    an integer. An integer `v` ($f = 0$) never moves. (Not for negative `v`: there
    $v - \lfloor v \rfloor$ may round; round the magnitude and put the sign back.)
    A `resolution` other than `RESOLUTION` is for tests that enumerate every $j$."""
    lo = jnp.floor(v)
    j = (bits >> (32 - resolution)).astype(jnp.float32)
    return lo + (j < (v - lo) * float(2**resolution))


def stochastic_move(g: Array, bits: Array, resolution: int = RESOLUTION) -> Array:
    r"""$[\,2j + 1 < 2^{R+1} \lvert g \rvert\,]$, with $j$ the top $R$ =
    `resolution` bits of the uint32 `bits`: whether an input $g$ steps away from the
    level it is nearest, $g$ being its signed distance from it in steps
    ($\lvert g \rvert \le 1/2$, or a little more where $g$ is rounded). The
    midpoint $u = (j + 1/2)\,2^{-R}$ of each of the $2^R$ intervals of $[0, 1)$
    is compared with $\lvert g \rvert$, so for uniform bits

    $$P(\text{move}) = \frac{\#\{j : 2j + 1 < 2^{R+1} \lvert g \rvert\}}{2^R},
    \qquad \big\lvert P(\text{move}) - \lvert g \rvert \big\rvert \le
    2^{-R-1},$$

    and an input within $2^{-R-1}$ of its level never moves, whichever side of it
    a rounded $g$ puts it: a residual computed with a smaller absolute error never
    steps to a level that is not a neighbour. Exact: $2^{R+1}\lvert g \rvert$ is
    exact, an integer $a$ is below it iff it is below its `ceil`, and both are
    compared as integers (`2j + 1` needs 25 bits: not float32's). NaN gives some
    boolean."""
    j = bits >> (32 - resolution)
    top = float(2 ** (resolution + 1))
    bound = jnp.ceil(jnp.minimum(jnp.abs(g) * top, top)).astype(jnp.uint32)
    return 2 * j + 1 < bound


def stochastic_round_to(
    fmt: Format, y: Array, bits: Array, resolution: int = RESOLUTION
) -> Array:
    r"""`y` rounded stochastically to one of the two values of `fmt` around it, by
    the uint32 `bits` (one word per element, e.g. `random_bits(key, y.shape)`): up
    in magnitude with probability $\lceil 2^{24} f \rceil / 2^{24}$, $f$ the
    fraction of the way from the lower to the upper magnitude, the sign kept (so
    the same bits round `-y` to minus what they round `y` to). Subnormals of the
    format are kept; a value of the format stays itself; `y` must be within
    $\pm$`fmt.max` (then so is the upper value), or NaN, which stays NaN."""
    k = jnp.maximum(exponent(y), fmt.emin) - fmt.mbits
    v = stochastic_floor(jnp.abs(y) * pow2(-k), bits, resolution)
    return jnp.copysign(v * pow2(k), y)


def round_with(fmt: Format, y: Array, bits: Array | None) -> Array:
    """`round_to` where `bits` is `None`, else `stochastic_round_to` with `bits`."""
    return round_to(fmt, y) if bits is None else stochastic_round_to(fmt, y, bits)


def amax(v: Array, axis: int | tuple[int, ...] | None = None, keepdims: bool = False):
    """The largest magnitude of `v` over `axis` (0 for none), NaN where any
    element is NaN. (XLA's CPU reductions drop a NaN from a `max` of 4096
    elements or more, from jaxlib 0.10 at least: `jnp.max` alone would give the
    scale of the other elements, and a NaN would reach one output element where
    the scale is to make the whole tensor NaN.)"""
    m = jnp.max(jnp.abs(v), axis=axis, keepdims=keepdims, initial=0.0)
    nan = jnp.any(jnp.isnan(v), axis=axis, keepdims=keepdims)
    return jnp.where(nan, jnp.nan, m)


def reference_amax(v: Array, axis: Any = None, keepdims: bool = False) -> Array:
    """An independent `amax`: the count of NaNs, not a boolean reduction."""
    m = jnp.abs(v).max(axis=axis, keepdims=keepdims, initial=0.0)
    nans = jnp.sum(jnp.isnan(v).astype(jnp.int32), axis=axis, keepdims=keepdims)
    return jnp.where(nans > 0, jnp.nan, m)


def divide(a: Array, b: Array | float) -> Array:
    """`a / b` as the backend divides: correctly rounded on the CPU (a GPU's float32
    division is within 2 ulps: CUDA's `div.full.f32`, measured on an H200, so a
    scale there may differ from the CPU's in its last bit). XLA rewrites a
    division by a scalar broadcast (a constant or not) into a multiplication by
    its reciprocal, which is up to an ulp off; a divisor that depends on `a` is
    left a division. (`a` is NaN where the divisor is.)"""
    return a / jnp.where(jnp.isnan(a), a, b)


def reference_round_to(fmt: Format, y: Array) -> Array:
    """An independent `round_to`: the nearest of the format's values, listed from its
    definition, by a search; a tie goes to the value of even index (its mantissa's
    last bit is 0)."""
    grid = jnp.asarray(fmt.magnitudes(), jnp.float32)
    a = jnp.abs(y)
    i = jnp.clip(jnp.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 1)
    lo, hi = grid[i], grid[jnp.minimum(i + 1, len(grid) - 1)]
    down, up = a - lo, hi - a
    even = (i % 2) == 0
    pick = jnp.where((down < up) | ((down == up) & even), lo, hi)
    pick = jnp.where(a >= grid[-1], grid[-1], pick)
    return jnp.where(jnp.isnan(y), y, jnp.copysign(pick, y))


def reference_stochastic_round_to(fmt: Format, y: Array, bits: Array) -> Array:
    r"""An independent `stochastic_round_to`: the format's values around
    $\lvert y \rvert$, $L \le \lvert y \rvert < U$, found by a search of the list
    of its values; up iff $u < (\lvert y \rvert - L)/(U - L)$, where
    $u = j \cdot 2^{-24}$ for the top 24 bits $j$ (every step exact in float32)."""
    grid = jnp.asarray(fmt.magnitudes(), jnp.float32)
    a = jnp.abs(y)
    i = jnp.clip(jnp.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 2)
    lo, hi = grid[i], grid[i + 1]
    u = (bits >> (32 - RESOLUTION)).astype(jnp.float32) * 2.0**-RESOLUTION
    pick = jnp.where(u < (a - lo) / (hi - lo), hi, lo)
    return jnp.where(jnp.isnan(y), y, jnp.copysign(pick, y))


def extremes(
    reference: Callable[[Array, Array], Array], x: Array
) -> tuple[Array, Array]:
    r"""The two values a stochastic rounding may give each element of `x`, lower
    first: `reference(x, bits)` at all-zero bits and at all-one bits. With the
    rounding of `stochastic_round_to`, $j = 0$ rounds up every magnitude with
    $f > 0$, and $j = 2^{24} - 1$ rounds down every one with
    $f \le 1 - 2^{-24}$, which is every $f < 1$: $2^{24} f$ is an integer, or, below
    half the smallest subnormal, $f < 1/2$. (Not for the grids' rule,
    `stochastic_move`, which steps from the nearest level.)"""
    zeros = jnp.zeros(jnp.shape(x), jnp.uint32)
    a, b = reference(x, zeros), reference(x, ~zeros)
    return jnp.minimum(a, b), jnp.maximum(a, b)


def reference_round_with(fmt: Format, y: Array, bits: Array | None) -> Array:
    """`reference_round_to` where `bits` is `None`, else
    `reference_stochastic_round_to` with `bits`."""
    if bits is None:
        return reference_round_to(fmt, y)
    return reference_stochastic_round_to(fmt, y, bits)


def ties(fmt: Format, count: int = 3) -> list[float]:
    """Midpoints between the format's values, from the largest down: where rounding
    goes to even."""
    m = fmt.magnitudes()
    return [(a + b) / 2 for a, b in zip(m[-count - 1 : -1], m[-count:])]

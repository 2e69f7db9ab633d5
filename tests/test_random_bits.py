"""The random bits of stochastic rounding (`random_bits`, issue 26 §4): a counter-based
generator, `w_i = h(h(i ^ s0) ^ s1)` with `h` Wellons' `lowbias32` and two seed words
drawn from the key by `jax.random.bits`.

- Bit for bit: `random_bits`, and the rules' references' `reference_random_bits`,
  equal the NumPy implementation in `bits_helpers.py` (planted: a column-major
  counter, the two constants swapped).
- `h` is a bijection (its inverse, written here, undoes it), so each element's word
  is exactly uniform over keys and stochastic rounding's bias is that of uniform
  bits (planted: an even multiplier).
- Same key, same draw, eagerly, under `jit` and under `vmap`; more than 2^32
  elements is a `ValueError`.
- Independence, tested statistically: the top 4 bits of pairs of words (256 cells)
  at lags 1, 2, 4, ..., 2^17 within a draw of 2^18 words, between the draws of
  consecutive `jax.random.split` keys and of consecutive `fold_in` keys; the top 8
  bits of one draw, and the top 4 bits of one element over 2^14 keys.

**The test.** Under independent uniform words, a cell of probability `p` holds
`K ~ Binomial(N, p)` of `N` pairs; by Chernoff's bound
`P(K/N >= a) <= exp(-N KL(a || p))` for `a >= p` (and below alike). A table fails
where some cell has `N KL(K/N || p) > ln(2 · cells · TABLES / RATE)`: over both
sides, every cell and the `TABLES` tables of the shipped generator, the chance of a
false failure is at most `RATE` (for a key drawn at random; the keys here are fixed,
so the test is deterministic). Within one draw the shipped words are distinct, not
independent: that moves a cell's probability by a relative `2^-28`, far below what
`N` pairs resolve. Planted, each caught by the same check: a generator of period
2^16, one whose neighbours differ by a constant (a Weyl sequence: `w_{i+1}` derived
from `w_i`), one that ignores the key, and one that xors the key in after hashing
(each key's draw then the same draw xored with a constant).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bits_helpers import lowbias32, numpy_bits

from eqxrules._rules._formats import _mix, random_bits, reference_random_bits

RATE = 1e-6  # the false-fail rate of all the shipped generator's tables together
SIZE = 2**18  # words in the draw whose lags are tested
LAGS = tuple(2**k for k in range(18))  # 1 ... 2^17: rows, columns, pages of arrays
KEYS = 64  # consecutive split / fold_in keys, paired (0, 1), (2, 3), ...
WORDS = 4096  # words per key in the split and fold_in tables
OVER_KEYS = 2**14  # keys for one element's word
ELEMENTS = (0, 63)  # the elements tested over keys
TABLES = len(LAGS) + 2 + 1 + len(ELEMENTS)
KEY = jax.random.key(26)
U32 = jnp.uint32


def _kl(a: np.ndarray, p: float) -> np.ndarray:
    """KL(a || p) of Bernoulli laws, elementwise (0 log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(a > 0, a * np.log(a / p), 0.0)
        down = np.where(a < 1, (1 - a) * np.log((1 - a) / (1 - p)), 0.0)
    return up + down


def bad_cells(codes: np.ndarray, cells: int) -> list[tuple[int, int, float]]:
    """The cells of the table of `codes` (each in `[0, cells)`) whose counts fail
    the Chernoff bound at a false-fail rate of `RATE / TABLES`, as
    `(cell, count, expected)`."""
    counts = np.bincount(codes.ravel(), minlength=cells)
    n, p = codes.size, 1 / cells
    threshold = math.log(2 * cells * TABLES / RATE)
    stat = n * _kl(counts / n, p)
    return [(int(c), int(counts[c]), n * p) for c in np.flatnonzero(stat > threshold)]


def pair_codes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The top 4 bits of `a` and of `b`, as one of 256 cells."""
    return ((a >> 28) << 4 | (b >> 28)).astype(np.int64)


def lag_failures(gen) -> dict[int, list]:
    """Per lag `d`, the failing cells of the pairs `(w_i, w_{i+d})` over the `i` whose
    bit `d` is 0 (disjoint pairs, `SIZE / 2` of them)."""
    w = np.asarray(gen(KEY, (SIZE // 512, 512)), np.uint32).ravel()
    i = np.arange(SIZE)
    out = {}
    for d in LAGS:
        first = i[(i & d) == 0]
        bad = bad_cells(pair_codes(w[first], w[first + d]), 256)
        if bad:
            out[d] = bad
    return out


def key_failures(gen, keys) -> list:
    """The failing cells of the pairs of words at the same element of the draws of
    keys `(0, 1)`, `(2, 3)`, ..."""
    draws = np.stack([np.asarray(gen(k, (WORDS,)), np.uint32) for k in keys])
    return bad_cells(pair_codes(draws[0::2], draws[1::2]), 256)


def split_keys() -> list:
    return list(jax.random.split(KEY, KEYS))


def folded_keys() -> list:
    return [jax.random.fold_in(KEY, t) for t in range(KEYS)]


# Planted generators.
def period_2_16(key, shape):
    """Repeats after 2^16 elements."""
    w = random_bits(key, (2**16,))
    return w[jnp.arange(math.prod(shape)) % 2**16].reshape(shape)


def weyl(key, shape):
    """`w_{i+1} = w_i + 0x9e3779b9`: neighbours correlated."""
    s = jax.random.bits(key, (), U32)
    return s + jax.lax.iota(U32, math.prod(shape)).reshape(shape) * U32(0x9E3779B9)


def ignores_key(key, shape):
    return random_bits(jax.random.key(0), shape)


def key_after_hashing(key, shape):
    """The seed xored in after the hash: each key's draw is one draw xored with a
    constant."""
    s = jax.random.bits(key, (), U32)
    return _mix(_mix(jax.lax.iota(U32, math.prod(shape)).reshape(shape))) ^ s


@pytest.mark.first_case_quick
# Bit for bit.
@pytest.mark.parametrize("shape", [(), (1,), (5, 7), (3, 4, 33), (2, 1, 1024)])
@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5])
def test_random_bits_is_the_documented_generator(shape, seed):
    for key in (jax.random.key(seed), jax.random.PRNGKey(seed)):
        want = numpy_bits(key, shape)
        for got in (
            random_bits(key, shape),
            jax.jit(random_bits, static_argnums=1)(key, shape),
            reference_random_bits(key, shape),
            jax.jit(reference_random_bits, static_argnums=1)(key, shape),
        ):
            assert got.dtype == jnp.uint32 and got.shape == shape
            np.testing.assert_array_equal(got, want)


def _column_major(key, shape):
    return random_bits(key, shape[::-1]).T


def _constants_swapped(key, shape):
    s0, s1 = (np.uint64(s) for s in np.asarray(jax.random.bits(key, (2,), U32)))
    i = np.arange(math.prod(shape), dtype=np.uint64)

    def h(x):
        m = np.uint64(0xFFFFFFFF)
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x846CA68B)) & m
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x7FEB352D)) & m
        return x ^ (x >> np.uint64(16))

    return h(h(i ^ s0) ^ s1).astype(np.uint32).reshape(shape)


@pytest.mark.parametrize("defect", [_column_major, _constants_swapped])
def test_planted_generators_differ_from_the_documented_one(defect):
    key = jax.random.key(1)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(defect(key, (5, 7)), numpy_bits(key, (5, 7)))


# `h` is a bijection.
def _unmix(y: np.ndarray) -> np.ndarray:
    """The inverse of `lowbias32`, step by step: `x ^ (x >> r)` is undone by xoring
    in the shifts `r, 2r, ...`; a product by odd `c` by one by `c^-1 mod 2^32`."""
    m = np.uint64(0xFFFFFFFF)

    def unshift(x, r):
        out, s = x, r
        while s < 32:
            out = out ^ (x >> np.uint64(s))
            s += r
        return out

    y = unshift(y, 16)
    y = (y * np.uint64(pow(0x846CA68B, -1, 2**32))) & m
    y = unshift(y, 15)
    y = (y * np.uint64(pow(0x7FEB352D, -1, 2**32))) & m
    return unshift(y, 16)


def _words() -> np.ndarray:
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 2**15, 2**16, 2**31, 2**32 - 1], np.uint64)
    return np.concatenate([edges, rng.integers(0, 2**32, 2**20, dtype=np.uint64)])


def _inverts(mix) -> bool:
    x = _words()
    y = np.asarray(mix(jnp.asarray(x.astype(np.uint32))), np.uint32)
    return np.array_equal(_unmix(y.astype(np.uint64)), x)


def test_the_hash_is_a_bijection():
    assert np.array_equal(_unmix(lowbias32(_words())), _words())
    assert _inverts(_mix)


def test_planted_non_bijective_hash_is_caught():
    def even(x):  # the first multiplier made even: x and x + 2^31 collide
        x = x ^ (x >> 16)
        x = x * U32(0x7FEB352C)
        x = x ^ (x >> 15)
        x = x * U32(0x846CA68B)
        return x ^ (x >> 16)

    assert not _inverts(even)


# Same key, same draw; the size limit.
def test_the_same_key_gives_the_same_draw_eager_jitted_and_mapped():
    keys = jax.random.split(KEY, 3)
    eager = np.stack([random_bits(k, (4, 8)) for k in keys])
    jitted = jax.jit(random_bits, static_argnums=1)
    np.testing.assert_array_equal(jitted(keys[1], (4, 8)), eager[1])
    np.testing.assert_array_equal(random_bits(keys[1], (4, 8)), eager[1])
    np.testing.assert_array_equal(
        jax.vmap(lambda k: random_bits(k, (4, 8)))(keys), eager
    )


def test_more_than_2_32_elements_is_a_value_error():
    shape = (2**16, 2**16 + 1)
    for fn in (random_bits, reference_random_bits):
        with pytest.raises(ValueError, match=r"`shape` \(=\(65536, 65537\)\).*2\*\*32"):
            fn(KEY, shape)
    out = jax.eval_shape(lambda k: random_bits(k, (2**16, 2**16)), KEY)
    assert out.shape == (2**16, 2**16) and out.dtype == jnp.uint32


# Independence.
def test_neighbouring_and_distant_elements_are_independent():
    assert lag_failures(random_bits) == {}


def test_one_draw_is_uniform():
    w = np.asarray(random_bits(KEY, (SIZE,)), np.uint32)
    assert bad_cells((w >> 24).astype(np.int64), 256) == []


@pytest.mark.parametrize("keys", [split_keys, folded_keys])
def test_split_and_folded_keys_give_independent_draws(keys):
    assert key_failures(random_bits, keys()) == []


def test_each_element_is_uniform_over_keys():
    keys = jax.random.split(KEY, OVER_KEYS)
    draws = np.asarray(jax.vmap(lambda k: random_bits(k, (64,)))(keys), np.uint32)
    for e in ELEMENTS:
        assert bad_cells((draws[:, e] >> 28).astype(np.int64), 16) == [], e


def test_planted_period_2_16_is_caught():
    failures = lag_failures(period_2_16)
    assert 2**16 in failures and 2**17 in failures, sorted(failures)


def test_planted_correlated_neighbours_are_caught():
    assert 1 in lag_failures(weyl)


@pytest.mark.parametrize("defect", [ignores_key, key_after_hashing])
@pytest.mark.parametrize("keys", [split_keys, folded_keys])
def test_planted_key_defects_are_caught(defect, keys):
    assert key_failures(defect, keys()) != []


def test_planted_key_defect_is_caught_over_keys():
    keys = jax.random.split(KEY, OVER_KEYS)
    draws = np.asarray(jax.vmap(lambda k: ignores_key(k, (64,)))(keys), np.uint32)
    assert bad_cells((draws[:, 0] >> 28).astype(np.int64), 16) != []

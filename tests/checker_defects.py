"""What the checker's self-tests share: an input holding |x| = 1 exactly, a sign
STE (correct, or with its mask exclusive), the textbook `ScaledModel` rule's Module
and its plain-autodiff reference, and a `custom_vjp` tanh with a planted scale or
dtype."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

X = jnp.array([-1.5, -1.0, -0.3, 0.0, 0.4, 1.0, 2.0])  # includes |x| = clip exactly


def failed(excinfo) -> list[str]:
    """The failed checks of a `pytest.raises(RuleCheckError)`."""
    return excinfo.value.failed


def sign(x):
    return jnp.where(x >= 0, 1.0, -1.0).astype(x.dtype)


def surrogate(x):
    return jnp.where(jnp.abs(x) <= 1.0, x, 0.0)


def make_ste(inclusive: bool):
    """A sign STE; planted, with `inclusive=False`: its mask is exclusive at 1."""

    @jax.custom_jvp
    def ste(x):
        return sign(x)

    @ste.defjvp
    def ste_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        mask = jnp.abs(x) <= 1.0 if inclusive else jnp.abs(x) < 1.0
        return ste(x), t * mask.astype(x.dtype)

    return ste


class TextbookScaled(eqx.Module):
    """`sub_model(x / scale)` through the textbook custom JVP, which reads only the
    input's tangent (`tangents[1]`). Subclasses plant other rules."""

    sub_model: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    def __call__(self, x):
        return _textbook(self, x)


@eqx.filter_custom_jvp
def _textbook(model, x):
    return model.sub_model(x / model.scale)


@_textbook.def_jvp
def _textbook_jvp(primals, tangents):
    model, x = primals
    out = model.sub_model(x / model.scale)
    # The textbook bug: only the input tangent is read.
    _, t_out = jax.jvp(
        model.sub_model, (x / model.scale,), (tangents[1] / model.scale,)
    )
    return out, t_out


@pytest.fixture
def linear():
    return eqx.nn.Linear(3, 1, key=jax.random.key(0))


def plain(m, x):
    """The reference of every `TextbookScaled`: plain autodiff of the same value."""
    return m.sub_model(x / m.scale)


def make_vjp_rule(scale: float = 1.0, dtype=None):
    """A `custom_vjp` tanh; planted, its backward `scale` times too large, or its
    cotangent cast to `dtype`."""

    @jax.custom_vjp
    def f(x):
        return jnp.tanh(x)

    def fwd(x):
        return jnp.tanh(x), x

    def bwd(x, ct):
        g = scale * ct * (1 - jnp.tanh(x) ** 2)
        return (g if dtype is None else g.astype(dtype),)

    f.defvjp(fwd, bwd)
    return f

"""`quantize`'s `recipe` argument (issue 40 §3): a recipe class or factory passed
uncalled (`recipe=recipes.mxfp8`) is a `TypeError` naming it and the call to make,
where main took it for a function of the path and failed inside with "mxfp8()
takes 0 positional arguments but 1 was given". Every public factory and recipe
class of `eqxrules.recipes` is tried (found by what they are, not listed), and a
user's own; a function of the path still works. Main's check is planted beside.
"""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
import jax
import pytest

import eqxrules
from eqxrules import _layers, recipes

# Width 128: every recipe takes it (fp8_blockwise() tiles by 128).
MLP = eqx.nn.MLP(128, 128, 128, 1, key=jax.random.key(0))
PUBLIC = {n: getattr(recipes, n) for n in dir(recipes) if not n.startswith("_")}
CLASSES = {
    n: o
    for n, o in PUBLIC.items()
    if isinstance(o, type) and issubclass(o, recipes.Recipe) and o is not recipes.Recipe
}
FACTORIES = {
    n: o
    for n, o in PUBLIC.items()
    if inspect.isfunction(o) and isinstance(o(), recipes.Recipe)
}
UNCALLED = {**CLASSES, **FACTORIES}


def test_the_recipes_module_has_factories_and_classes():
    assert {"fp8", "mxfp8", "nvfp4", "identity"} <= set(FACTORIES)
    assert {"FP8", "MXFP8", "NVFP4", "Custom"} <= set(CLASSES)


def assert_names_the_uncalled(message: str, shown: str) -> None:
    """What the error must say: who, `recipe`, what was given, the call to make."""
    for part in ("`quantize`", f"`recipe` (=`{shown}`)", f"`recipe={shown}()`"):
        assert part in message, (part, message)


@pytest.mark.parametrize("name", UNCALLED)
def test_an_uncalled_recipe_is_named_with_the_call_to_make(name):
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(MLP, recipe=UNCALLED[name])
    assert_names_the_uncalled(str(info.value), f"eqxrules.recipes.{name}")
    called = eqxrules.quantize(MLP, recipe=UNCALLED[name]())  # what it says works
    assert isinstance(called.layers[0], eqxrules.QuantizedLinear)


def my_recipe() -> Any:
    return recipes.mxfp8()


def test_a_users_factory_is_named():
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(MLP, recipe=my_recipe)
    assert_names_the_uncalled(str(info.value), "my_recipe")
    assert "a function of no argument" in str(info.value)


@pytest.mark.parametrize(
    "recipe, match",
    [
        (
            lambda path, other: None,
            "cannot be called with one argument, a layer's path",
        ),
        (int, r"`recipe` \(=`int`\), a class, must be"),
        (3, r"`recipe` \(=3\) must be"),
    ],
    ids=["two arguments", "another class", "an int"],
)
def test_other_non_recipes_are_type_errors(recipe, match):
    with pytest.raises(TypeError, match=match):
        eqxrules.quantize(MLP, recipe=recipe)


class _ByPath:
    def __call__(self, path: str) -> Any:
        return recipes.mxfp8() if path == "layers[1]" else None


@pytest.mark.parametrize(
    "recipe",
    [lambda path: recipes.mxfp8() if path == "layers[1]" else None, _ByPath()],
    ids=["function", "callable object"],
)
def test_a_function_of_the_path_still_chooses_per_layer(recipe):
    q = eqxrules.quantize(MLP, recipe=recipe)
    assert type(q.layers[0]) is eqx.nn.Linear
    assert isinstance(q.layers[1], eqxrules.QuantizedLinear)


def _main_check(name: str, recipe: Any) -> None:
    """Main's check (1042e05): anything callable is a function of the path."""
    if recipe is not None and not isinstance(recipe, recipes.Recipe):
        if not callable(recipe):
            raise TypeError(f"`{name}`: `recipe` (={recipe!r}) must be a recipe")


def test_planted_main_check_is_caught(monkeypatch):
    """Planted: with main's check the uncalled factory fails inside, with Python's
    own message, which the assertion rejects."""
    monkeypatch.setattr(_layers, "check_recipe", _main_check)
    with pytest.raises(TypeError) as info:
        eqxrules.quantize(MLP, recipe=recipes.mxfp8)
    assert "takes 0 positional arguments but 1 was given" in str(info.value)
    with pytest.raises(AssertionError):
        assert_names_the_uncalled(str(info.value), "eqxrules.recipes.mxfp8")

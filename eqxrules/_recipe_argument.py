"""The `recipe` argument of [`quantize`][]: a recipe, or a function of each layer's
path returning one (or `None`), checked when `quantize` is called. A recipe class
or factory passed uncalled (`recipe=recipes.mxfp8`) would otherwise be called
with a path and fail deep inside ("mxfp8() takes 0 positional arguments but 1 was
given"); it is named here, with the call to make."""

from __future__ import annotations

import inspect
from typing import Any

from . import recipes as public_recipes
from ._lowp.recipes import Recipe


def check_recipe(name: str, recipe: Any) -> None:
    """Raise a `TypeError` naming `name` unless `recipe` is `None`, a `Recipe` or
    a function that takes one argument (a layer's path)."""
    if recipe is None or isinstance(recipe, Recipe):
        return
    must = (
        "must be an `eqxrules.recipes.Recipe` (e.g. `recipes.mxfp8()`) or a "
        "function of a layer's path (`'layers[1]'`) returning one, or `None`"
    )
    if not callable(recipe):
        raise TypeError(f"`{name}`: `recipe` (={recipe!r}) {must}.")
    shown = _name_of(recipe)
    if isinstance(recipe, type):
        if issubclass(recipe, Recipe):
            raise TypeError(
                f"`{name}`: `recipe` (=`{shown}`) is a recipe class, not a recipe: "
                f"call it, `recipe={shown}()`."
            )
        raise TypeError(f"`{name}`: `recipe` (=`{shown}`), a class, {must}.")
    try:
        signature = inspect.signature(recipe)
    except (TypeError, ValueError):  # no signature to read (a builtin): let it run
        return
    if _binds(signature, "layers[1]"):
        return
    if _binds(signature):
        raise TypeError(
            f"`{name}`: `recipe` (=`{shown}`) is a function of no argument, not a "
            "recipe nor a function of a layer's path: if it makes a recipe (a "
            f"factory, as `recipes.mxfp8` is), call it, `recipe={shown}()`."
        )
    raise TypeError(
        f"`{name}`: `recipe` (=`{shown}`) cannot be called with one argument, a "
        f"layer's path: it {must}."
    )


def recipe_of(recipe: Any, path: str, layer: str) -> Recipe | None:
    """The recipe of `layer` (described for an error), at `path` in the model
    (`"layers[1]"`): `recipe` itself, or what it returns when given `path`,
    checked."""
    if isinstance(recipe, Recipe):
        return recipe
    chosen = recipe(path)
    if chosen is not None and not isinstance(chosen, Recipe):
        raise TypeError(
            f"`quantize`: `recipe`, given the path {path!r} of {layer}, returned "
            f"{chosen!r}; it must return an `eqxrules.recipes.Recipe` or `None` "
            "(to leave the layer as it is)."
        )
    return chosen


def _binds(signature: inspect.Signature, *args: Any) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def _name_of(f: Any) -> str:
    """`f`'s name as a user writes it: `eqxrules.recipes.mxfp8` for a public
    recipe factory or class, else its qualified name."""
    name = getattr(f, "__qualname__", None) or type(f).__qualname__
    if getattr(public_recipes, name, None) is f:
        return f"eqxrules.recipes.{name}"
    return name

"""Print pip constraints pinning jax, jaxlib and equinox at the lower bounds that
pyproject.toml declares, so CI tests exactly the versions the package claims."""

import pathlib
import re
import sys

import tomllib

PINNED = ("jax", "jaxlib", "equinox")

project = tomllib.loads(
    (pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
)
found = {}
for requirement in project["project"]["dependencies"]:
    match = re.fullmatch(
        r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*", requirement
    )
    if match and match.group(1).lower() in PINNED:
        found[match.group(1).lower()] = match.group(2)
missing = [name for name in PINNED if name not in found]
if missing:
    sys.exit(f"minimum_versions: no `>=` bound in pyproject.toml for {missing}")
for name in PINNED:
    print(f"{name}=={found[name]}")

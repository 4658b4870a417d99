"""The oldest supported versions: pyproject.toml's floors are what constraints-oldest.txt pins and CI tests.

``.ci/run``'s second leg installs constraints-oldest.txt and sets ``ELCHE_OLDEST_LEG=1``; there the
installed versions must be exactly the pins. Everywhere else they must be at or above the floors.
"""

from __future__ import annotations

import os
import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# Distributions whose floor the oldest leg tests, and the pyproject.toml section that declares it.
FLOORED = {"torch": "dependencies", "lightning": "dependencies", "pytorch-lightning": "pytorch-lightning"}


def declared_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        declared += [Requirement(r) for r in extra]
    return {r.name: r for r in declared}


def floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{requirement}: expected one '>=' floor"
    return floors[0]


def oldest_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints-oldest.txt").read_text().splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)==([^\s#]+)\s*(#.*)?", line)
        if match:
            pins[match.group(1).lower()] = Version(match.group(2))
    return pins


@pytest.mark.parametrize("name", sorted(FLOORED))
def test_the_oldest_pin_is_the_declared_floor(name: str) -> None:
    requirement = declared_requirements()[name]
    pin = oldest_pins()[name]
    # The floor may name only major.minor (lightning>=2.6): the pin is that release's first patch.
    assert pin == floor(requirement), f"constraints-oldest.txt pins {name}=={pin}, pyproject.toml says {requirement}"
    assert pin in requirement.specifier


def test_installed_versions_are_supported_and_exactly_the_pins_on_the_oldest_leg() -> None:
    oldest_leg = os.environ.get("ELCHE_OLDEST_LEG") == "1"
    requirements = declared_requirements()
    for name in FLOORED:
        installed = Version(version(name))
        release = Version(installed.base_version)  # 2.4.0+cu121 -> 2.4.0
        if oldest_leg:
            assert release == oldest_pins()[name], f"oldest leg runs {name} {installed}"
        else:
            assert release >= floor(requirements[name]), f"{name} {installed} is below the floor"

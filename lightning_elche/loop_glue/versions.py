"""Which Lightning versions this door is written against."""

from __future__ import annotations

import re

import lightning

SUPPORTED_LIGHTNING = ">=2.6,<2.7"
"""The Lightning versions whose internals this module is written against (as in pyproject.toml)."""
_SUPPORTED_RANGE = ((2, 6), (2, 7))


def check_lightning_version(version: str = lightning.__version__) -> None:
    """Refuse a Lightning version outside :data:`SUPPORTED_LIGHTNING`, naming both."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = _SUPPORTED_RANGE
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise RuntimeError(
            f"lightning-elche supports lightning{SUPPORTED_LIGHTNING}; this environment has lightning {version}. "
            "ElCheStrategy adapts Lightning's fit loop internals, which change between minor versions: "
            f"install lightning{SUPPORTED_LIGHTNING}."
        )

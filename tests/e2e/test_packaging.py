"""Packaging: every package folder is installed, and the top-level ``patterns/`` is ``fusion_backend.patterns``."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _folders() -> set[str]:
    names = set()
    for base, prefix in ((ROOT / "fusion_backend", "fusion_backend"), (ROOT / "patterns", "fusion_backend.patterns")):
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            names.add(".".join([prefix, *rel.parts]))
    return names


def test_pyproject_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"fusion_backend.patterns": "patterns"}
    assert sorted(config["packages"]) == sorted(_folders())


def test_the_pattern_families_import_from_the_top_level_folder():
    import fusion_backend.patterns as patterns
    from fusion_backend.match.engine import registered_patterns

    assert Path(patterns.__file__).resolve() == ROOT / "patterns" / "__init__.py"
    assert {"conv_epilogue", "conv_global_mean"} <= set(registered_patterns())

"""The HF golden files (made by scripts/make_golden.py and scripts/make_moe_golden.py), loaded by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


def load_golden(name: str) -> dict:
    path = GOLDEN_DIR / f"{name}.json"
    if not path.is_file():
        pytest.fail(f"golden file {path} is missing; run scripts/make_golden.py")
    return json.loads(path.read_text(encoding="utf-8"))

"""docs/RELIABILITY.md lists exactly the fields and ranges the code checks (its tables are generated)."""

from __future__ import annotations

from pathlib import Path

from jaxinfer.reliability import BEGIN, END, tables

DOC = Path(__file__).resolve().parents[1] / "docs" / "RELIABILITY.md"


def test_the_documented_tables_are_the_codes() -> None:
    text = DOC.read_text(encoding="utf-8")
    documented = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert documented == tables(), "run: python -m jaxinfer.reliability docs/RELIABILITY.md"

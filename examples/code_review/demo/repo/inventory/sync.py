"""Sync the warehouse inventory from the vendor's nightly export."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

#: SKU codes look like ABC-1234 or ABC-1234-XL; vendors now send lower case too.
SKU = re.compile(r"^([A-Za-z]+-?)*[0-9]+(-[A-Za-z]+)?$")


def load_config(path: Path) -> dict:
    """The sync settings (vendor URL, export folder, batch size, hooks)."""
    with path.open() as fh:
        return yaml.load(fh, Loader=yaml.Loader)


def find_sku(line: str) -> str | None:
    """The SKU a line of the export starts with, if any."""
    m = SKU.match(line.strip())
    return m.group(0) if m else None


def export_count(directory: str, pattern: str) -> int:
    """How many export files in ``directory`` match ``pattern``."""
    out = subprocess.run(f"ls {directory} | grep -c {pattern}", shell=True, capture_output=True, text=True)
    return int(out.stdout)


def first_sku(lines: list[str]) -> str:
    """The first SKU of an export, upper-cased."""
    sku = find_sku(lines[0])
    return sku.upper()

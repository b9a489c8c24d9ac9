"""The search-design registry (leaf module): ``@DESIGNS.register(name)`` on a ``SearchDesign`` subclass; the
names are the values of ``search.design`` in a spec."""
from __future__ import annotations

from tasks.registry import Registry

DESIGNS: Registry = Registry("search design")

"""``load_spec``: a spec file -> ``SweepSpec``, read defensively (the file may be large, binary or hostile).

Limits: at most ``MAX_BYTES`` bytes, UTF-8 text, at most ``MAX_ALIASES`` YAML aliases (a "billion laughs"
document expands a few hundred bytes into gigabytes through nested aliases), nesting at most ``MAX_DEPTH``
levels, and no mapping may repeat a key (plain YAML lets the last one win silently). Tags other than YAML's
standard ones are refused (yaml.SafeLoader)."""
from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.spec.checks import SpecError, excerpt
from orchestrator.spec.parse import parse_spec
from orchestrator.spec.schema import SweepSpec

MAX_BYTES = 1 << 20  # 1 MiB
MAX_ALIASES = 100
MAX_DEPTH = 50
MAX_NODES = 200_000  # YAML nodes after alias expansion (configs/default.yaml has about 300)


class _Loader(yaml.SafeLoader):
    """SafeLoader that counts aliases, bounds nesting and rejects duplicate mapping keys."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise SpecError("spec", f"more than {MAX_ALIASES} YAML aliases (at line {mark.line + 1}); "
                                        f"a spec needs none")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise SpecError("spec", f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        n = expanded_size(node)
        if n > MAX_NODES:
            raise SpecError("spec", f"expands to more than {MAX_NODES} YAML nodes through aliases; a spec needs none")
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
                seen.add(key)
            except TypeError:
                raise SpecError("spec", f"unhashable mapping key at line {key_node.start_mark.line + 1}") from None
            if dup:
                raise SpecError("spec", f"duplicate key {excerpt(key, 40)} at line {key_node.start_mark.line + 1}, "
                                        f"column {key_node.start_mark.column + 1}")
        return super().construct_mapping(node, deep)


def expanded_size(node, memo: dict | None = None) -> int:
    """Nodes of the document with every alias expanded, counted in time linear in the composed graph."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once (the loader rejects nothing else for it)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(expanded_size(c, memo) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(expanded_size(k, memo) + expanded_size(v, memo) for k, v in node.value)
    memo[id(node)] = n = min(n, MAX_NODES + 1)
    return n


def read_yaml(text: str):
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError("spec", f"malformed YAML{where}: {excerpt(getattr(e, 'problem', None) or str(e), 120)}") from None
    except RecursionError:
        raise SpecError("spec", f"nested deeper than {MAX_DEPTH} levels") from None


def read_spec_text(path: str | Path) -> str:
    """A spec file's text: it exists, is at most MAX_BYTES, UTF-8 and text (SpecError otherwise)."""
    p = Path(path)
    if not p.is_file():
        what = "a directory, not a spec file" if p.is_dir() else "not a regular file" if p.exists() else "file not found"
        raise SpecError("spec", f"{what}: {excerpt(str(p), 200)}")
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise SpecError("spec", f"{p.name} is {size} bytes; a spec may have at most {MAX_BYTES} bytes")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError("spec", f"{p.name} is not UTF-8 text (byte {e.start})") from None
    if "\x00" in text:
        raise SpecError("spec", f"{p.name} is not a text file (it contains NUL bytes)")
    return text


def load_spec(path: str | Path) -> SweepSpec:
    """Read, check and parse a spec file; relative ``store.uri`` paths are relative to the file's directory."""
    return parse_spec(read_yaml(read_spec_text(path)), base_dir=Path(path).resolve().parent)

"""What every kernel spec shares: JSON form, content hash, and rebuilding any spec from JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ..errors import SpecError

SPEC_VERSION = 1


class SpecData:
    """Mixin of the frozen spec dataclasses: ``to_dict``/``to_json``/``content_hash`` and a
    checked ``from_dict``. Subclasses are dataclasses whose fields are JSON values (or have a
    ``to_dict`` of their own, like ``TileConfig``)."""

    op: str

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d["spec_version"] = SPEC_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def content_hash(self) -> str:
        """sha256 of the canonical JSON, first 16 hex digits."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    @classmethod
    def _checked_fields(cls, d: Any, legacy: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(d, dict):
            raise SpecError(f"{cls.__name__}: a spec must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("spec_version", SPEC_VERSION)
        if version != SPEC_VERSION:
            raise SpecError(f"{cls.__name__}: spec_version {version} is not {SPEC_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)} | set(legacy)  # type: ignore[arg-type]
        unknown = set(d) - known
        if unknown:
            raise SpecError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**cls._checked_fields(d))

    @classmethod
    def from_json(cls, text: str):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"{cls.__name__}: not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise SpecError(f"{cls.__name__}: JSON must be an object")
        return cls.from_dict(d)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

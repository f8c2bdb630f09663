"""A request's JSON body carried along the request path: decoded at most once, encoded again only
when the router changed a field. Pure (no I/O).

The path reads the body in several places (the prompt, the alias's ``model``, vLLM's
``priority``, the tenant's ``cache_salt``); each reads the one decoded object instead of parsing
the bytes again, and each change is an edit applied in one encode before the body is sent on
(issue 32: each piece of a request computed once).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from router.request.prompts import decode_json_body

_ENCODER: Final = msgspec.json.Encoder()
# the top-level object with its values left as raw JSON: a changed field on a body that was
# never decoded (the token-id fast path) costs a scan and a copy, not 8k integer objects
_RAW_FIELDS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_UNDECODED: Final = object()


class RequestBody:
    """One request body: ``raw`` as received (after Content-Encoding), its JSON decoded on first
    ``data()`` and kept, and the fields the router set (``set``), applied by ``encoded()``.

    Invariant: ``encoded()`` is ``raw`` byte for byte while nothing was set; after ``set`` it is
    the object with those fields replaced in place (new ones appended), every other field as
    sent. Only a JSON object's fields can be set (the parsers refuse anything else first).
    """

    __slots__ = ("_data", "_edits", "_encoded", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._data: Any = _UNDECODED
        self._edits: dict[str, Any] = {}  # {field: value set by the router}
        self._encoded: bytes | None = None

    def data(self) -> Any:
        """The decoded JSON (with the fields set so far). Raises ``PromptError`` (400) when the
        body is not JSON."""
        if self._data is _UNDECODED:
            self._data = decode_json_body(self.raw)
            if self._edits and isinstance(self._data, dict):
                self._data.update(self._edits)
        return self._data

    def set(self, field: str, value: Any) -> None:
        """Set a top-level ``field`` of the body (a JSON object) to ``value``."""
        self._edits[field] = value
        self._encoded = None
        if isinstance(self._data, dict):
            self._data[field] = value

    def encoded(self) -> bytes:
        """The body to send on: ``raw`` unless a field was set, else encoded once again."""
        if not self._edits:
            return self.raw
        if self._encoded is None:
            if isinstance(self._data, dict):
                self._encoded = _ENCODER.encode(self._data)
            else:
                fields = _RAW_FIELDS.decode(self.raw)
                fields.update((k, msgspec.Raw(_ENCODER.encode(v))) for k, v in self._edits.items())
                self._encoded = _ENCODER.encode(fields)
        return self._encoded

"""Image content parts of a chat request, keyed for prefix affinity. Pure.

vLLM 0.32 renders a message's image parts in its "string" content format as the model's image
placeholder (``<|image_pad|>``-like, expanded to the image's feature tokens), put in front of
the message's text, one line each (``renderers/chat_utils._get_full_multimodal_text_prompt``,
``interleave_strings`` off), and keys the KV blocks under an image by the multimodal hash of
the processed item (``MultiModalHasher``, or a part's own ``uuid``). The router has neither the
model's processor nor its placeholder expansion, so it does not reproduce those tokens and keys.
Instead it renders each image part as a marker text in the placeholder's place:

- the prompt's tokens before the first image's placeholder are the engine's exactly (the
  marker stands where the placeholder stands), so its blocks there hit the engine's prefix
  cache as any text prompt's do;
- from the first image on, the blocks are the router's own: the marker names the image by a
  digest of its bytes (a ``data:`` URL, base64 decoded), by its URL, or by the part's ``uuid``
  when it has one (vLLM's ``multi_modal_uuids``), so the same images in a repeated prompt give
  the same blocks and the prompt returns to the replica it went to before (the router's own
  placements, ``speculative_ttl_s``). This part is affinity, not vLLM's multimodal hash: the
  index never confirms those blocks from KV events, and the predicted hit stops at the first
  image.
"""

from __future__ import annotations

import binascii
import hashlib
from typing import Any, Final

# content part types that carry an image, and where the image's URL is (vLLM 0.32 chat_utils
# ``MM_PARSER_MAP``): Chat's ``{"image_url": {"url"}}`` and Responses' ``{"image_url": str}``
IMAGE_PART_TYPES: Final = frozenset({"image_url", "input_image"})
DIGEST_HEX_CHARS: Final = 32  # 128 bits of SHA-256: collisions need 2**64 images


def image_source(part: Any) -> str | None:
    """An image part's URL (``data:`` or remote), or ``None`` for a part that is no image part
    or has no URL string."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else None


def image_key(part: Any) -> str | None:
    """The affinity key of an image part, or ``None`` for a part that is no image part:
    ``uuid:<uuid>`` when the part has a string ``uuid``; ``bytes:<sha256>`` of the decoded
    bytes of a base64 ``data:`` URL; else ``url:<sha256>`` of the URL text (a remote image, or
    a data URL that does not decode: the engine refuses those, the key only has to be
    stable). Digests are the first ``DIGEST_HEX_CHARS`` hex characters of SHA-256."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return "uuid:" + uuid
    url = image_source(part)
    if url is None:
        return "url:none"
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if comma and header.endswith(";base64"):
            try:
                data = binascii.a2b_base64(payload, strict_mode=False)
            except (binascii.Error, ValueError):
                data = None
            if data is not None:
                return "bytes:" + hashlib.sha256(data).hexdigest()[:DIGEST_HEX_CHARS]
    return (
        "url:" + hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_HEX_CHARS]
    )


def image_marker(part: Any) -> str | None:
    """The text an image part is rendered as in the routed prompt (``<image KEY>``), or
    ``None`` for a part that is no image part."""
    key = image_key(part)
    return None if key is None else f"<image {key}>"

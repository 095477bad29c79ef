"""Resolving a name to a local path or a Hub repository, failing fast and in one line when the Hub is out of reach.

`huggingface_hub` retries a failed connection five times with back-off (about 26-40 s) before it reports an error
that blames the network. Names that cannot be a Hub repository id (`./x`, `/abs/path`, `~/x`, `a/b/c`, `x.json`) are
therefore reported as missing local paths at once, and before any Hub request the Hub's host is looked up once (a DNS
query, milliseconds): offline (`HF_HUB_OFFLINE=1`, or the host does not resolve and no proxy is configured) only the
local Hub cache is consulted.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

__all__ = ["HubUnreachableError", "hub_download", "hub_offline_reason", "looks_like_local_path"]


class HubUnreachableError(OSError):
    """The Hugging Face Hub cannot be reached (offline) and what was asked for is not in the local Hub cache."""


def looks_like_local_path(name: str | os.PathLike) -> bool:
    """True for names that can only be a local path: not a valid Hub repository id (`namespace/name` or `name`)."""
    text = os.fspath(name)
    if isinstance(name, os.PathLike) or text.startswith((".", "/", "~", "\\")) or text.endswith(".json"):
        return True
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(text)
    except Exception:
        return True
    return False


def hub_offline_reason() -> str | None:
    """Why the Hub cannot be reached now (`None` if it may be): `HF_HUB_OFFLINE`, or its host does not resolve."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy resolves names itself
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return f"{host} cannot be resolved (no network?)"
    return None


def hub_download(repo_id: str, filename: str, *, what: str, revision: str | None = None, **hub_kwargs: Any) -> str:
    """`huggingface_hub.hf_hub_download`, but offline only the local Hub cache is tried, and failures are one line.

    Raises:
        HubUnreachableError: offline and the file is not in the local Hub cache.
        OSError: the Hub answered but the repository or file is missing or not accessible.
    """
    from huggingface_hub import hf_hub_download

    offline = hub_offline_reason()
    try:
        return hf_hub_download(repo_id, filename, revision=revision, local_files_only=offline is not None, **hub_kwargs)
    except Exception as err:
        if offline is not None:
            raise HubUnreachableError(
                f"{what} {repo_id!r} is not a local path, and the Hugging Face Hub cannot be reached ({offline}); "
                f"it is not in the local Hub cache either"
            ) from None
        raise OSError(
            f"{what} {repo_id!r} is not a local path, and the Hub could not provide {filename}"
            f"{f' at revision {revision}' if revision else ''}: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err

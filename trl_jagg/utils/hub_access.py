"""A cheap check that a Hub file can be had (cached, local or downloadable) before anything heavy loads, and errors
that say what to do when it cannot: a gated repo (accept the license, log in), an unknown id, offline mode.

The check reads the local cache, then asks the Hub for the file's metadata (a HEAD request): it downloads nothing, so
a reward's multi-gigabyte checkpoint is checked as cheaply as a pipeline's ``model_index.json``.
"""

from __future__ import annotations

import os

from huggingface_hub import get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

LOGIN_HINT = "log in on this machine with `hf auth login` or set the HF_TOKEN environment variable"


class HubAccessError(OSError):
    """A model or reward's files cannot be had: the message names what, the repo and the fix."""


def looks_like_path(name: str) -> bool:
    """``name`` is written as a filesystem path (``./model``, ``/data/model``, ``~/m``, ``a/b/c``), not a Hub id."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or os.path.isabs(name)


def offline_message(what: str, repo_id: str, filename: str) -> str:
    return (
        f"{what} {repo_id!r} is not in the local Hugging Face cache ({filename} missing) and HF_HUB_OFFLINE=1 forbids "
        f"downloading it. Download it once while online (`hf download {repo_id}`), unset HF_HUB_OFFLINE, or pass the "
        f"path of a local directory holding it instead of the Hub id (e.g. /data/models/{repo_id.split('/')[-1]})."
    )


def unknown_message(what: str, repo_id: str) -> str:
    return (
        f"{what} {repo_id!r} is neither a local directory nor a repository on the Hugging Face Hub. Check the "
        f"spelling (Hub ids are 'org/name'); a private repository also needs you to {LOGIN_HINT}."
    )


def check_hub_file(repo_id: str, filename: str, *, what: str, revision: str | None = None) -> None:
    """Raise :class:`HubAccessError` unless ``filename`` of ``repo_id`` is cached, local or downloadable.

    Args:
        repo_id: a Hub id or a local directory (a directory is left to the loader, which names a missing file).
        filename: a file the loader reads from the repo (``model_index.json``, ``config.json``, a checkpoint).
        what: how the message names the thing, e.g. ``"model"`` or ``"reward 'pickscore': weights"``.
        revision: a branch, tag or commit; ``None`` is the default branch.
    """
    if os.path.isdir(os.path.expanduser(repo_id)):
        return
    if looks_like_path(repo_id):
        raise HubAccessError(
            f"{what} {repo_id!r} is written as a path, but no such directory exists. Fix the path, or give a "
            "Hub id of the form 'org/name'."
        )
    try:
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
    except HFValidationError:
        raise HubAccessError(unknown_message(what, repo_id)) from None
    if isinstance(cached, str):
        return
    if is_offline_mode():
        raise HubAccessError(offline_message(what, repo_id, filename))
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision))
    except GatedRepoError:
        raise HubAccessError(
            f"{what} {repo_id!r} is gated: accept its license at https://huggingface.co/{repo_id} (logged in to "
            f"the Hub), then {LOGIN_HINT}."
        ) from None
    except (RepositoryNotFoundError, HFValidationError):
        raise HubAccessError(unknown_message(what, repo_id)) from None
    except RevisionNotFoundError:
        raise HubAccessError(
            f"{what} {repo_id!r} has no revision {revision!r}: give an existing branch, tag or commit."
        ) from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError):
        raise HubAccessError(offline_message(what, repo_id, filename)) from None
    except EntryNotFoundError:
        raise HubAccessError(
            f"{what} {repo_id!r} has no file {filename!r} (revision {revision or 'main'}): is it the right repository?"
        ) from None
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        hint = f"; if it is private or gated, {LOGIN_HINT}" if status in (401, 403) else ""
        raise HubAccessError(f"{what} {repo_id!r}: the Hub answered HTTP {status} for {filename}{hint}.") from None
    except Exception as error:  # the transport's own errors (no connection, DNS, timeout) have no common base
        raise HubAccessError(
            f"{what} {repo_id!r}: the Hugging Face Hub could not be reached ({type(error).__name__}) and {filename} is "
            "not cached. Check the connection, or set HF_HUB_OFFLINE=1 and pass a local directory or a cached id."
        ) from None


__all__ = ["HubAccessError", "check_hub_file", "looks_like_path"]

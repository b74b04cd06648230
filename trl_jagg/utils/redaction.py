"""One redaction policy for everything the library writes or shows: ``training_args.bin``, the configuration given to
trackers, ``repr()``s and error messages.

A value is a secret when the name it is stored under names one (a key or field with a word ``token``, ``key``,
``secret``, ``password``, ``authorization``, ``credential`` or ``cookie``, in any case, at any depth of nested
mappings and lists, unless the name ends in a word saying it holds something else: ``api_key_env`` names a variable,
``reward_token_id`` a vocabulary entry). Strings are also redacted by the shape of what they hold, wherever they
are: URL userinfo (``http://user:sk-...@host/v1``), URL query parameters with such a name (``?api_key=...``), the
credential after ``Bearer`` or after an ``Authorization:`` header's scheme (``Authorization: Basic ...``) and values with a
common token prefix (``sk-``, ``hf_``, ``ghp_``, ``github_pat_``, ``xoxb-``, ``AKIA``). Keys belong in environment
variables; :func:`check_url_without_credentials` and :func:`check_env_name` refuse the two
places a key is most often put by mistake.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
"""What a secret is replaced with."""
SECRET_WORDS = frozenset(
    {"token", "key", "apikey", "secret", "password", "passwd", "authorization", "auth", "credential", "credentials",
     "cookie", "bearer", "pat", "access", "jwt"}
)  # fmt: skip
NOT_SECRET_LAST_WORDS = frozenset({"env", "var", "variable", "id", "ids", "name", "names", "path", "file", "column"})
"""A name ending in one of these holds where a secret is, or an index, not the secret (``api_key_env``)."""
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)([^/?#\s@]+)@")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_QUERY_PARAM = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
# "Bearer <credential>" anywhere; any scheme after an Authorization header's name ("basic" alone is a common word).
_AUTH_SCHEME = re.compile(r"(?i)(\bbearer|authorization\s*[:=]\s*[a-z\-]+)(\s+)([^\s\"',;]+)")
_TOKEN_PREFIX = re.compile(
    r"\b(?:sk-[A-Za-z0-9_\-]{6,}|hf_[A-Za-z0-9]{6,}|gh[pousr]_[A-Za-z0-9]{6,}|github_pat_[A-Za-z0-9_]{6,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{6,}|AKIA[0-9A-Z]{16})"
)


def names_secret(name: Any) -> bool:
    """Whether a key or field called ``name`` holds a secret (see the module docstring)."""
    words = [word.lower() for word in _WORD.findall(str(name))]
    return bool(words) and words[-1] not in NOT_SECRET_LAST_WORDS and any(word in SECRET_WORDS for word in words)


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it (``user:password@``) and the value of every query parameter
    whose name :func:`names_secret` (``?api_key=...``) replaced by :data:`REDACTED`."""
    text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
    if "://" not in text or "?" not in text:
        return text

    def query(match: re.Match[str]) -> str:
        separator, name, value = match.groups()
        return f"{separator}{name}={REDACTED if names_secret(name) and value else value}"

    return re.sub(r"://[^\s#]*", lambda url: _QUERY_PARAM.sub(query, url.group(0)), text)


def redact_text(text: str) -> str:
    """``text`` without the secrets its shape shows (see the module docstring): URL userinfo and secret-named query
    parameters (:func:`redact_url`), the credential after an ``Authorization``-style scheme, token-prefixed values."""
    text = redact_url(text)
    text = _AUTH_SCHEME.sub(rf"\1\2{REDACTED}", text)
    return _TOKEN_PREFIX.sub(REDACTED, text)


def redacted(value: Any) -> Any:
    """A copy of ``value`` without secrets: in mappings (at any depth, through lists and tuples) the value of every
    key that :func:`names_secret` is :data:`REDACTED` (``None`` stays ``None``), and every string, keys included, is
    :func:`redact_text`-ed. Other objects are returned as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {
            redacted(key): (REDACTED if value[key] is not None else None)
            if names_secret(key)
            else redacted(value[key])
            for key in value
        }
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(item) for item in value)
    return value


def redacted_fields(config: Any) -> Any:
    """A shallow copy of the dataclass ``config`` whose secret-named fields are ``None`` and whose other fields are
    :func:`redacted` (for ``training_args.bin``: the copy stays a valid config)."""
    clean = copy.copy(config)
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        setattr(clean, item.name, None if names_secret(item.name) else redacted(value))
    return clean


def redacted_argv(argv: list[str]) -> list[str]:
    """Command-line arguments without secrets, for whoever records them after parsing (W&B saves ``sys.argv``): the
    value of a flag naming a secret (``--hub_token X``, ``--hub_token=X``), secrets in JSON values
    (``--reward_kwargs '{...}'`` and ``--reward_kwargs={...}``) and what :func:`redact_text` finds are
    :data:`REDACTED`."""
    clean: list[str] = []
    for i, item in enumerate(argv):
        flag, equals, value = item.partition("=")
        if i and argv[i - 1].startswith("-") and names_secret(argv[i - 1].lstrip("-")) and not item.startswith("-"):
            clean.append(REDACTED)
        elif item.startswith("-") and equals and names_secret(flag.lstrip("-")):
            clean.append(f"{flag}={REDACTED}")
        elif item.startswith("-") and equals and value.lstrip().startswith(("{", "[")):  # --reward_kwargs={...}
            clean.append(f"{flag}={_redacted_json(value)}")
        elif item.lstrip().startswith(("{", "[")):
            clean.append(_redacted_json(item))
        else:
            clean.append(redact_text(item))
    return clean


def _redacted_json(text: str) -> str:
    """A JSON argument without its secrets; one that does not parse may still hold a key that cannot be found, so
    it is dropped whole."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return REDACTED
    return text if redacted(parsed) == parsed else json.dumps(redacted(parsed))


def check_url_without_credentials(url: str, where: str, fix: str) -> None:
    """Refuse a URL holding userinfo: it would be printed in every error and saved with the config, and HTTP clients
    here do not send it. The message shows the URL redacted and says how to pass the key (``fix``).

    Raises:
        ValueError: ``url`` has ``user[:password]@`` before its host.
    """
    if _URL_USERINFO.search(url):
        raise ValueError(
            f"{where}: the URL {redact_url(url)} carries credentials (user:password@), which would be saved and logged "
            f"in clear and are not sent. Remove them from the URL; {fix}"
        )


def check_env_name(name: Any, where: str, fix: str) -> None:
    """Refuse ``name`` unless it is an environment variable's name (upper-case letters, digits and underscores):
    a key given where its variable's name goes would be saved with the config and never sent. The value is not
    shown (it may be the key).

    Raises:
        ValueError: ``name`` is not such a name.
    """
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ValueError(
            f"{where} must be the NAME of an environment variable (upper-case letters, digits and underscores, e.g. "
            f"TRL_JAGG_JUDGE_API_KEY), and the value given is not one (not shown: it may be the key itself). {fix}"
        )

"""Where downloaded data sets live, and the one function that touches the network (only when a caller allowed it)."""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

from privfl.data.errors import DatasetError

#: Environment variable that overrides the cache directory.
CACHE_ENV = "PRIVFL_DATA"


def default_cache_dir() -> Path:
    """``$PRIVFL_DATA`` if set, else ``~/.cache/privfl``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/privfl").expanduser()


def resolve_root(root: str | os.PathLike | None) -> Path:
    """``root`` as a Path, or the default cache directory when ``None``."""
    return Path(root).expanduser() if root is not None else default_cache_dir()


def download_url(url: str, dest: Path, *, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``dest`` through a temporary file in the same folder, renamed only once complete, so an
    interrupted download never leaves a truncated file that looks like data."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, out)
        if os.path.getsize(tmp) == 0:
            raise DatasetError(f"downloading {url} gave an empty file")
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


__all__ = ["CACHE_ENV", "default_cache_dir", "download_url", "resolve_root"]

"""The persistent compile cache (`[compile] cache_dir`), holding only what this user compiled.

A cache entry is an executable that JAX loads and runs, so an entry pdctl did not write is code
from whoever wrote it (a run directory from someone else can carry a cache directory:
docs/commands.md, "The run directory"). Three checks keep that out:

- the directory is private (`files.check_private_dir`: ours, writable by no one else);
- it carries a marker, an HMAC of a fixed text under this user's key, written when pdctl
  created it (or found it holding nothing but signed entries). A directory holding anything
  else and no valid marker (a JAX cache, one from a pdctl before signed entries, files that
  are no cache at all) is refused with one line: delete it or choose another. One holding only
  entries signed under another key (another user's, or this user's before the key was made
  again) is marked as this user's: each of those entries fails the check below, so it is
  compiled again and replaced, never loaded;
- every entry is stored as `MAGIC + HMAC(key, cache key + entry) + entry`, and is handed to JAX
  only when the tag checks. An entry whose tag does not check (another user's, one renamed
  from another key, an edited one, a symlink) is a cache miss: JAX compiles again and the
  entry is replaced.

The key is 32 random bytes created once per user, mode 0600, in `$XDG_STATE_HOME/pdctl/`
(default `~/.local/state/pdctl/`), a directory only the user can write. JAX's own file cache
(`LRUCache`) trusts whatever it reads and follows symlinks when it writes, so pdctl hands JAX
`SignedCache` instead, through JAX's private `compilation_cache._cache` slot; a JAX without that
slot gets no persistent cache at all (a warning), never an unchecked one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from pdctl.errors import PdctlError, notify
from pdctl.files import (
    UnsafePath,
    atomic_write,
    check_private_dir,
    open_nofollow,
    refuse_links_between,
)

log = logging.getLogger("pdctl")

KEY = "compile.cache_dir"
MAGIC = b"pdctl-signed-cache-1\n"
MARKER = "pdctl-cache-id"
SUFFIX = "-cache"  # JAX's entry suffix, kept so the directory looks like JAX's own
# Files JAX itself may keep in a cache directory (its LRUCache's lock).
_JAX_OWN = {".lockfile"}


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
    return Path(base) / "pdctl"


def user_key() -> bytes:
    """This user's key (created on first use: a temporary file linked into place, so two
    processes creating it at once agree)."""
    d = check_private_dir(state_dir(), KEY)
    path = d / "compile-cache.key"
    if not os.path.lexists(path):
        tmp = d / f".compile-cache.key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except (OSError, UnsafePath) as e:
        raise PdctlError(f"{KEY}: cannot read the cache key {path} ({e})") from None
    try:
        st = os.fstat(fd)
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or len(key) != 32:
        raise PdctlError(
            f"{KEY}: {path} is not a key only you can read (owner, mode 0600, 32 bytes); "
            "delete it and pdctl makes a new one"
        )
    return key


def _marker(key: bytes) -> bytes:
    return hmac.new(key, b"pdctl compile cache directory", hashlib.sha256).hexdigest().encode()


def _signed_entry(p: Path) -> bool:
    """Whether `p` is a regular file (not a link) named and laid out as a signed entry
    (`MAGIC` first), under whichever key."""
    if not p.name.endswith(SUFFIX):
        return False
    try:
        fd = open_nofollow(p, os.O_RDONLY)
    except (OSError, UnsafePath):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, len(MAGIC)) == MAGIC
    finally:
        os.close(fd)


def prepare(path: str | Path, root: Path | None = None) -> tuple[Path, bytes]:
    """The cache directory, checked (see the module), and this user's key. A directory inside
    the run directory `root` is refused (one line) when it or a directory between is a
    symlink, before anything is written (the run directory's symlink rule)."""
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    if root is not None and path.is_relative_to(os.path.abspath(root)):
        refuse_links_between(Path(os.path.abspath(root)), path)
    path = check_private_dir(path, KEY)
    key = user_key()
    want = _marker(key)
    marker = path / MARKER
    try:
        fd = open_nofollow(marker, os.O_RDONLY)
        try:
            got = os.read(fd, 256)
        finally:
            os.close(fd)
    except FileNotFoundError:
        got = None
    except (OSError, UnsafePath):
        got = b""
    if got is not None and hmac.compare_digest(got, want):
        return path, key
    others = sorted(n for n in os.listdir(path) if n not in _JAX_OWN | {MARKER})
    foreign = [n for n in others if not _signed_entry(path / n)]
    if foreign:
        raise PdctlError(
            f"{KEY}: {path} holds files pdctl did not create for you (e.g. {foreign[0]!r}, not "
            "a signed entry: a JAX cache, one from an older pdctl, or no cache at all); a cache "
            "holds code pdctl runs, so delete that directory or choose another"
        )
    atomic_write(marker, want)
    return path, key


def _jax_cache_module():
    """JAX's compilation_cache module when it has the slots pdctl fills, else None."""
    try:
        from jax._src import compilation_cache as cc
        from jax._src.compilation_cache_interface import CacheInterface
    except ImportError:
        return None
    if not all(hasattr(cc, n) for n in ("_cache", "_cache_initialized", "reset_cache")):
        return None
    return cc, CacheInterface


def make_signed_cache(path: Path, key: bytes):
    """A JAX `CacheInterface` over `path` whose entries carry this user's tag (the module)."""
    found = _jax_cache_module()
    base = found[1] if found else object

    class SignedCache(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self._path = path
            self._key = key

        def _file(self, k: str) -> Path:
            if not k or "/" in k or k.startswith("."):
                raise ValueError(f"bad cache key {k!r}")
            return self._path / f"{k}{SUFFIX}"

        def _tag(self, k: str, value: bytes) -> bytes:
            return hmac.new(self._key, k.encode() + b"\0" + value, hashlib.sha256).digest()

        def get(self, k: str) -> bytes | None:
            try:
                fd = open_nofollow(self._file(k), os.O_RDONLY)
            except FileNotFoundError:
                return None
            except (OSError, UnsafePath, ValueError) as e:
                log.warning("compile cache: ignoring entry %s (%s)", k, e)
                return None
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            n = len(MAGIC)
            tag, value = data[n : n + 32], data[n + 32 :]
            if not data.startswith(MAGIC) or not hmac.compare_digest(tag, self._tag(k, value)):
                log.warning(
                    "compile cache: ignoring entry %s, which pdctl did not write for you "
                    "(compiling again)",
                    k,
                )
                return None
            return value

        def put(self, k: str, value: bytes) -> None:
            f = self._file(k)
            if os.path.islink(f):  # replaced, never written through
                os.unlink(f)
            atomic_write(f, MAGIC + self._tag(k, value) + value)

    return SignedCache()


DEFAULT = "cache/compile"  # in the run directory, where `[compile] cache_dir` is unset
ENV = "PDCTL_COMPILE_CACHE"  # ... or this directory ("" = none) for every run of this user


def choose(configured: str | None, root: Path | None) -> tuple[str | None, bool]:
    """(the cache directory to use or None, whether it was asked for): `[compile] cache_dir`
    when set ("" = none), else $PDCTL_COMPILE_CACHE when set, else `DEFAULT` in the run
    directory `root`. One asked for is refused (one line) when it is not safe; the default one
    is then only left unused (`install_chosen`)."""
    if configured is not None:
        return configured or None, True
    env = os.environ.get(ENV)
    if env is not None:
        return env or None, True
    if root is None:
        return None, False
    return str(Path(os.path.abspath(root)) / DEFAULT), False


def install_chosen(configured: str | None, root: Path | None) -> Path | None:
    """Install the cache `choose` picks; the directory installed, or None. The default cache
    in the run directory is skipped with a warning, not refused, when pdctl cannot use it (one
    that came with someone else's run directory, say): nobody asked for it."""
    path, asked = choose(configured, root)
    if path is None:
        return None
    try:
        install(path, root=root)
    except PdctlError as e:
        if asked:
            raise
        notify(f"{str(e).replace(KEY, 'compile cache', 1)}; running without a compile cache")
        return None
    return Path(path)


def install(path: str | Path, root: Path | None = None) -> None:
    """Check `path` (`prepare`) and make JAX compile through a `SignedCache` over it."""
    import jax

    path, key = prepare(path, root)
    found = _jax_cache_module()
    if found is None:
        log.warning(
            "compile.cache_dir: this JAX (%s) has no cache slot pdctl can check entries "
            "through; running without a persistent compile cache",
            jax.__version__,
        )
        return
    cc = found[0]
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    current = cc._cache
    if current is not None and getattr(current, "_path", None) == path and hasattr(current, "_key"):
        return
    cc.reset_cache()
    cc._cache = make_signed_cache(path, key)
    cc._cache_initialized = True


def active() -> bool:
    """Whether JAX compiles through a signed cache now (`install` succeeded in this process)."""
    found = _jax_cache_module()
    return found is not None and hasattr(found[0]._cache, "_key")

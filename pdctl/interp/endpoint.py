"""`--endpoint`: send prompts to an OpenAI-compatible chat-completions server the user names.

Nothing here runs unless the user passes `--endpoint URL`: pdctl makes no network call by
default. HTTP through httpx (POST {url}/chat/completions, or the URL as given when it already
ends in /chat/completions), the API key from the environment variable the user names (sent as
`Authorization: Bearer`, never written anywhere), temperature 0.

- Rate limit: at most `rpm` requests a minute (requests start at least 60 / rpm s apart).
- Retries: a connection error, a timeout, a 429 or a 5xx is retried up to `retries` times,
  waiting BACKOFF_S * 2**attempt (at most BACKOFF_MAX_S; a numeric Retry-After is honoured up
  to that); any other 4xx stops at once (a wrong URL, model or key will not get better).
- Resumable: each answer is appended to the output file (flushed and fsynced) as it comes;
  components (trials) already there, or already labelled in harvest.db, are not asked again.
- A reply that holds no usable JSON object is counted and skipped (asked again on a rerun).
- Bounded: each request (connect, send, every byte of the reply) has TIMEOUT_S in all, not
  per read (a server dribbling its reply is cut off and retried as a timeout), so a request
  and its retries end within (retries + 1) * TIMEOUT_S plus the backoffs. A reply larger
  than MAX_REPLY_BYTES is refused at once (a failed request, one line). An error reply's body
  is never shown (a server may echo the key): its status and reason only. A lone surrogate
  in a reply (not valid Unicode) becomes U+FFFD.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdctl.errors import PdctlError

BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0
TIMEOUT_S = 120.0  # a whole request: connect, send and read every byte of the reply
MAX_REPLY_BYTES = 1 << 20  # 1 MiB
MAX_FILE_BYTES = 1 << 30  # 1 GiB: the most read of a labels, trials or answers file
RETRY_STATUS = {408, 409, 429}


class EndpointError(PdctlError):
    """The endpoint failed for good (after its retries, or a 4xx that will not change)."""


def chat_url(url: str) -> str:
    import httpx

    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise PdctlError(f"--endpoint: not a URL ({e}): {url!r}") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise PdctlError(f"--endpoint: must be an http:// or https:// URL, got {url!r}")
    if u.port is not None and not 1 <= u.port <= 65535:
        raise PdctlError(f"--endpoint: port must be 1 to 65535, got {u.port} in {url!r}")
    path = u.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return str(u.copy_with(path=path))


@dataclass
class Client:
    url: str
    model: str
    api_key: str | None = None
    rpm: float = 60.0
    retries: int = 5
    timeout_s: float | None = None  # None: TIMEOUT_S
    sleep: Callable[[float], None] = time.sleep
    _next: float = field(default=0.0, repr=False)
    _http: Any = field(default=None, repr=False)
    _retry_after: str | None = field(default=None, repr=False)

    def _wait_turn(self) -> None:
        now = time.monotonic()
        if now < self._next:
            self.sleep(self._next - now)
        self._next = max(now, self._next) + 60.0 / self.rpm

    def chat(self, prompt: str) -> str:
        """The reply's text to one user message; retried as the module says."""
        import httpx

        if self._http is None:
            self._http = httpx.Client()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(self._backoff(attempt, why))
            self._wait_turn()
            try:
                code, reason, data = self._post(body, headers)
            except _Overdue as e:
                why = str(e)
                continue
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
                continue
            if code == 200:
                return _text(data, self.url)
            why = f"HTTP {code} {reason}".rstrip()
            if code not in RETRY_STATUS and code < 500:
                raise EndpointError(f"--endpoint: {self.url} answered {why} (body not shown)")
        raise EndpointError(f"--endpoint: {self.url}: {why} after {self.retries} retries")

    def _post(self, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, str, bytes]:
        """One request: (status, reason, body), all of it within the timeout (`_Overdue` past
        it), a body over MAX_REPLY_BYTES refused."""
        import httpx

        limit = self.timeout_s if self.timeout_s is not None else TIMEOUT_S
        deadline = time.monotonic() + limit
        with self._http.stream("POST", self.url, json=body, headers=headers,
                               timeout=httpx.Timeout(limit)) as r:  # fmt: skip
            self._retry_after = r.headers.get("retry-after")
            data = bytearray()
            if r.status_code == 200:
                with contextlib.suppress(AttributeError, TypeError):  # the body's reads: no
                    r.request.extensions["timeout"]["read"] = max(  # longer than what is left
                        0.01, deadline - time.monotonic())  # fmt: skip
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > MAX_REPLY_BYTES:
                        raise EndpointError(
                            f"--endpoint: {self.url}: a reply larger than "
                            f"{MAX_REPLY_BYTES >> 20} MiB, refused"
                        )
                    if time.monotonic() > deadline:
                        raise _Overdue(f"timeout: no whole reply within {limit:g} s")
            if time.monotonic() > deadline:
                raise _Overdue(f"timeout: no whole reply within {limit:g} s")
            return r.status_code, r.reason_phrase, bytes(data)

    def _backoff(self, attempt: int, why: str) -> float:
        wait = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1))
        ra, self._retry_after = self._retry_after, None
        if ra is not None:
            with contextlib.suppress(ValueError):
                wait = min(BACKOFF_MAX_S, max(wait, float(ra)))
        return wait

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


class _Overdue(Exception):
    """A request ran past its whole-request timeout (retried as a timeout)."""


def clean_text(s: str) -> str:
    """`s` with each lone surrogate (text that is not valid Unicode, which no UTF-8 file or
    database can hold) replaced by U+FFFD."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _text(data: bytes, url: str) -> str:
    """choices[0].message.content of a 200 reply (its body never shown: it may echo the key)."""
    try:
        content = json.loads(data)["choices"][0]["message"]["content"] or ""
        if not isinstance(content, str):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        raise EndpointError(
            f"--endpoint: {url} answered 200 with no choices[0].message.content (body not shown)"
        ) from None
    return clean_text(content)


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a reply holds: the whole text, or inside a ``` fence, or from its first
    "{" to its last "}"; None when there is none."""
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    for candidate in (text, text[text.find("{") : text.rfind("}") + 1]):
        try:
            obj = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def repair_tail(path: Path) -> str | None:
    """Before appending to an output file: a last line without its newline (a write cut short
    by a crash) gets its newline when it is a whole JSON object, else is cut off (that key is
    asked again). A notice line when a line was dropped, else None."""
    from pdctl.files import open_nofollow
    from pdctl.interp.labels import loads, read_bytes

    try:
        data = read_bytes(path, nofollow=True)
    except FileNotFoundError:
        return None
    if not data or data.endswith(b"\n"):
        return None
    cut = data.rfind(b"\n") + 1
    try:
        whole = isinstance(loads(data[cut:]), dict)
    except ValueError:
        whole = False
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND)
    try:
        if whole:
            os.write(fd, b"\n")
        else:
            os.ftruncate(fd, cut)
        os.fsync(fd)
    finally:
        os.close(fd)
    if whole:
        return None
    return (f"{path}: dropped its last line ({len(data) - cut} bytes, cut short, not JSON); "
            "that one is asked again")  # fmt: skip


def done_keys(path: Path, field_name: str) -> set[str]:
    """The `key`s already answered in an output file (lines that do not parse are ignored: a
    line cut short by a crash is asked again)."""
    from pdctl.interp.labels import decode, loads, read_bytes

    keys: set[str] = set()
    try:
        lines = decode(read_bytes(path, nofollow=True), path).splitlines()
    except FileNotFoundError:
        return keys
    for line in lines:
        try:
            obj = loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get(field_name) is not None:
            keys.add(str(obj.get("key")))
    return keys


@dataclass
class Outcome:
    asked: int = 0
    answered: int = 0
    unusable: list[str] = field(default_factory=list)
    skipped: int = 0


def run(
    client: Client,
    jobs: Iterable[tuple[str, str, dict[str, Any]]],
    out: Path,
    parse: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None],
    on_step: Callable[[], None] = lambda: None,
) -> Outcome:
    """For each (key, prompt, base) job: ask, `parse` the reply's JSON object into the fields
    to add to `base`, append `base | fields` to `out` (one line, fsynced). Stops with the
    endpoint's error (what was appended so far is kept)."""
    res = Outcome()
    from pdctl.files import open_nofollow

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise PdctlError(f"{out}: cannot write it ({e.strerror or e})") from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        for key, prompt, base in jobs:
            res.asked += 1
            obj = json_object(client.chat(clean_text(prompt)))
            fields = parse(obj, base) if obj is not None else None
            if fields is None:
                res.unusable.append(key)
            else:
                line = clean_text(json.dumps(base | fields, ensure_ascii=False))
                try:
                    f.write(line + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    raise PdctlError(f"{out}: cannot write it ({e.strerror or e})") from None
                res.answered += 1
            on_step()
    return res


def label_fields(model: str) -> Callable[..., dict[str, Any] | None]:
    """A label reply's fields: label, reasoning, source (the model)."""

    def parse(obj: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
        label = obj.get("label")
        if not isinstance(label, str) or not label.strip():
            return None
        reasoning = obj.get("reasoning")
        return {"label": label.strip(),
                "reasoning": reasoning if isinstance(reasoning, str) else None,
                "source": model}  # fmt: skip

    return parse


def prediction_fields(obj: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """A trial reply's predictions: one yes / no per example of the trial (`base`)."""
    preds = obj.get("predictions")
    if not isinstance(preds, list) or len(preds) != len(base.get("examples") or []):
        return None
    said = [p.strip().lower() if isinstance(p, str) else p for p in preds]
    if not all(p in ("yes", "no", True, False) for p in said):
        return None
    return {"predictions": ["yes" if p in ("yes", True) else "no" for p in said]}

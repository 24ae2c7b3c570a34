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
    timeout_s: float = 120.0
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
            self._http = httpx.Client(timeout=self.timeout_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.sleep(self._backoff(attempt, why))
            self._wait_turn()
            try:
                r = self._http.post(self.url, json=body, headers=headers)
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
                continue
            if r.status_code == 200:
                try:
                    return r.json()["choices"][0]["message"]["content"] or ""
                except (ValueError, KeyError, IndexError, TypeError):
                    raise EndpointError(
                        f"--endpoint: {self.url} answered 200 with no choices[0].message."
                        f"content: {r.text[:200]!r}"
                    ) from None
            why = f"HTTP {r.status_code}"
            self._retry_after = r.headers.get("retry-after")
            if r.status_code not in RETRY_STATUS and r.status_code < 500:
                raise EndpointError(f"--endpoint: {self.url} answered {why}: {r.text[:200]!r}")
        raise EndpointError(f"--endpoint: {self.url}: {why} after {self.retries} retries")

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


def json_object(text: str) -> dict[str, Any] | None:
    """The JSON object a reply holds: the whole text, or inside a ``` fence, or from its first
    "{" to its last "}"; None when there is none."""
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    for candidate in (text, text[text.find("{") : text.rfind("}") + 1]):
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def done_keys(path: Path, field_name: str) -> set[str]:
    """The `key`s already answered in an output file (lines that do not parse are ignored: a
    line cut short by a crash is asked again)."""
    keys = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return keys
    for line in lines:
        try:
            obj = json.loads(line)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    from pdctl.files import open_nofollow

    fd = open_nofollow(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        for key, prompt, base in jobs:
            res.asked += 1
            obj = json_object(client.chat(prompt))
            fields = parse(obj, base) if obj is not None else None
            if fields is None:
                res.unusable.append(key)
            else:
                f.write(json.dumps(base | fields, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
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

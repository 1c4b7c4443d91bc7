"""``serve --chat-template FILE`` and an HF ``config.json`` are read as bounded regular files: a FIFO (which blocked
the start until a writer came) or a device is refused with the flag and the fix, and so is a file larger than any
template, before a byte of it is read. Before, both were read whole with ``read_text``."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from moeforge.core.config import ModelConfig
from moeforge.core.errors import ConfigError, MoeforgeError
from moeforge.model.chat_template import CHAT_TEMPLATE_MAX_CHARS
from moeforge.serve.runner import ServeOptions, server_config

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _refusal(read: Callable[[], object], fifo: Path | None = None) -> BaseException | None:
    """What ``read()`` raised, run in a thread; a read that blocks on ``fifo`` is unblocked (a writer opens and
    closes it) and counts as a hang."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            read()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader gets its end of file
        thread.join(timeout=10)
        pytest.fail(f"reading the FIFO {fifo} blocked")
    return raised[0] if raised else None


def _serve(tmp_path: Path, template: Path) -> ServeOptions:
    return ServeOptions(artifact=tmp_path / "no-such-artifact", chat_template=template)


def test_a_fifo_chat_template_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "template.jinja"
    os.mkfifo(fifo)
    error = _refusal(lambda: server_config(_serve(tmp_path, fifo)), fifo)
    assert isinstance(error, MoeforgeError), error
    assert "--chat-template" in str(error) and "not a regular file" in str(error)
    assert "name a regular UTF-8 file" in str(error)


def test_an_oversized_or_undecodable_chat_template_is_refused(tmp_path: Path) -> None:
    huge = tmp_path / "huge.jinja"
    with open(huge, "wb") as handle:
        handle.truncate(CHAT_TEMPLATE_MAX_CHARS + 1)  # sparse: refused by its size, never read
    with pytest.raises(MoeforgeError, match=rf"--chat-template: .*huge\.jinja is {CHAT_TEMPLATE_MAX_CHARS + 1} "
                                            r"bytes, over the"):
        server_config(_serve(tmp_path, huge))
    latin = tmp_path / "latin.jinja"
    latin.write_bytes(b"{{ 'caf\xe9' }}")
    with pytest.raises(MoeforgeError, match=r"--chat-template .*latin\.jinja: not UTF-8 text"):
        server_config(_serve(tmp_path, latin))
    ordinary = tmp_path / "ok.jinja"
    ordinary.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    assert server_config(_serve(tmp_path, ordinary)).chat_template == ordinary.read_text(encoding="utf-8")


def test_a_fifo_config_json_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    error = _refusal(lambda: ModelConfig.from_hf_json(fifo), fifo)
    assert isinstance(error, ConfigError), error
    assert "not a regular file" in str(error) and "a regular JSON file" in str(error)

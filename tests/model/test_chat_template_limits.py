"""Hostile chat templates are refused before they grow a value, not after (issue: a 12 s / 2.4 GB render through
``|indent``, and an out-of-memory through a nested list printed whole), and a template that does not parse is
refused when the server starts, not blamed on each client."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from moeforge.core.errors import MoeforgeError, TokenizerError
from moeforge.model.chat_template import CHAT_TEMPLATE_MAX_CHARS, check_chat_template, render_chat_template
from moeforge.serve.runner import ServeOptions, build_app

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED = "{% set a=['x'*999999]*999 %}"  # a million references to one string: cheap until printed


@pytest.mark.parametrize("source", [
    "{% set s='a\\n'*1000 %}{{ (s|indent(999999))|length }}",  # 1,000 lines x 999,999 spaces
    NESTED + "{% set b=[a]*999 %}{{ b }}",  # printed whole: ~10^12 characters
    NESTED + "{{ (a ~ '')|length }}",
    NESTED + "{{ (a|string)|length }}",
    NESTED + "{{ a|join|length }}",
    NESTED + "{{ a|tojson|length }}",
    NESTED + "{{ ('%s' % (a,))|length }}",
    NESTED + "{{ '{}'.format(a)|length }}",
])
def test_a_value_that_would_outgrow_the_limit_is_refused_before_it_is_made(source):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match="exceeded its size limit"):
        render_chat_template(source, MESSAGES, True, {})
    assert time.perf_counter() - start < 1.0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024  # nothing near the value's size was allocated


def test_ordinary_templates_still_render():
    source = "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] }}\n{% endfor %}{{ [1, 'a'] }}{{ 'x' * 10 }}"
    assert render_chat_template(source, MESSAGES, True, {}) == "user: hi\n[1, 'a']xxxxxxxxxx"
    big = f"{{{{ 'y' * {CHAT_TEMPLATE_MAX_CHARS // 2} }}}}"  # large but within the limit
    assert len(render_chat_template(big, MESSAGES, True, {})) == CHAT_TEMPLATE_MAX_CHARS // 2


def test_a_template_that_does_not_parse_is_refused_up_front(tmp_path: Path):
    with pytest.raises(TokenizerError, match="does not parse"):
        check_chat_template("{% for %}")
    check_chat_template("{{ messages[0]['content'] }}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if messages %}never closed")
    # The server refuses it before loading any model (the artifact path is never read).
    options = ServeOptions(artifact=tmp_path / "no-such-artifact", chat_template=broken)
    with pytest.raises(MoeforgeError, match=r"--chat-template .*broken\.jinja: the chat template does not parse"):
        build_app(options)

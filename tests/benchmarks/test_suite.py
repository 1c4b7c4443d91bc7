"""benchmarks/ as a suite: every script is a published benchmark, a tool or a shared module of suite.py's table;
every results file belongs to a benchmark and describes its machine; ``python -m benchmarks`` lists and runs them by
name; the docs' rendered tables are the committed results'."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_rate
import speed_table
import suite

ROOT = suite.HERE.parent


def _entry_point(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_every_script_is_a_benchmark_a_tool_or_a_shared_module():
    published = {b.name for b in suite.PUBLISHED}
    tools = {stem for stem, _ in suite.TOOLS.values()}
    shared = set(suite.SHARED)
    assert not (published & tools) and not (published & shared) and not (tools & shared)
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "__main__"}
    assert scripts == published | tools | shared, "a script in benchmarks/ that suite.py does not name, or the reverse"
    assert len(published) == len(suite.PUBLISHED)  # no name twice


def test_every_results_file_belongs_to_a_benchmark_and_describes_its_machine():
    files = sorted(suite.RESULTS.glob("*.json"))
    assert files
    for path in files:
        benchmark = suite.owner(path)
        assert benchmark is not None, f"{path.name}: no benchmark in suite.py writes it"
        claimed = [b.name for b in suite.PUBLISHED if any(path.match(p) for p in b.results)]
        assert claimed == [benchmark.name], f"{path.name} matches several benchmarks: {claimed}"
        payload = json.loads(path.read_text())
        assert {"benchmark", "date_utc", "machine", "results"} <= payload.keys(), path.name
        assert payload["machine"]["cpu"] and payload["machine"]["usable_cores"] >= 1, path.name


def test_list_names_every_benchmark_and_tool_without_importing_moeforge():
    code = ("import sys; from benchmarks.__main__ import main; main(['list']); "
            "print('imported:', sorted(m for m in ('moeforge', 'torch', 'onnxruntime') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    listed = {line.split()[0] for line in run.stdout.splitlines() if line.startswith("    ")}
    assert listed == {b.name for b in suite.PUBLISHED} | set(suite.TOOLS) | set(suite.SHARED)
    assert run.stdout.rstrip().endswith("imported: []")
    assert _entry_point("list").stdout == run.stdout.rsplit("imported:", 1)[0]


def test_a_name_runs_its_script_and_a_wrong_name_is_refused():
    by_name = _entry_point("tables", "--print")
    by_path = subprocess.run([sys.executable, "benchmarks/speed_table.py", "--print"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert by_name.returncode == by_path.returncode == 0
    assert by_name.stdout == by_path.stdout and "genai_compare" in by_name.stdout
    typo = _entry_point("kv_tier")
    assert typo.returncode == 2 and "did you mean 'kv_tiers'" in typo.stderr
    assert "python -m benchmarks list" in typo.stderr
    shared = _entry_point("timer", "--help")
    assert shared.returncode == 2 and "shared module" in shared.stderr


def test_results_lists_every_file_with_its_benchmark():
    run = _entry_point("results")
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split()[1] for line in run.stdout.splitlines()}
    assert rows == {p.name: suite.owner(p).name for p in suite.RESULTS.glob("*.json")}


def test_the_docs_rendered_tables_are_the_committed_results():
    text = speed_table.DOC.read_text()
    rendered = text.split(speed_table.START + "\n", 1)[1].split(speed_table.END, 1)[0]
    assert rendered == speed_table.speed_section(), "run `python -m benchmarks tables` after changing results/"


def test_the_readme_names_every_benchmark_and_tool():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    names = [b.name for b in suite.PUBLISHED] + list(suite.TOOLS) + [name for name in suite.SHARED if name != "suite"]
    missing = [name for name in names if f"`{name}`" not in readme]
    assert not missing, f"benchmarks/README.md does not name {missing}"


class _FakeEngine:
    """Each step gives every unfinished request one token; the first step is the prefill."""

    def __init__(self, vocab: int):
        self.backend = type("Backend", (), {"vocab_size": vocab})()
        self.requests: list[tuple[list[int], int, list[int]]] = []  # prompt, max_tokens, tokens so far
        self.steps = 0

    def add_request(self, prompt, params):
        assert params.ignore_eos
        self.requests.append((prompt, params.max_tokens, []))

    def step(self):
        self.steps += 1
        for _, max_tokens, tokens in self.requests:
            if len(tokens) < max_tokens:
                tokens.append(0)

    def has_unfinished(self):
        return any(len(tokens) < max_tokens for _, max_tokens, tokens in self.requests)


def test_decode_rate_counts_the_decode_steps_tokens_and_not_the_prefill(monkeypatch):
    class OneSecond:
        def elapsed(self):
            return 1.0

    monkeypatch.setattr(decode_rate, "Stopwatch", OneSecond)
    engine = _FakeEngine(vocab=50)
    assert decode_rate.decode_rate(engine, batch=3, new_tokens=10) == pytest.approx(3 * 9)
    assert engine.steps == 10 and len(engine.requests) == 3
    assert all(len(prompt) == 8 and all(0 <= t < 50 for t in prompt) for prompt, _, _ in engine.requests)

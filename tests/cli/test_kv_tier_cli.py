"""The KV-tier flags on the command line: ``moeforge run --kv-disk-dir`` leaves the prompt's blocks for the next run,
``moeforge bench --multi-turn`` compares the tiers with the pool alone, and the flags are refused where they cannot
work (a contiguous artifact, PyTorch)."""

import json

import pytest

from moeforge.cli import main
from moeforge.model.loader import load_model
from moeforge.runtime.sampler import SamplingParams
from moeforge.verify.generate import generate

PROMPT = [(5 * j) % 200 + 3 for j in range(40)]


def _run(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def paged(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-tiers") / "paged"
    assert main(["compile", "tiny-llama", "-o", str(out), "--max-seq-len", "512", "--kv-cache", "paged"]) == 0
    return out


def test_run_leaves_its_blocks_on_disk_for_the_next_run(capsys, paged, tmp_path):
    args = ["run", str(paged), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--ignore-eos",
            "--json", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-bytes", "64M"]
    code, first, err = _run(capsys, *args)
    assert code == 0, err
    files = list((tmp_path / "kv").rglob("*.kvblock"))
    assert len(files) == 2  # the 40-token prompt's two full blocks (the generated tokens fill no third)
    code, second, err = _run(capsys, *args)
    assert code == 0, err
    expected = generate(load_model("tiny-llama").model, PROMPT, SamplingParams(max_tokens=6)).token_ids
    assert json.loads(first)["token_ids"] == json.loads(second)["token_ids"] == expected


def test_bench_multi_turn_reports_fewer_prefill_tokens_and_the_same_outputs(capsys, paged, tmp_path):
    code, out, err = _run(capsys, "bench", str(paged), "--multi-turn", "--conversations", "6", "--turns", "2",
                          "--kv-blocks", "60", "--kv-host-bytes", "1M", "--kv-disk-dir", str(tmp_path / "kv"),
                          "--json")
    assert code == 0, err
    runs = json.loads(out)["runs"]
    assert list(runs) == ["pool only", "tiers", "tiers after restart"]
    assert all(run["identical_to_pool_only"] for run in runs.values())
    computed = [run["prefill_tokens_computed"] for run in runs.values()]
    assert computed[0] > computed[1] > computed[2]
    assert runs["tiers after restart"]["kv_tiers"]["disk_hits"] > 0
    assert list((tmp_path / "kv").iterdir()) == []  # the bench's own scratch folder is gone


def test_tier_flags_are_refused_where_they_cannot_work(capsys, tmp_path):
    contiguous = tmp_path / "contiguous"
    assert main(["compile", "tiny-llama", "-o", str(contiguous), "--max-seq-len", "64"]) == 0
    capsys.readouterr()
    code, _, err = _run(capsys, "run", str(contiguous), "--prompt-ids", "1,2,3", "--kv-host-bytes", "1M")
    assert code == 2 and "--kv-cache paged" in err
    code, _, err = _run(capsys, "run", "tiny-llama", "--backend", "torch", "--prompt-ids", "1,2", "--kv-disk-dir",
                        str(tmp_path / "kv"))
    assert code == 2 and "PyTorch has none" in err
    code, _, err = _run(capsys, "bench", str(contiguous), "--kv-host-bytes", "1M")
    assert code == 2 and "--multi-turn" in err

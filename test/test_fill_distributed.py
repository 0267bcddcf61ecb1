"""fill_cache under torchrun on CPU (interpreter target): the deal, the messages between ranks, and
two ranks filling one cache end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import last_json, run_python
from torch_kernelize.fill_cache import distributed
from torch_kernelize.fill_cache.collect import UsageError, Work
from torch_kernelize.fill_cache.distributed import RankGroup, deal, worst


def _work(key: str, covered_by: tuple[str, ...] = ()) -> Work:
    return Work(types.SimpleNamespace(key=key), "test", covered_by=list(covered_by))


def test_deal_gives_every_spec_once_largest_first_and_a_regions_nodes_with_it():
    sizes = {"a": 10, "b": 9, "c": 8, "d": 3, "e": 2, "region": 5, "n1": 4, "n2": 4, "inner": 1}
    work = [_work("region"), _work("inner", ("region",)), *(_work(k) for k in "abcde"),
            _work("n1", ("inner", "region")), _work("n2", ("region",))]
    shares = deal(work, 3, lambda w: sizes[w.spec.key])
    keys = [[w.spec.key for w in s] for s in shares]
    assert sorted(k for s in keys for k in s) == sorted(sizes)
    # a=10 -> 0, b=9 -> 1, c=8 -> 2, region=5 -> 2 (least loaded), d=3 -> 1, e=2 -> 0
    assert keys == [["a", "e"], ["b", "d"], ["region", "inner", "c", "n1", "n2"]]
    # --gather-to-rank0: what rank 0's cache serves stays there (the other ranks' caches lack it)
    assert [w.spec.key for w in deal(work, 3, lambda w: sizes[w.spec.key], lambda w: w.spec.key in "ab")[0]] == [
        "a", "b"]
    # ties in weight (cached specs weigh nothing) are spread by count
    assert [len(s) for s in deal([_work(str(i)) for i in range(6)], 3, lambda w: 0)] == [2, 2, 2]


def test_worst_exit_code_puts_bad_input_first_then_interrupted_then_lost():
    assert worst([0, 1, 0]) == 1
    assert worst([1, 3]) == 3
    assert worst([3, 130, 1]) == 130
    assert worst([130, 2, 0]) == 2
    assert worst([130, 4, 3]) == 4 and worst([4, 2]) == 2  # the machine (a full disk) after bad input
    assert worst([]) == 0


def _group(store, rank: int, world: int) -> RankGroup:
    return RankGroup(dist.PrefixStore("t/", store), rank, world, dead_after=1.0)


def test_rank0_deals_collects_results_and_reports_a_rank_that_stopped_answering():
    store = dist.HashStore()
    work = [_work(k) for k in "abcd"]
    r0, r1, r2 = (_group(store, r, 3) for r in range(3))
    mine0, sid = r0.share(work, lambda w: 1, "run-1")
    mine1, sid1 = r1.share(list(reversed(work)), lambda w: 1, "ignored")  # its own order: rank 0's deal wins
    assert sid1 == sid == "run-1"
    assert [w.spec.key for w in mine0] == ["a", "d"] and [w.spec.key for w in mine1] == ["b"]
    assert r1.finish({"rank": 1, "code": 1, "rows": [{"key": "b"}]}) is None
    r2.store.add("alive/2", 1)  # it beat once, then died: its heartbeat stands still
    results, missing = r0.finish({"rank": 0, "code": 0, "rows": []})
    assert results[1]["rows"] == [{"key": "b"}] and results[1]["code"] == 1
    assert missing == [2]


def test_the_heartbeat_moves_while_the_rank_lives_and_stops_with_it(monkeypatch):
    monkeypatch.setattr(distributed, "HEARTBEAT_S", 0.05)
    g = _group(dist.HashStore(), 1, 2)
    starter = threading.Thread(target=g.start)  # not the main thread: no SIGTERM handler in pytest
    starter.start()
    starter.join()
    time.sleep(0.5)
    assert g.store.add("alive/1", 0) >= 3
    g.close()
    g._beat.join(timeout=5)
    stopped = g.store.add("alive/1", 0)
    time.sleep(0.3)
    assert g.store.add("alive/1", 0) == stopped


def test_a_rank_with_other_work_than_rank0_or_after_rank0_failed_stops_with_a_usage_error():
    store = dist.HashStore()
    r0, r1 = _group(store, 0, 2), _group(store, 1, 2)
    r0.share([_work("a"), _work("b")], lambda w: 1, "run-1")
    with pytest.raises(UsageError, match="other specs than rank 0"):
        r1.share([_work("a"), _work("c")], lambda w: 1, "x")

    store = dist.HashStore()
    r0, r1 = _group(store, 0, 2), _group(store, 1, 2)
    r1.store.set("result/1", json.dumps({"rank": 1, "code": 2, "rows": []}))
    r0.finish({"rank": 0, "code": 2, "error": "--model m.py:make: m.py does not exist", "rows": []})
    with pytest.raises(UsageError, match="rank 0 could not collect the work: --model m.py:make"):
        r1.share([_work("a")], lambda w: 1, "x")


MODEL = "torch_kernelize.model_zoo:make_mlp"

SERVE = """
import json, torch
from torch_kernelize.model_zoo import make_mlp
model, inputs = make_mlp()
compiled = torch.compile(model, backend="kernelize", options={{"target": "interpreter", "cache_dir": {cache!r},
                         "repro_dir": "off", "report": {report!r}}})
with torch.no_grad():
    err = (compiled(*inputs) - model(*inputs)).abs().max().item()
doc = json.load(open({report!r}))
nodes = [n for g in doc["graphs"] for n in g["nodes"]]
print(json.dumps({{"err": err, "misses": [n["op"] for n in nodes if n.get("miss")],
                   "triton": sum(n["tier"] == "triton" for n in nodes)}}))
"""


def torchrun_fill(cache: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "torch_kernelize.fill_cache", "--quiet", "--target", "interpreter",
                           "--cache-dir", str(cache), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_two_ranks_under_torchrun_search_every_spec_once_and_rank0_reports_the_run(tmp_path):
    cache = tmp_path / "cache"
    proc = torchrun_fill(cache, "--model", MODEL, "--budget", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("spec(s) in") == 1, proc.stdout  # one summary line, rank 0's
    runs = list(cache.glob("*/runs/*.json"))
    assert len(runs) == 1
    summary = json.loads(runs[0].read_text())
    rows = summary["specs"]
    assert len(rows) == len({r["key"] for r in rows}) >= 4  # every spec once, in one summary
    assert {r["rank"] for r in rows} == {0, 1}, "both ranks had a share"
    assert [(r["rank"], r["code"], r["specs"]) for r in summary["ranks"]] == [
        (0, 0, sum(r["rank"] == 0 for r in rows)), (1, 0, sum(r["rank"] == 1 for r in rows))]
    assert {r["status"] for r in rows} <= {"stored", "in a fused region"}
    # searched exactly once across the ranks: one journal per stored spec, one evaluation in each
    journals = list(cache.glob("*/journals/*.jsonl"))
    assert sorted(j.stem for j in journals) == sorted(r["key"] for r in rows if r["status"] == "stored")
    assert all(len(j.read_text().splitlines()) == 1 for j in journals)
    assert not list(cache.glob("*/journals/*.old")), "no spec was searched again"

    served = last_json(run_python(SERVE.format(cache=str(cache), report=str(tmp_path / "report.json"))))
    assert served["misses"] == [] and served["triton"] >= 2 and served["err"] < 1e-4, served


@pytest.mark.slow
def test_bad_input_on_every_rank_is_reported_once_by_rank0_with_its_exit_code(tmp_path):
    proc = torchrun_fill(tmp_path / "cache", "--model", f"{tmp_path / 'nowhere.py'}:make")
    assert proc.returncode == 1  # torchrun's own code when a process failed; it shows rank 0's
    assert "exitcode  : 2" in proc.stderr and "rank      : 0" in proc.stderr, proc.stderr
    assert "fill_cache: rank 1 " in proc.stderr and "exit 2: --model" in proc.stderr


# Loaded in every process of the torchrun job below: rank 1 kills itself (SIGKILL) right after the
# first evaluation it journals, in the middle of its first spec's search.
DIE_ON_RANK1 = """
import os, signal
if os.environ.get("RANK") == "1":
    from torch_kernelize.fill_cache import journal
    append = journal.Journal.append
    def append_then_die(self, record):
        append(self, record)
        os.kill(os.getpid(), signal.SIGKILL)
    journal.Journal.append = append_then_die
"""


@pytest.mark.slow
def test_a_rank_killed_mid_search_loses_nothing_and_resume_finishes_the_rest(tmp_path):
    cache = tmp_path / "cache"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DIE_ON_RANK1)
    args = ("--model", MODEL, "--budget", "2")
    killed = torchrun_fill(cache, *args, env={"PYTHONPATH": os.pathsep.join(
        [str(hook), os.environ.get("PYTHONPATH", "")])})
    assert killed.returncode != 0 and "exitcode  : -9" in killed.stderr, killed.stderr
    before = {j.stem: j.read_text().splitlines() for j in cache.glob("*/journals/*.jsonl")}
    assert before, "nothing was journaled before rank 1 died"

    resumed = torchrun_fill(cache, *args, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads(sorted(cache.glob("*/runs/*.json"))[-1].read_text())
    rows = {r["key"]: r for r in summary["specs"]}
    assert {r["status"] for r in rows.values()} <= {"stored", "cached", "in a fused region"}
    assert any(r["resumed"] for r in rows.values()), "the search rank 1 died in was resumed"
    for j in cache.glob("*/journals/*.jsonl"):
        lines = j.read_text().splitlines()
        assert lines[:len(before.get(j.stem, []))] == before.get(j.stem, []), "a journaled evaluation was lost"
        configs = [json.dumps(json.loads(x)["config"], sort_keys=True) for x in lines]
        assert len(configs) == len(set(configs)) <= 2, "an evaluation was repeated"
    served = last_json(run_python(SERVE.format(cache=str(cache), report=str(tmp_path / "report.json"))))
    assert served["misses"] == [], served


@pytest.mark.slow
@pytest.mark.parametrize("rank1_key", ["same user", "another key"])
def test_gather_to_rank0_imports_every_ranks_entries_into_rank0s_cache(tmp_path, rank1_key):
    cache = tmp_path / "cache"
    env = {}
    if rank1_key == "another key":  # rank 1 signs with a key rank 0 does not trust: its entries are re-validated
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(
            f"import os\nif os.environ.get('RANK') == '1':\n    os.environ['KERNELIZE_CONFIG_DIR'] = {str(tmp_path / 'other')!r}\n")
        env["PYTHONPATH"] = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    proc = torchrun_fill(cache, "--model", MODEL, "--budget", "1", "--gather-to-rank0", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(next(cache.glob("*/runs/*.json")).read_text())
    rank1 = summary["ranks"][1]
    assert rank1["specs"] > 0 and rank1["gathered"]["imported"] >= 1 and not rank1["gathered"]["rejected"], rank1
    accepted = rank1["gathered"]["accepted_by"]
    assert ("revalidation" in accepted) == (rank1_key == "another key"), accepted
    assert list((cache / "rank-1").glob("*/entries/*/entry.json")), "rank 1 filled a cache of its own"
    served = last_json(run_python(SERVE.format(cache=str(cache), report=str(tmp_path / "report.json"))))
    assert served["misses"] == [], served

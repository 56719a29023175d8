"""loadtest.traces: readers on the shipped files (numbers from loadtest/data/README.md),
generator statistics, prompt synthesis."""

from __future__ import annotations

import json
import math
import tomllib

import numpy as np
import pytest

from loadtest.traces import (DATA_DIR, SHIPPED_TIME_UNITS, TRACE_NAMES, TraceFileError, TraceRequest,
                             TraceUnitError, gamma_bursts, load_trace, poisson, rag, rag_cover_pool, rag_doc_blocks,
                             rag_fresh_docs_apart, replay_header, save_trace, synth_token_ids)

TRACES = DATA_DIR

# file -> (rows, span seconds, input mean, output mean) from the README
SHIPPED = {
    "AzureLLMInferenceTrace_code.csv": (8819, 3436, 2048, 27.9),
    "AzureLLMInferenceTrace_conv.csv": (19366, 3502, 1155, 211),
    "AzureLLMInferenceTrace_code.replay.jsonl": (8819, 3436, 2048, 27.9),
    "AzureLLMInferenceTrace_conv.replay.jsonl": (19366, 3502, 1155, 211),
    "mooncake_conversation_trace.jsonl": (12031, 3537, 12035, 343),
    "mooncake_synthetic_trace.jsonl": (3993, 1022, 15325, 149),
    "BurstGPT_1_first400.csv": (383, 37274 - 5, None, None),  # 17 failed rows dropped
    "BurstGPT_3_first400.csv": (399, 41453, None, None),  # 1 failed row dropped
    "BurstGPT_1_first400.replay.jsonl": (383, 37274 - 5, None, None),
    "BurstGPT_3_first400.replay.jsonl": (399, 41453, None, None),
}


@pytest.fixture(scope="module")
def loaded():
    return {name: load_trace(str(TRACES / name)) for name in SHIPPED}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_trace_matches_readme(loaded, name):
    rows, span, in_mean, out_mean = SHIPPED[name]
    reqs = loaded[name]
    assert len(reqs) == rows
    assert reqs[0].arrival == 0.0
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    assert reqs[-1].arrival == pytest.approx(span, abs=1.0)
    assert all(r.input_tokens > 0 and r.output_tokens > 0 for r in reqs)
    if in_mean is not None:
        assert np.mean([r.input_tokens for r in reqs]) == pytest.approx(in_mean, rel=0.01)
        assert np.mean([r.output_tokens for r in reqs]) == pytest.approx(out_mean, rel=0.01)


def test_csv_and_replay_agree(loaded):
    for stem in ("AzureLLMInferenceTrace_code", "BurstGPT_1_first400", "BurstGPT_3_first400"):
        a, b = loaded[stem + ".csv"], loaded[stem + ".replay.jsonl"]
        assert [(r.input_tokens, r.output_tokens) for r in a] == [(r.input_tokens, r.output_tokens) for r in b]
        assert max(abs(x.arrival - y.arrival) for x, y in zip(a, b)) < 1e-5


@pytest.mark.parametrize("name,repeat", [("mooncake_conversation_trace.jsonl", 0.366),
                                         ("mooncake_synthetic_trace.jsonl", 0.640)])
def test_mooncake_hash_ids(loaded, name, repeat):
    reqs = loaded[name]
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in reqs)
    seen: set[int] = set()
    total = repeated = 0
    for r in reqs:
        for h in r.hash_ids:
            total += 1
            repeated += h in seen
            seen.add(h)
    assert repeated / total == pytest.approx(repeat, abs=0.001)


def test_limit_and_save_roundtrip(tmp_path):
    reqs = load_trace(str(TRACES / "mooncake_conversation_trace.jsonl"), limit=50)
    assert len(reqs) == 50 and reqs[0].arrival == 0.0
    out = tmp_path / "x.replay.jsonl"
    save_trace(str(out), reqs)
    back = load_trace(str(out))
    assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]
    assert [r.arrival for r in back] == pytest.approx([r.arrival for r in reqs])


def test_unknown_csv_is_rejected(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError):
        load_trace(str(p))


def _gaps(reqs):
    return np.diff([r.arrival for r in reqs])


def test_poisson_rate_and_cv():
    reqs = poisson(20.0, 8000, (10, 100), 16, seed=1)
    g = _gaps(reqs)
    assert reqs[0].arrival == 0.0
    assert 1 / g.mean() == pytest.approx(20.0, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)
    ins = [r.input_tokens for r in reqs]
    assert min(ins) == 10 and max(ins) == 100 and all(r.output_tokens == 16 for r in reqs)
    assert poisson(20.0, 100, 8, 8, seed=1) == poisson(20.0, 100, 8, 8, seed=1)
    assert poisson(20.0, 100, 8, 8, seed=1) != poisson(20.0, 100, 8, 8, seed=2)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_cv(burstiness):
    g = _gaps(gamma_bursts(5.0, 8000, burstiness, 32, 32, seed=3))
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.07)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_rag_hit_rate_and_shared_prefixes():
    n, docs, hit = 4000, 20, 0.6
    reqs = rag(10.0, n, docs, 1000, (20, 40), 16, hit, burstiness=0.5, seed=4)
    blocks = math.ceil(1000 / 512)
    assert all(len(r.hash_ids) == blocks for r in reqs)
    assert all(blocks * 512 + 20 <= r.input_tokens <= blocks * 512 + 40 for r in reqs)
    first = [r.hash_ids[0] for r in reqs]
    pooled = sum(h < docs * blocks for h in first)
    assert pooled / n == pytest.approx(hit, abs=0.03)
    # prefix hit rate an infinite cache would see: requests whose document was seen before
    seen, reused = set(), 0
    for h in first:
        reused += h in seen
        seen.add(h)
    assert reused / n == pytest.approx(hit - docs / n, abs=0.03)
    g = _gaps(reqs)
    assert g.std() / g.mean() == pytest.approx(math.sqrt(2), rel=0.1)


def test_synth_token_ids_shares_exactly_the_common_prefix():
    a = TraceRequest(0.0, 1300, 8, (1, 2, 3))
    b = TraceRequest(0.5, 1300, 8, (1, 2, 9))
    c = TraceRequest(0.7, 700, 8, (1,))  # partial hash coverage: tail past block 0 is unique
    ta, tb, tc = synth_token_ids(a), synth_token_ids(b), synth_token_ids(c)
    assert len(ta) == len(tb) == 1300 and len(tc) == 700
    assert ta[:1024] == tb[:1024] and ta[1024:] != tb[1024:]
    assert tc[:512] == ta[:512] and tc[512:] != ta[512:700]
    assert synth_token_ids(a) == ta  # deterministic
    assert synth_token_ids(a, seed=1)[:512] != ta[:512]
    assert all(0 <= t < 300 for t in synth_token_ids(a, vocab_size=300))
    # identical rows told apart by salt; no hash_ids -> nothing shared
    p = TraceRequest(1.0, 64, 4)
    assert synth_token_ids(p) == synth_token_ids(p)
    assert synth_token_ids(p, salt=1) != synth_token_ids(p, salt=2)
    # RAG: the document blocks are shared, the question is not
    r1, r2 = [r for r in rag(1.0, 200, 1, 512, 30, 4, 1.0, seed=0)][:2]
    s1, s2 = synth_token_ids(r1), synth_token_ids(r2)
    assert s1[:512] == s2[:512] and s1[512:] != s2[512:]


def test_short_names_load_the_shipped_files_and_unknown_ones_say_what_exists():
    assert set(TRACE_NAMES.values()) <= set(SHIPPED)
    assert load_trace("burstgpt-3", limit=5) == load_trace(str(DATA_DIR / "BurstGPT_3_first400.csv"), limit=5)
    with pytest.raises(FileNotFoundError, match="neither a file nor a shipped trace.*azure-conv"):
        load_trace("azure-conversation")


def test_shipped_data_is_documented_and_installed():
    """Every name and file is in the data README, and the wheel's package-data glob takes every file."""
    readme = (DATA_DIR / "README.md").read_text()
    assert all(f"`{name}`" in readme and f"`{file}`" in readme for name, file in TRACE_NAMES.items())
    assert all(f"`{file}`" in readme for file in SHIPPED)
    pyproject = tomllib.loads((DATA_DIR.parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["loadtest"]
    packaged = {p for g in globs for p in DATA_DIR.parent.glob(g)}  # setuptools expands them the same way
    assert {p for p in DATA_DIR.rglob("*") if p.is_file()} <= packaged


# ------------------------------------------------------------------ the timestamps' unit of a JSONL trace

def _rows(path, rows, header=None):
    with open(path, "w") as f:
        if header is not None:
            f.write(json.dumps(header) + "\n")
        for t, h in rows:
            f.write(json.dumps({"timestamp": t, "input_length": 10, "output_length": 2, "hash_ids": h}) + "\n")
    return str(path)


def test_trace_unit_from_the_header_line(tmp_path):
    reqs = [TraceRequest(0.0, 600, 4, (1, 2)), TraceRequest(1.25, 700, 8, (1, 3))]
    out = tmp_path / "x.jsonl"  # no *.replay.jsonl name: the header says the unit
    save_trace(str(out), reqs)
    assert json.loads(out.read_text().splitlines()[0]) == replay_header("s")
    assert load_trace(str(out)) == reqs
    ms = _rows(tmp_path / "ms.jsonl", [(0, [1]), (2500, [1, 2])], {"trace_format": "laneserve-replay",
                                                                  "time_unit": "ms"})
    assert [r.arrival for r in load_trace(ms)] == [0.0, 2.5]
    bad = _rows(tmp_path / "bad.jsonl", [(0, [1])], {"trace_format": "laneserve-replay", "time_unit": "h"})
    with pytest.raises(TraceUnitError, match="bad header"):
        load_trace(bad)


@pytest.mark.parametrize("name", ["mine.jsonl", "mine.replay.jsonl", "mooncake_mine.jsonl"])
def test_an_unmarked_jsonl_is_an_error_that_names_the_fix(tmp_path, name):
    """No header, not shipped: whatever its name and whether or not it has hash_ids, nothing is guessed."""
    for rows in ([(0, [1]), (1500, [2])], [(0, []), (1.5, [])]):
        path = _rows(tmp_path / name, rows)
        with pytest.raises(TraceUnitError, match="--time-unit s or --time-unit ms.*trace_format"):
            load_trace(path)


def test_time_unit_flag_reads_an_unmarked_file_and_must_agree_with_a_marked_one(tmp_path):
    path = _rows(tmp_path / "t.jsonl", [(0, [1]), (1500, [2])])
    assert [r.arrival for r in load_trace(path, time_unit="ms")] == [0.0, 1.5]
    assert [r.arrival for r in load_trace(path, time_unit="s")] == [0.0, 1500.0]
    marked = tmp_path / "m.jsonl"
    save_trace(str(marked), [TraceRequest(0.0, 5, 1), TraceRequest(2.0, 5, 1)])
    assert [r.arrival for r in load_trace(str(marked), time_unit="s")] == [0.0, 2.0]
    with pytest.raises(TraceUnitError, match="contradicts its header"):
        load_trace(str(marked), time_unit="ms")
    with pytest.raises(TraceUnitError, match="contradicts the shipped"):
        load_trace("mooncake-conversation", time_unit="s")
    with pytest.raises(TraceUnitError, match="applies to JSONL"):
        load_trace("burstgpt-1", time_unit="s")
    with pytest.raises(TraceUnitError, match="unknown time unit"):
        load_trace(path, time_unit="us")


def test_shipped_jsonl_traces_are_known_by_name_and_a_copy_elsewhere_is_not(tmp_path):
    assert {p.name for p in DATA_DIR.glob("*.jsonl")} == set(SHIPPED_TIME_UNITS)
    moon = load_trace("mooncake-conversation", limit=200)  # ms in the file
    assert moon == load_trace(str(DATA_DIR / "mooncake_conversation_trace.jsonl"), limit=200)
    assert moon[-1].arrival == pytest.approx(72, abs=2)  # the first 200 rows span 72 s (data README, section 5)
    assert load_trace(str(DATA_DIR / "BurstGPT_1_first400.replay.jsonl"), time_unit="s")[-1].arrival > 37000
    copy = tmp_path / "mooncake_conversation_trace.jsonl"
    copy.write_bytes((DATA_DIR / "mooncake_conversation_trace.jsonl").read_bytes()[:20000].rsplit(b"\n", 1)[0])
    with pytest.raises(TraceUnitError, match="not a shipped trace"):
        load_trace(str(copy))
    assert load_trace(str(copy), time_unit="ms") == load_trace("mooncake-conversation", limit=len(load_trace(
        str(copy), time_unit="ms")))


def test_rag_runs_share_the_pool_but_not_fresh_documents():
    a = rag(10.0, 300, 4, 1000, 8, 2, 0.5, seed=1)
    pooled = 4 * rag_doc_blocks(1000)
    b1, b2 = rag_fresh_docs_apart(a, 4, 1000, run=1), rag_fresh_docs_apart(a, 4, 1000, run=2)
    for x, y, z in zip(a, b1, b2):
        assert (x.arrival, x.input_tokens, x.output_tokens) == (y.arrival, y.input_tokens, y.output_tokens)
        if x.hash_ids[0] < pooled:
            assert x.hash_ids == y.hash_ids == z.hash_ids
        else:
            assert len({x.hash_ids[0], y.hash_ids[0], z.hash_ids[0]}) == 3 and len(y.hash_ids) == len(x.hash_ids)
    fresh = [r for r in b1 if r.hash_ids[0] >= pooled]
    assert 100 < len(fresh) < 200 and len({r.hash_ids for r in fresh}) == len(fresh)
    cover = rag_cover_pool(a[:10], 4, 1000)
    assert [r.hash_ids[0] // rag_doc_blocks(1000) for r in cover] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert [r.input_tokens for r in cover] == [r.input_tokens for r in a[:10]]


# ------------------------------------------------------------------ bad trace files: one clear error, file and line

HEADER = json.dumps(replay_header("s"))
BURST = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _row(**kw) -> str:
    return json.dumps({"timestamp": 0, "input_length": 16, "output_length": 2} | kw)


BAD_FILES = [  # (file name, bytes, the error after "FILE")
    ("e.csv", b"", ": empty trace file"),
    ("b.jsonl", b"\n  \n\n", ": empty trace file"),
    ("h.jsonl", f"{HEADER}\n".encode(), ": no requests in the trace"),
    ("h.csv", BURST.encode(), ": no requests in the trace"),
    ("z.csv", (BURST + "1,m,0,4,4,x\n").encode(), ": no requests in the trace (rows with zero tokens"),
    ("u.csv", b"a,b\n1,2\n", ": unknown CSV trace columns ['a', 'b']; expected Timestamp, Request tokens"),
    ("m.jsonl", f'{HEADER}\n{{"timestamp": 0, "input_length": 5}}\n'.encode(), ":2: no output_length in the row"),
    ("l.jsonl", f"{HEADER}\n{_row()}\n[1, 2, 3]\n".encode(), ":3: expected a JSON object with timestamp"),
    ("x.jsonl", f"{HEADER}\n{_row(hash_ids=5)}\n".encode(), ":2: hash_ids 5: must be a list of whole numbers"),
    ("x.jsonl", f"{HEADER}\n{_row(hash_ids=[1.5])}\n".encode(), ":2: hash_ids [1.5]: must be a list"),
    ("2h.jsonl", f"{HEADER}\n{HEADER}\n{_row()}\n".encode(), ":2: a header line (trace_format) may only be the first"),
    ("j.jsonl", f'{HEADER}\n{_row()}\n{{"timestamp": 0,\n'.encode(), ":3: not a JSON line (Expecting"),
    ("n.jsonl", f"{HEADER}\n{_row(timestamp=math.nan)}\n".encode(), ":2: timestamp nan: must be a finite number"),
    ("i.jsonl", f"{HEADER}\n{_row(timestamp=math.inf)}\n".encode(), ":2: timestamp inf: must be a finite number"),
    ("t.jsonl", f"{HEADER}\n{_row(timestamp=1e300)}\n".encode(), ":2: timestamp 1e+300: out of range"),
    ("s.jsonl", f"{HEADER}\n{_row(timestamp='abc')}\n".encode(), ':2: timestamp "abc": not a number'),
    ("t.jsonl", f"{HEADER}\n{_row(timestamp=True)}\n".encode(), ":2: timestamp true: not a number"),
    ("ni.jsonl", f"{HEADER}\n{_row(input_length=-5)}\n".encode(), ":2: input_length -5: must be from 1 to 10,000,000"),
    ("zi.jsonl", f"{HEADER}\n{_row(input_length=0)}\n".encode(), ":2: input_length 0: must be from 1"),
    ("no.jsonl", f"{HEADER}\n{_row(output_length=-1)}\n".encode(), ":2: output_length -1: must be from 0"),
    ("f.jsonl", f"{HEADER}\n{_row(input_length=16.7)}\n".encode(), ":2: input_length 16.7: not a whole number"),
    ("g.jsonl", f"{HEADER}\n{_row(input_length=1e30)}\n".encode(), ":2: input_length 1e+30: must be from 1 to"),
    ("utf.jsonl", f"{HEADER}\n{_row()}\n".encode() + b'{"timestamp": "\xff"}\n', ":3: not UTF-8 text"),
    ("short.csv", (BURST + "0,16\n").encode(), ":2: 2 fields where the header has 6"),
    ("long.csv", (BURST + "0,m,1,2,3,x,9\n").encode(), ":2: 7 fields where the header has 6"),
    ("bi.csv", (BURST + "inf,m,1,2,3,x\n").encode(), ":2: Timestamp inf: must be a finite number"),
    ("bn.csv", (BURST + "1,m,-3,2,3,x\n").encode(), ":2: Request tokens -3: must be from 0"),
    ("bf.csv", (BURST + "1,m,3,2.5,3,x\n").encode(), ":2: Response tokens 2.5: not a whole number"),
    ("ad.csv", (AZURE + "2023-11-16 18:15:46.6805900,5,2\nnotadate,5,2\n").encode(), ":3: TIMESTAMP 'notadate': not a"),
    ("af.csv", (AZURE + "2023-11-16 18:15:46.6805900,16.5,2\n").encode(), ":2: ContextTokens 16.5: not a whole"),
    ("aa.csv", (AZURE + "2023-11-16 18:15:46.6805900,abc,2\n").encode(), ':2: ContextTokens "abc": not a number'),
]


@pytest.mark.parametrize("name,data,error", BAD_FILES)
def test_a_bad_trace_file_is_one_error_naming_the_file_and_line(tmp_path, name, data, error):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TraceFileError) as exc:
        load_trace(str(path))
    assert str(exc.value).startswith(str(path) + error), str(exc.value)


def test_a_bom_and_any_finite_timestamps_are_read(tmp_path):
    """A UTF-8 BOM is skipped (JSONL and CSV); negative timestamps are fine: the trace is rebased to its first."""
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + f"{HEADER}\n{_row(timestamp=-5)}\n{_row(timestamp=-1.5, output_length=0)}\n"
                      .encode())
    assert load_trace(str(jsonl)) == [TraceRequest(0.0, 16, 2), TraceRequest(3.5, 16, 0)]
    csv = tmp_path / "bom.csv"
    csv.write_bytes(b"\xef\xbb\xbf" + (BURST + "7,m,3,4,7,x\n9.5,m,5,6,11,x\n").encode())
    assert load_trace(str(csv)) == [TraceRequest(0.0, 3, 4), TraceRequest(2.5, 5, 6)]


@pytest.mark.parametrize("call,error", [
    (lambda: poisson(1.0, 4, (5, 3), 2), "--input-tokens 5:3: LO must not be more than HI"),
    (lambda: poisson(1.0, 4, 0, 2), "--input-tokens 0: must be N or LO:HI, whole numbers from 1"),
    (lambda: poisson(1.0, 4, 8, -1), "--output-tokens -1: must be N or LO:HI, whole numbers from 0"),
    (lambda: poisson(1.0, 4, 10**9, 2), "--input-tokens 1000000000: must be"),
    (lambda: poisson(1.0, 4, 2.5, 2), "--input-tokens 2.5: must be"),
    (lambda: poisson(1.0, 4, 8, 2, seed=-1), "--seed -1: must be a whole number >= 0"),
    (lambda: poisson(math.nan, 4, 8, 2), "--rate nan: must be a finite number > 0"),
    (lambda: gamma_bursts(1.0, 4, 0.0, 8, 2), "--burstiness 0.0: must be"),
    (lambda: poisson(1e-300, 4, 8, 2), "--rate 1e-300: 4 requests would span"),
    (lambda: poisson(1.0, 10**8, 8, 2), "--num-requests 100000000: must be a whole number up to 10,000,000"),
    (lambda: rag(1.0, 4, 2, 512, (9, 3), 2, 0.5), "--question-tokens 9:3: LO"),
    (lambda: rag(1.0, 4, 2, 512, 8, 2, 2.0), "--hit-rate 2.0: must be in [0, 1]"),
    (lambda: rag(1.0, 4, 2, 512, 8, 2, math.nan), "--hit-rate nan"),
    (lambda: rag(1.0, 4, -1, 512, 8, 2, 0.5), "--num-docs -1: must be a whole number >= 0"),
    (lambda: rag(1.0, 4, 2, 10**9, 8, 2, 0.5), "--doc-tokens 1000000000: must be"),
    (lambda: rag(1.0, 4, 2, 10**7, 8, 2, 0.5), "--doc-tokens 10000000 and --question-tokens 8: prompts over"),
])
def test_generators_name_the_flag_of_a_bad_value(call, error):
    with pytest.raises(ValueError) as exc:
        call()
    assert str(exc.value).startswith(error), str(exc.value)
    assert poisson(1.0, 0, 8, 2) == [] and len(poisson(1e-300, 1, 8, 2)) == 1

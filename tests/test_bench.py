"""`laneserve bench` and `laneserve calibrate-kv` flags: a bad value is argparse's one-line error naming the flag
(exit status 2), before the model loads; parts this machine cannot run are said, not skipped silently."""

from __future__ import annotations

import json

import pytest
import torch

from laneserve.cli import main as cli
from workers.tools.bench import unwritable

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the parts run on a GPU")


def _error(capsys, argv: list[str]) -> str:
    """The tool's error line for argv; asserts exit status 2 and that nothing ran (no model, no table)."""
    with pytest.raises(SystemExit) as exc:
        cli(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "", out
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("kept")
    return path


@pytest.mark.parametrize("flags, says", [
    (["--contexts", "0"], "argument --contexts: '0': every value must be at least 1"),
    (["--contexts", "-64"], "argument --contexts: '-64': every value must be at least 1"),
    (["--contexts", "1024,,2048"], "argument --contexts: '1024,,2048': expected a comma list of whole numbers"),
    (["--contexts", "1e3"], "argument --contexts"),
    (["--steps", "0"], "argument --steps: '0': must be 1 to 500"),
    (["--steps", "-5"], "argument --steps: '-5': must be 1 to 500"),
    (["--steps", "nan"], "argument --steps: 'nan': expected a whole number"),
    (["--steps", "501"], "argument --steps: '501': must be 1 to 500"),
    (["--batches", "0"], "argument --batches: '0': every value must be at least 1"),
    (["--batches", "-1"], "argument --batches"),
    (["--hf-batches", "1,0"], "argument --hf-batches"),
    (["--breakdown-batches", "inf"], "argument --breakdown-batches"),
    (["--parts", "bogus"],
     "argument --parts: unknown part 'bogus'; choose from roofline, engine, mixed, hf, breakdown"),
    (["--parts", "engine,"], "argument --parts: unknown part ''"),
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: unknown KV cache dtype 'fp8'; choose from auto, int8"),
    (["--kv-cache-dtype", "int8,int8"], "argument --kv-cache-dtype: 'int8,int8': give each KV cache dtype once"),
    (["--decode-attention", "grid"], "argument --decode-attention: unknown decode attention 'grid'; choose from "
     "partitioned, persistent, auto"),
    (["--long-context", "-1"], "argument --long-context: '-1': must be at least 0"),
    (["--model", "tiny", "--parts", "engine", "--long-context", "99999"], "lower --long-context"),
    (["--model", "tiny", "--parts", "hf"], "--parts: hf needs a checkpoint that transformers can build"),
    (["--model", "tiny", "--parts", "engine", "--contexts", "99999999"],
     "--contexts 99999999 with --steps 30 needs 100000066 tokens of context"),
    (["--model", "tiny", "--parts", "engine", "--contexts", "8000", "--steps", "100"], "lower --contexts"),
    (["--model", "/no/such/model"], "argument --model: /no/such/model/config.json: not found"),
    (["--out", "{dir}"], "argument --out: {dir} is a directory"),
    (["--out", "{file}/x.json"], "argument --out: cannot write {file}/x.json: Not a directory"),
])
def test_bench_rejects_bad_flags_before_loading_the_model(capsys, tmp_path, a_file, flags, says):
    paths = {"dir": str(tmp_path), "file": str(a_file)}
    line = _error(capsys, ["bench", *[f.format(**paths) for f in flags]])
    assert line.startswith("laneserve bench: error: ") and says.format(**paths) in line, line
    assert a_file.read_text() == "kept"


@NO_GPU
@pytest.mark.parametrize("parts, says", [
    ("roofline", "roofline needs a GPU"),
    ("breakdown", "breakdown needs a GPU"),
    ("roofline,hf,breakdown", "roofline needs a GPU (it times device memory copies); hf needs a checkpoint"),
])
def test_bench_parts_a_cpu_cannot_run_are_an_error_not_an_empty_table(capsys, parts, says):
    line = _error(capsys, ["bench", "--parts", parts])
    assert line.startswith("laneserve bench: error: --parts: ") and says in line, line


@NO_GPU
def test_bench_persistent_decode_attention_needs_a_gpu(capsys):
    line = _error(capsys, ["bench", "--parts", "engine", "--decode-attention", "partitioned,auto"])
    assert line.startswith("laneserve bench: error: argument --decode-attention: partitioned,auto picks among"), line
    line = _error(capsys, ["bench", "--parts", "engine", "--decode-attention", "persistent"])
    assert line.startswith("laneserve bench: error: argument --decode-attention: persistent picks among"), line


@NO_GPU
def test_bench_decode_gemv_rows_are_checked(capsys):
    line = _error(capsys, ["bench", "--parts", "engine", "--decode-gemv-rows", "0,9"])
    assert line == "laneserve bench: error: argument --decode-gemv-rows: 9: each value must be 0 to 8", line
    line = _error(capsys, ["bench", "--parts", "engine", "--decode-gemv-rows", "0,8"])
    assert line.startswith("laneserve bench: error: argument --decode-gemv-rows: 0,8 runs the GPU's"), line


def test_bench_notes_the_parts_it_skips_and_runs_the_rest(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", "tiny", "--parts", "hf,engine", "--batches", "1,2", "--contexts", "8",
                "--steps", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "laneserve bench: note: skipping --parts hf: it needs a checkpoint" in err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["part"], r["batch"], r["context"]) for r in rows] == [("engine", 1, 8), ("engine", 2, 8)]


def test_bench_long_context_gives_each_batch_one_long_request(tmp_path):
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", "tiny", "--parts", "engine", "--batches", "3", "--contexts", "8",
                "--long-context", "100", "--steps", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["batch"], row["context"], row["extra"]["long_context"]) == (3, 8, 100)


def test_bench_mixed_part_times_steps_with_a_prompt_chunk(tmp_path):
    out = tmp_path / "bench.json"
    assert cli(["bench", "--model", "tiny", "--parts", "mixed", "--batches", "2", "--contexts", "8",
                "--chunks", "16,40", "--steps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["part"], r["batch"], r["extra"]["chunk"]) for r in rows] == [("mixed", 2, 16), ("mixed", 2, 40)]
    assert all(r["ms_per_step"] > 0 and r["extra"]["launch_ms"] > 0 for r in rows)


@NO_GPU
def test_bench_piecewise_graph_variants_need_a_gpu(capsys):
    line = _error(capsys, ["bench", "--parts", "mixed", "--piecewise-graph-tokens", "0,2048"])
    assert line.startswith("laneserve bench: error: argument --piecewise-graph-tokens: a list compares"), line
    line = _error(capsys, ["bench", "--parts", "mixed", "--piecewise-graph-tokens", "-1"])
    assert line == "laneserve bench: error: argument --piecewise-graph-tokens: '-1': must be at least 0", line


def test_bench_a_batch_the_kv_pool_cannot_hold_is_named(capsys):
    """The pool's size is known once the runner is built: the check comes before any step runs."""
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--model", "tiny", "--parts", "engine", "--batches", "1,4096", "--contexts", "1024"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.startswith("laneserve bench: error: --batches 4096 at --contexts 1024 needs ") and \
        "lower --batches or --contexts" in err, err


def test_out_is_checked_without_leaving_a_file_or_touching_one(tmp_path, a_file):
    new = tmp_path / "new.json"
    assert unwritable(str(new)) == "" and not new.exists()
    assert unwritable(str(a_file)) == "" and a_file.read_text() == "kept"
    assert "is a directory" in unwritable(str(tmp_path))


@pytest.mark.parametrize("flags, says", [
    (["--seq-len", "0"], "argument --seq-len: '0': must be at least 2"),
    (["--seq-len", "-1"], "argument --seq-len: '-1': must be at least 2"),
    (["--seq-len", "1"], "argument --seq-len: '1': must be at least 2"),
    (["--seq-len", "100000"], "argument --seq-len: 100000 exceeds the model's context (8192 tokens"),
    (["--max-tokens", "0"], "argument --max-tokens: '0': must be at least 2"),
    (["--max-tokens", "-5"], "argument --max-tokens: '-5': must be at least 2"),
    (["--eval-tokens", "-1"], "argument --eval-tokens: '-1': must be at least 0"),
    (["--eval-tokens", "8192"], "argument --eval-tokens: 8192: at most 8191"),
    (["--method", "percentile", "--percentile", "nan"], "argument --percentile: must be in (0, 100]"),
    (["--method", "percentile", "--percentile", "0"], "argument --percentile: must be in (0, 100]"),
    (["--percentile", "inf"], "argument --percentile: must be in (0, 100]"),
    (["--seed", "-1"], "argument --seed: '-1': must be 0 to 18446744073709551615"),
    (["--seed", str(2**64)], "argument --seed"),
    (["--out", "{dir}"], "argument --out: {dir} is a directory"),
    (["--out", "{file}/x.json"], "argument --out: cannot write {file}/x.json: Not a directory"),
    (["--model", "/no/such/model"], "argument --model: /no/such/model/config.json: not found"),
    (["--data", "{dir}/missing.txt"], "argument --data: [Errno 2] No such file or directory"),
    (["--data", "{dir}/bad.jsonl"], "argument --data: {dir}/bad.jsonl:2: expected a JSON object with a \"text\""),
    (["--data", "{dir}/binary.txt"], "argument --data: {dir}/binary.txt: not UTF-8 text"),
    (["--data", "{dir}/blank.txt"], "argument --data: {dir}/blank.txt: no text"),
    (["--data", "{dir}/one.txt"], "argument --data: {dir}/one.txt: fewer than 2 tokens"),
])
def test_calibrate_rejects_bad_flags_before_loading_the_model(capsys, tmp_path, a_file, flags, says):
    (tmp_path / "text.txt").write_text("Calibration text, long enough to pack. " * 20)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "blank.txt").write_text("  \n")
    (tmp_path / "one.txt").write_text("x")
    paths = {"dir": str(tmp_path), "file": str(a_file)}
    argv = ["calibrate-kv", "--device", "cpu", "--data", str(tmp_path / "text.txt"), "--out",
            str(tmp_path / "scales.json"), *[f.format(**paths) for f in flags]]
    line = _error(capsys, argv)
    assert line.startswith("laneserve calibrate-kv: error: ") and says.format(**paths) in line, line
    assert not (tmp_path / "scales.json").exists() and a_file.read_text() == "kept"


def test_gemv_tune_keeps_the_fastest_alone_and_takes_a_step_only_where_batch_8_holds():
    """workers.tools.gemv_tune's choice: the device's config first, then the isolated sweep's fastest; a candidate
    wins on its batch-1 step only where its batch-8 step is within BATCH8_SLACK of the device's config's."""
    from workers.tools.gemv_tune import BATCH8_SLACK, MIN_GAIN, pick, shortlist

    assert shortlist({"a": 3.0, "b": 1.0, "c": 2.0, "d": 4.0}, "d", 2) == ["d", "b", "c"]
    assert shortlist({"a": 3.0, "b": 1.0, "c": 2.0}, "b", 2) == ["b", "c"]
    own = {1: 5.5, 8: 5.9}
    steps = {"own": own, "fast": {1: 5.4, 8: 5.9 * BATCH8_SLACK * 1.001}, "ok": {1: 5.45, 8: 5.9 * BATCH8_SLACK}}
    assert pick(steps, "own") == "ok"  # "fast" is faster at batch 1 but too slow at batch 8
    assert pick({"own": own, "slow": {1: 5.6, 8: 5.0}}, "own") == "own"
    assert pick({"own": own, "noise": {1: 5.5 * (1 - MIN_GAIN / 2), 8: 5.8}}, "own") == "own"


def test_gemv_use_configs_overrides_the_tuned_table_for_its_shapes_only():
    from workers.kernels import gemv

    tuned = gemv.gemv_config(28672, 4096)
    mine = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    gemv.use_configs({(28672, 4096): mine})
    try:
        assert gemv.gemv_config(28672, 4096) == mine and mine != tuned
        assert gemv.gemv_config(4096, 14336) == gemv._tuned_configs()[(4096, 14336)]
    finally:
        gemv.use_configs(None)
    assert gemv.gemv_config(28672, 4096) == tuned


@pytest.mark.parametrize("argv, says", [
    (["--shapes", "gate_up,up"], "argument --shapes: unknown shape 'up'; choose from qkv, o, gate_up, down, lm_head"),
    (["--reps", "0"], "argument --reps: must be at least 1"),
    (["--final-reps", "0"], "argument --final-reps: must be at least 1"),
    (["--out", "/no/such/dir/x.json"], "argument --out: cannot write /no/such/dir/x.json"),
    pytest.param([], "this machine has no GPU", marks=NO_GPU),
])
def test_gemv_tune_flags_are_checked(capsys, argv, says):
    from workers.tools.gemv_tune import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err

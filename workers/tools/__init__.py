"""Worker tools: benchmarks and int8 KV calibration, run by hand or by `laneserve bench` / `calibrate-kv`.

bench.py (`laneserve bench`: engine decode against the roofline and HF), driver.py (drives a
ModelRunner as the batcher would, for bench.py and breakdown.py), breakdown.py (a step's kernel time
by category), kernel_bench.py (the attention kernels alone), calibrate.py (`laneserve calibrate-kv`),
gpu_bench.sh (all of it in one GPU run). Tools import the runtime; the runtime never imports this package.
"""

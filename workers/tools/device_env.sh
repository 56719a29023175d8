# Sourced by the device scripts here: wheels the GPU image lacks (pyzmq, msgspec, llguidance), carried by the device
# call as .whl/, installed to /tmp/site; PYTHONPATH set either way.
if [ -d .whl ]; then
  # one at a time, in name order: a newer wheel of the same package (llguidance 1.9, manylinux_2_31) replaces an older
  # one (1.6, manylinux_2_28) where the image's glibc takes it, and one it refuses leaves the rest installed
  for wheel in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" \
      || echo "device_env: $wheel not installed"
  done
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# The bursty RAG replay of docs/perf.md (loadtest flags, less --num-requests), and a Mistral-7B-shaped checkpoint
# dir for --load-format dummy.
RAG_LOAD_ARGS="--trace rag --burstiness 0.5 --num-docs 16 --doc-tokens 1536 --question-tokens 256:512 \
--output-tokens 128:256 --hit-rate 0.8"
dummy_7b_dir() {
  python3 -c 'import tempfile; from workers.tools.bench import write_dummy_model_dir as w; print(w(tempfile.mkdtemp()))'
}

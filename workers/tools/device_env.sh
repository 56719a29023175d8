# Sourced by the device scripts here: wheels the GPU image lacks (pyzmq, msgspec), carried by the device
# call as .whl/, installed to /tmp/site; PYTHONPATH set either way.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

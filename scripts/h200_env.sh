# Source this at the start of every command on the H200 machine (the `device` tool):
#   source scripts/h200_env.sh && python3 -m pytest -m gpu tests/
# The image's numpy 2.5 breaks numba-cuda 0.30 (np.row_stack is gone), and that machine reaches
# no registry, so a numpy 2.4 wheel travels in the ignored .whl/ folder (carry [".whl"]).
# Fetch it once on a machine with PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "numpy==2.4.*"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || return 1
export PYTHONPATH=$PWD/.site:$PWD
export PYTHONUNBUFFERED=1

# nemo_replay on an NGC PyTorch image: CUDA, NCCL, Transformer Engine and Apex come with the
# image; the package and its extras are installed on top.
#
#   docker build -t nemo-replay .
#   docker run --gpus all --rm nemo-replay                                   # the test suite
#   docker run --gpus all --rm nemo-replay nemo-replay train                 # the main job
#   docker run --gpus all --rm nemo-replay torchrun --nproc-per-node 8 -m nemo_replay train configs/fsdp_gpu.yaml
#
# On Slurm with pyxis/enroot, import the image (enroot import dockerd://nemo-replay) and pass
# it to recipes/slurm.py --container-image (with --setup '' since the package is installed).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/nemo_replay
COPY setup.py README.md pytest.ini ./
COPY nemo_replay ./nemo_replay
COPY configs ./configs
COPY recipes ./recipes
COPY benchmarks ./benchmarks
COPY docs ./docs
COPY tests ./tests

# NGC images set PIP_CONSTRAINT to pin torch and the NVIDIA stack, so pip keeps the image's
# torch. Apex is the image's own build; it is never installed from PyPI (the PyPI package of
# that name is unrelated).
RUN pip install --no-cache-dir -e ".[all]" \
 && python -c "import nemo_replay, torch; print('nemo_replay', nemo_replay.__version__, 'torch', torch.__version__)"

ENV OMP_NUM_THREADS=1
CMD ["python", "-m", "pytest", "-q"]

# The training image: what every pod of the `kubernetes` launcher runs
# (`python -m torch.distributed.run ... -m ghostvis_core.run --spec <spec>`; docs/launch-kubernetes.md).
#
#   docker build -t registry.example.com/ghostvis:0.1.0 .
#   docker build --build-arg EXTRAS= -t registry.example.com/ghostvis:0.1.0-noflash .   # without flash-attn
#
# torch comes with the base image (2.13.0, CUDA 12.6, cuDNN 9), the version `make setup` installs;
# the project's `torch>=2.4` is then already satisfied and pip pulls no second copy.
ARG TORCH_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9
# EXTRAS=gpu installs the `gpu` extra (flash-attn); EXTRAS= leaves it out.
ARG EXTRAS=gpu

# flash-attn compiles against torch and nvcc (or fetches its matching prebuilt wheel): its wheel is
# built in the devel image, so that the runtime image needs no compiler.
FROM ${TORCH_IMAGE}-devel AS flash-attn
ARG EXTRAS
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MAX_JOBS=8
# Harmless where Python is not the distribution's; needed where pip refuses system installs (PEP 668).
ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 MAX_JOBS=${MAX_JOBS}
RUN mkdir /wheels && if [ -n "${EXTRAS}" ]; then \
      python -m pip install ninja packaging wheel \
      && python -m pip wheel --no-build-isolation --no-deps --wheel-dir /wheels "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

FROM ${TORCH_IMAGE}-runtime
ARG EXTRAS
ENV PYTHONUNBUFFERED=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/ghostvis
COPY --from=flash-attn /wheels /tmp/wheels
RUN if [ -n "${EXTRAS}" ]; then python -m pip install /tmp/wheels/*.whl; fi && rm -rf /tmp/wheels
COPY pyproject.toml README.md ./
COPY ghostvis_core ghostvis_core
COPY ghostvis_pipeline ghostvis_pipeline
RUN python -m pip install ".${EXTRAS:+[${EXTRAS}]}" \
 && python -c "import torch, ghostvis_core.run; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
